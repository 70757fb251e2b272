"""The daemon's side of making a model's INT8 variants in the background: one child process
(`python -m edged.quantize.variants`, see that module) watched by one thread.

The thread that starts it runs on the housekeeping CPUs, so the child inherits them; the
child puts itself at SCHED_IDLE. Readiness never waits for it: the model already serves its
original (and given variants). When the child is done, `on_done` gets its JSON report (in
this thread) and swaps the new pick in. What status shows: state, start, duration, the
child's peak memory, what it made and picked, or why it failed.

The child's two pipes are read at once, stdout by a helper thread: reading stderr to its end
first deadlocked as soon as the child (or a runtime it loads) wrote more to stdout than the
pipe holds (64 KiB), since the child then blocked in write() and never closed stderr. Both are
read in bounded pieces: of stdout only the last STDOUT_TAIL_BYTES are kept (the report is its
last line), of stderr lines of at most LINE_BYTES (a longer one is taken in pieces), so
whatever a child prints costs this process bounded memory.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from edged.logs import event

if TYPE_CHECKING:
    from edged.config import Config
    from edged.selection.decision import Selection
    from edged.serving.models import ServedModel

log = logging.getLogger("edged.quantize.variants")
STDOUT_TAIL_BYTES = 1 << 20  # the report line is a few KiB
LINE_BYTES = 4096  # of a stderr line kept for progress and for the error tail


class VariantJob:
    def __init__(
        self, model: str, command: Sequence[str], on_done: Callable[[dict[str, Any]], str]
    ) -> None:
        self.model = model
        self.command = list(command)
        self.on_done = on_done  # returns what was done with the result, for status
        self.state = "pending"  # running, done, failed, stopped
        self.started: float | None = None
        self.duration_s: float | None = None
        self.report: dict[str, Any] = {}
        self.result = ""
        self.error: str | None = None
        self.progress = ""
        self._proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"variants-{model}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the child (a reload replaced the model, or the daemon stops)."""
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "started": self.started,
            "duration_s": self.duration_s,
            "peak_rss_bytes": self.report.get("peak_rss_bytes"),
            "made": (self.report.get("made") or {}).get("variants"),
            "pick": self.report.get("pick"),
            "result": self.result or None,
            "scheduling": self.report.get("scheduling"),
            "cpus": self.report.get("cpus"),
            "progress": self.progress or None,
            "error": self.error,
        }

    def _run(self) -> None:
        self.started = time.time()
        self.state = "running"
        start = time.perf_counter()
        log.info(
            "model %s: making INT8 variants from its calibration data in the background", self.model
        )
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
            assert self._proc.stdout is not None and self._proc.stderr is not None
            stdout = _Tail(self._proc.stdout, STDOUT_TAIL_BYTES)
            tail = self._read_stderr(self._proc.stderr)
            out = stdout.result()
            code = self._proc.wait()
        except OSError as exc:
            self._finish(start, "failed", f"cannot start the job: {exc}")
            return
        if self._stopping.is_set():
            self._finish(start, "stopped", None)
            return
        lines = [line for line in out.splitlines() if line.strip()]
        try:
            self.report = json.loads(lines[-1]) if lines else {}
        except ValueError:
            self.report = {}
        if code != 0 or not self.report.get("ok"):
            why = self.report.get("error") or "; ".join(tail[-3:]) or f"exit code {code}"
            self._finish(start, "failed", why)
            return
        try:
            self.result = self.on_done(self.report)
        except Exception as exc:  # the model keeps what it serves; status says why
            self._finish(start, "failed", f"swapping in the result failed: {exc}")
            return
        self._finish(start, "done", None)

    def _read_stderr(self, stream: IO[bytes]) -> list[str]:
        """Progress lines into `progress` until the child closes stderr; the last ten other
        lines, for the error of a failed job."""
        tail: list[str] = []
        for chunk in iter(lambda: stream.readline(LINE_BYTES), b""):
            line = chunk.decode("utf-8", "replace").rstrip()
            if line.startswith("progress "):
                self.progress = line.removeprefix("progress ")
            elif line:
                tail = [*tail[-9:], line[:500]]
        stream.close()
        return tail

    def _finish(self, start: float, state: str, error: str | None) -> None:
        self.duration_s = round(time.perf_counter() - start, 2)
        self.state, self.error = state, error
        if error:
            event(
                log,
                "variants_failed",
                "model %s: making variants failed: %s",
                self.model,
                error,
                level=logging.ERROR,
                model=self.model,
                reason=error,
            )
        elif state == "done":
            peak = self.report.get("peak_rss_bytes") or 0
            event(
                log,
                "variants_done",
                "model %s: variants done in %.1f s (peak %.0f MiB): %s",
                self.model,
                self.duration_s,
                peak / 2**20,
                self.result,
                model=self.model,
                duration_s=self.duration_s,
                peak_rss_bytes=peak,
                result=self.result,
            )


class _Tail:
    """The last `keep` bytes of a pipe, read to its end by a thread of its own."""

    def __init__(self, stream: IO[bytes], keep: int) -> None:
        self._stream, self._keep = stream, keep
        self._data = bytearray()
        self._thread = threading.Thread(target=self._read, name="variants-stdout", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._stream:
            for chunk in iter(lambda: self._stream.read(65536), b""):
                self._data += chunk
                if len(self._data) > 2 * self._keep:  # trim now and then, not per chunk
                    del self._data[: -self._keep]

    def result(self) -> str:
        """Once the child closed its stdout: the kept tail as text."""
        self._thread.join()
        return bytes(self._data[-self._keep :]).decode("utf-8", "replace")


def start_variant_jobs(
    models: Mapping[str, ServedModel],
    config: Config,
    cpus: Sequence[int],
    on_made: Callable[[ServedModel, dict[str, Any]], str],
) -> None:
    """One background job per served model whose calibration data has no variants made
    yet, its child on `cpus` (the housekeeping CPUs); `on_made(served, report)` swaps the
    result in. Called after READY: readiness never waits for them."""
    from edged.quantize.variants import background_command

    for name, served in models.items():
        if not served.variants_pending or served.job is not None:
            continue
        mc = config.model(name)
        given = mc.variants if mc else ()
        assert served.calibration is not None  # variants are pending only with calibration
        command = background_command(
            served.original.path,
            given,
            served.calibration,
            config.server.state_dir,
            served.policy,
            cpus,
        )
        served.job = VariantJob(name, command, functools.partial(on_made, served))
        served.job.start()  # this thread is on the housekeeping CPUs; the child too


def stored_decision(
    served: ServedModel, report: dict[str, Any], state_dir: Path
) -> tuple[Selection, tuple[Path, ...]]:
    """The decision a finished job stored under the served policy's key, and the variants
    it made."""
    from edged.selection.decision import load_cached
    from edged.selection.select import family_of
    from edged.trust.verify import active

    variants = tuple(Path(v) for v in report["variants"])
    trust = active()
    for variant in variants:  # served only while their origin is trusted (edged.trust)
        verdict = trust.require_made(variant, served.original.path, f"model {served.name}")
        if verdict.state != "off":
            served.trust = [t for t in served.trust if t["path"] != str(variant)]
            served.trust.append(verdict.to_dict())
    family = family_of(served.original.path, variants)
    selection = load_cached(state_dir, family, report["selection_key"])
    if selection is None:
        raise RuntimeError(f"no stored decision under {report['selection_key']}")
    return selection, variants
