"""The one boundary to the live system's service manager: `systemctl`, run as a subprocess.

Only `sysconf.changes.Journal` uses it, and only for a mask on the live root: the journal writes
and records the mask symlink itself (exactly as for an image root, and as `systemctl mask`
would), and this class does the runtime half of `systemctl mask --now` — was the unit active,
`daemon-reload`, `stop` — and on revert `daemon-reload` and `start` of what was active before.

Every call goes through one injectable `runner`, so tests replace systemd with a fake that
records the commands and fails on demand; the machine running the tests keeps its own systemd
untouched. That also means the live path is NOT tested against a real systemd here: what the
tests prove is the journal's bookkeeping around these commands, not systemd's answers.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]

# `systemctl is-active` prints one of systemd's ActiveState words. A unit "activating" or
# "reloading" counts as running: revert starts it again. "deactivating" was on its way out.
ACTIVE_STATES = frozenset({"active", "reloading", "activating", "refreshing"})
INACTIVE_STATES = frozenset({"inactive", "failed", "deactivating", "maintenance", "unknown"})

# Seconds. A stop may wait for the unit's own TimeoutStopSec (90 s by default).
QUERY_TIMEOUT_S = 30.0
JOB_TIMEOUT_S = 150.0


def run_command(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The real runner: the command's exit code and output, never an exception for exit != 0."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


class SystemctlError(RuntimeError):
    """A systemctl call that did not do its job: which command, for which unit, and why."""

    def __init__(self, command: str, unit: str | None, detail: str) -> None:
        self.command, self.unit, self.detail = command, unit, detail
        what = f"`{command}`" + (f" for {unit}" if unit else "")
        super().__init__(f"{what} failed: {detail}")


class Systemctl:
    def __init__(self, runner: Runner = run_command, binary: str = "systemctl") -> None:
        self.runner = runner
        self.binary = binary

    def _run(
        self, args: Sequence[str], unit: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, *args]
        command = " ".join(argv)
        try:
            return self.runner(argv, timeout)
        except FileNotFoundError:
            raise SystemctlError(
                command, unit, f"{self.binary} not found (live masking needs systemd's systemctl)"
            ) from None
        except subprocess.TimeoutExpired:
            raise SystemctlError(command, unit, f"no answer within {timeout:g} s") from None
        except OSError as exc:
            raise SystemctlError(command, unit, exc.strerror or str(exc)) from None

    def _checked(self, args: Sequence[str], unit: str | None, timeout: float) -> None:
        proc = self._run(args, unit, timeout)
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout or "").strip() or "no message"
            raise SystemctlError(
                " ".join([self.binary, *args]), unit, f"exit {proc.returncode}: {said}"
            )

    def is_active(self, unit: str) -> bool:
        """Whether `unit` runs now. is-active exits non-zero for an inactive unit, so the
        answer is the word it prints; anything else (no bus, no systemd) is an error."""
        proc = self._run(["is-active", unit], unit, QUERY_TIMEOUT_S)
        words = (proc.stdout or "").split()
        state = words[0] if words else ""
        if state in ACTIVE_STATES:
            return True
        if state in INACTIVE_STATES:
            return False
        said = (proc.stderr or "").strip() or "no message"
        raise SystemctlError(
            f"{self.binary} is-active {unit}",
            unit,
            f"unexpected answer {state!r} (exit {proc.returncode}): {said}",
        )

    def daemon_reload(self) -> None:
        self._checked(["daemon-reload"], None, JOB_TIMEOUT_S)

    def stop(self, unit: str) -> None:
        self._checked(["--no-ask-password", "stop", unit], unit, JOB_TIMEOUT_S)

    def start(self, unit: str) -> None:
        self._checked(["--no-ask-password", "start", unit], unit, JOB_TIMEOUT_S)
