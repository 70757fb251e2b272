"""An RK3588 board whose NPU can be unplugged and plugged back, under a steady request stream:
the fail-over test (tests/serving/test_failover.py) and benchmark (scripts/bench_failover.py).

The board is a root folder with the vendor rknpu driver's DRM node, its version and a
librknnrt.so file (tests/support/rknn_standin.board_root); the NPU is the RKNNLite stand-in at
the driver boundary (tests/support/rknn_standin.py), computing the real .rknn model's ONNX
original. Everything above that boundary is edged's own code: selection verifies the .rknn
variant against the original, the engine serves it, fail-over takes the warm standby, the
hot-plug path (`ServedModel.adapt`, what the daemon runs on a udev event) sees the node go
and come back, and the pick is verified again before it serves again.

Unplugging does what a board does: the device node goes away and the runtime's calls fail
(inference returns None, as librknnrt's does when no job can be submitted).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends import device_nodes, probe_hardware
from sysconf.hardware import HardwareFacts, find_accelerators
from sysconf.sysroot import SysRoot
from tests.support import rknn_standin

CLS = "ppocr_cls.onnx"
RKNN = "ppocr_cls_rk3588_fp16.rknn"
SHAPES = {"x": (1, 3, 48, 192)}
NODE = "dev/dri/renderD129"  # the vendor driver's DRM render node (rknn_standin.board_root)
SYSFS = "sys/class/drm/renderD129"  # and its class entry


class Board:
    """The RK3588 root, with this machine's CPUs: the facts are the live probe's, with the
    board's SoC and device nodes, and its root for the backends to read the driver there."""

    def __init__(self, folder: Path, models_dir: Path) -> None:
        self.root = rknn_standin.board_root(folder, compatible=("radxa,rock-5b", "rockchip,rk3588"))
        self.original = models_dir / CLS
        self.variant = models_dir / RKNN
        self.live = probe_hardware()
        self.npu = rknn_standin.RKNNLite
        self._stash = folder / "unplugged"

    def facts(self) -> HardwareFacts:
        board = SysRoot.at(self.root)
        return dataclasses.replace(
            self.live,
            root=str(self.root),
            soc_compatible=["radxa,rock-5b", "rockchip,rk3588"],
            accelerators=[*self.live.accelerators, *find_accelerators(board, device_nodes())],
        )

    def unplug(self) -> None:
        """The driver's device goes (its node and its sysfs class entry, as when the NPU
        resets or a module is pulled), and the runtime's calls fail."""
        self.npu.unplugged = True
        self._stash.mkdir(exist_ok=True)
        for entry in (NODE, SYSFS):
            (self.root / entry).rename(self._stash / entry.replace("/", "_"))

    def plug(self) -> None:
        for entry in (NODE, SYSFS):
            (self._stash / entry.replace("/", "_")).rename(self.root / entry)
        self.npu.unplugged = False


@contextmanager
def stand_in(board: Board) -> Iterator[type[rknn_standin.RKNNLite]]:
    """The stand-in `rknnlite` in sys.modules (outside pytest's monkeypatch: the benchmark
    uses it too), computing the .rknn with its original; undone on exit."""
    npu = rknn_standin.RKNNLite
    saved = {name: sys.modules.get(name) for name in ("rknnlite", "rknnlite.api")}
    old = (npu.originals, npu.cores, npu.unplugged, npu.raises, npu.hold, npu.made)
    npu.originals, npu.cores, npu.unplugged, npu.raises, npu.hold, npu.made = (
        {str(board.variant): board.original},
        3,
        False,
        None,
        None,
        [],
    )
    sys.modules.update(rknn_standin.modules())
    try:
        yield npu
    finally:
        npu.originals, npu.cores, npu.unplugged, npu.raises, npu.hold, npu.made = old
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@dataclass
class Outcome:
    sent: float  # time.perf_counter()
    latency_s: float | None = None  # None: it failed
    error: str | None = None
    backend: str = ""  # what served the model when the answer came


@dataclass
class Stream:
    """Requests at a steady rate to a model's worker, each answer recorded."""

    worker: object
    rate_hz: float
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="failover-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        feeds = {"x": np.random.default_rng(3).uniform(-1, 1, SHAPES["x"]).astype(np.float32)}
        period = 1.0 / self.rate_hz
        next_at = time.perf_counter()
        while not self._stop.is_set():
            outcome = Outcome(time.perf_counter())
            self.outcomes.append(outcome)

            def done(outputs, error, timing, outcome=outcome) -> None:
                outcome.backend = self.worker.session.candidate.key
                if error is not None:
                    outcome.error = f"{error.__class__.__name__}: {error}"
                else:
                    outcome.latency_s = time.perf_counter() - outcome.sent

            try:
                self.worker.submit(feeds, done)
            except Exception as exc:  # refused at the door: lost as well
                outcome.error = f"{exc.__class__.__name__}: {exc}"
            next_at += period
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def stop(self, settle_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(
            o.latency_s is None and o.error is None for o in self.outcomes
        ):
            time.sleep(0.01)

    def between(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.sent < end]


def first_served_by(outcomes: list[Outcome], key: str, after: float) -> float | None:
    """When the first request sent after `after` and answered by `key` was sent."""
    return next((o.sent for o in outcomes if o.sent >= after and o.backend == key), None)
