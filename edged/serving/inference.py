"""The one inference path of both front ends, the HTTP API (`edged.serving.api`) and gRPC
(`edged.serving.grpc_server`): model lookup, admission, deadlines, the engine, errors as one
status each, the Prometheus metrics and the statistics extension's counters. A front end
brings only its wire format: how a request is read and decoded, how the answer is encoded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from backends.errors import BackendError, InputError
from edged.logs import Throttle, event
from edged.serving.errors import RequestError
from edged.serving.metrics import ServingMetrics
from edged.serving.models import ServedModel
from edged.serving.peers import Peer
from edged.serving.pictures import detections_output, tensors_of
from edged.serving.protocol import NAMES, VERSION, InferRequest, ProtocolError
from edged.serving.requests import EngineError, Timing
from edged.serving.statistics import Statistics
from edged.tracing.record import Trace
from edged.tracing.settings import TraceConfig
from edged.tracing.tracer import Tracer

if TYPE_CHECKING:
    from edged.serving.shared_memory import SharedMemory

# What the server always serves, on HTTP and gRPC alike (server metadata on both): the
# binary tensor extension (gRPC: raw_input_contents/raw_output_contents), the repository's
# read side (metadata, config, index; load and unload only with [server] model_control =
# "explicit", then listed as "model_repository") and the statistics extension (HTTP
# /v2/models[/{m}]/stats, gRPC ModelStatistics) and the trace extension (settings on HTTP
# /v2[/models/{m}]/trace/setting and gRPC TraceSetting). `Inference.extensions()` is the list
# served, with "system_shared_memory" when [server] allow_shared_memory is on.
EXTENSIONS = ["binary_tensor_data", "model_repository(metadata only)", "statistics", "trace"]
# Answers that refuse a request for want of room or time (logged, rate-limited).
REFUSALS = {429: "rate limited", 503: "queue full or not serving", 504: "deadline passed"}
UNKNOWN_MODEL = "_unknown"  # the model label of requests for names that are not configured

log = logging.getLogger("edged.serving")
T = TypeVar("T")


class UnknownModel(RequestError):
    """A name that is not configured: 404 on HTTP, INVALID_ARGUMENT on gRPC (Triton's)."""

    def __init__(self, name: str) -> None:
        super().__init__(404, f"unknown model {name!r}")


class UnknownVersion(RequestError):
    def __init__(self, name: str, version: str) -> None:
        super().__init__(404, f"model {name!r} has no version {version!r} (only {VERSION!r})")


class ClientGone(Exception):
    """The request ends without an answer from the path: the client went away (`code` 0, not
    counted) or the front end answered it itself (its body timed out: 408)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class ModelControl:
    """The repository extension's load and unload, done by the daemon (which owns the model
    set: `edged.daemon.Daemon.load_one` and `unload_one`). `load(name, table)`: `table` is
    the model's [[models]] table to serve instead of the config file's (None: the file's);
    a failure raises RequestError and keeps what was served. `unloaded()`: the names
    unloaded and not loaded since."""

    load: Callable[[str, dict[str, Any] | None], Awaitable[None]]
    unload: Callable[[str], Awaitable[None]]
    unloaded: Callable[[], Collection[str]]


class Inference:
    def __init__(
        self,
        models: Callable[[], Mapping[str, ServedModel]],
        metrics: ServingMetrics,
        failed: Callable[[], Mapping[str, str]] | None = None,
        shared_memory: SharedMemory | None = None,
        control: ModelControl | None = None,
        tcp_control: bool = False,
        tracer: Tracer | None = None,
    ) -> None:
        self.models = models  # a callable: reload swaps the mapping atomically
        self.failed = failed or dict
        self.metrics = metrics
        self.stats = Statistics()
        if shared_memory is None:
            from edged.serving.shared_memory import SharedMemory

            shared_memory = SharedMemory(enabled=False)
        self.shared_memory = shared_memory
        self.control = control  # None: [server] model_control = "none"
        self.tcp_control = tcp_control  # [server] tcp_control
        self.tracer = tracer or Tracer(TraceConfig(), Path("."))  # [trace]; off by default
        # Large decodes (JSON tensor data, long typed value lists) run in a thread, one at a
        # time: they are bound by the GIL, not by cores, so more at once only take it from
        # the event loop more often (and hold more memory).
        self._decoding = asyncio.Lock()
        self._refusals = Throttle(10.0)

    def extensions(self) -> list[str]:
        """The extensions really served (server metadata, HTTP and gRPC)."""
        served = list(EXTENSIONS)
        if self.control is not None:
            served[served.index("model_repository(metadata only)")] = "model_repository"
        if self.shared_memory.enabled:
            served.append("system_shared_memory")
        return served

    def ready(self) -> bool:
        """Every configured model serves a version. A model whose reload failed but whose old
        version still serves counts as serving; one that never loaded does not."""
        models = self.models()
        return all(name in models for name in self.failed()) and all(
            m.worker.alive() for m in models.values()
        )

    def model(self, name: str, version: str = "") -> ServedModel:
        """The served model by name and version ("" is the latest, the only one)."""
        served = self.models().get(name)
        if served is None:
            reason = self.failed().get(name)
            if reason:
                raise RequestError(503, f"model {name!r} is not loaded: {reason}")
            if self.control is not None and name in self.control.unloaded():
                raise RequestError(503, f"model {name!r} is unloaded (load it to serve it)")
            raise UnknownModel(name)
        if version not in ("", VERSION):
            raise UnknownVersion(name, version)
        return served

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a thread, one such decode or encode at a time (see __init__)."""
        async with self._decoding:
            return await asyncio.to_thread(fn, *args)

    async def infer(
        self,
        name: str,
        model: Callable[[], ServedModel],
        receive: Callable[[ServedModel], Awaitable[Any]],
        decode: Callable[[Any, ServedModel], Awaitable[InferRequest]],
        encode: Callable[[InferRequest, Mapping[str, np.ndarray]], Awaitable[T]],
        peer: Peer,
        transport: str = "HTTP",
        traceparent: str | bytes | None = None,
    ) -> Answer[T] | None:
        """One request: `model()` finds the served model (raising RequestError), admission
        (a full queue or a model that is not serving is refused before `receive` reads the
        request), `decode`, the shapes the model is served at, the engine (with the request's
        deadline), `encode`. Every failure leaves as a RequestError with its status, counted;
        the answer is counted when the front end has sent it (`Answer.sent`). None when
        `receive` raised ClientGone: there is nothing to send. `peer`: the client, whose own
        regions tensors in shared memory must name (`control`). `transport` and the caller's
        `traceparent` are for the trace (edged.tracing), when this request is traced."""
        start = time.perf_counter()
        trace = self.tracer.start(name, transport, traceparent)
        code = 200
        served = None
        request: InferRequest | None = None
        feeds = None
        try:
            served = model()
            worker = served.worker
            worker.check_room()
            worker.admitting += 1
            try:
                received = await receive(served)
                decoding = time.perf_counter()
                request = await decode(received, served)
                if trace is not None:
                    trace.received(start, decoding, request.id)
                if request.frames or any(a.dtype == object for a in request.inputs.values()):
                    # Pictures (BYTES inputs, raw frames) decoded and fitted off the event
                    # loop, on the housekeeping CPUs its threads run on, never the inference
                    # core.
                    request.inputs, request.fits = await self.offload(
                        tensors_of, served.pictures, request.inputs, request.frames, name
                    )
                if request.shm_inputs or request.shm_outputs:
                    self.shared_memory.check_enabled()
                    peer = self.control_peer(peer, "system shared memory")
                if request.shm_inputs:
                    self._read_shared_memory(peer, request)
                served.check_shapes(request.inputs)
                input_s = time.perf_counter() - decoding
            finally:
                worker.admitting -= 1  # no await before submit: the slot passes to the queue
            # With inputs in shared memory the engine gets its own dict of them, so this
            # request's can be emptied when it ends (see `finally`).
            feeds = dict(request.inputs) if request.shm_inputs else request.inputs
            if trace is not None:
                trace.queued(time.perf_counter(), feeds, NAMES)
            outputs, timing = await worker.infer(feeds, request.timeout_ms)
            if trace is not None:
                trace.ran(timing, served.selection.model.path.name, outputs, NAMES)
            samples = _samples(request) if worker.batchable else 1
            if request.postprocess:  # decoded off the event loop, as pictures are
                outputs = await self.offload(
                    detections_output, served.pictures, outputs, request.fits, name
                )
            encoding = time.perf_counter()
            if request.shm_outputs:  # all checked before any is written
                shm = self.shared_memory
                request.shm_results = shm.write_outputs(peer, request.shm_outputs, outputs)
            payload = await encode(request, outputs)
            output_s = time.perf_counter() - encoding
            if trace is not None:
                trace.sending(encoding + output_s)
        except ClientGone as exc:
            code = exc.code
            return None
        except RequestError as exc:
            code = exc.status
            raise
        except (ProtocolError, InputError) as exc:
            code = 400
            raise RequestError(400, str(exc)) from None
        except EngineError as exc:
            code = exc.status
            raise RequestError(exc.status, str(exc), getattr(exc, "retry_after", None)) from None
        except BackendError as exc:
            code = 500
            raise RequestError(500, str(exc)) from None
        finally:
            if request is not None and request.shm_inputs:
                # No view of a client's region outlives the request: an error's traceback
                # (which a front end may keep a while) holds this frame, and so `request`.
                request.inputs.clear()
                feeds = None
            if code not in (0, 200):  # 200 is counted once the answer is out
                # Unknown names share one label value: a scan of names must not grow the
                # metric without bound. Configured-but-failed models keep their own name.
                known = served is not None or name in self.models()
                label = name if code != 404 or known else UNKNOWN_MODEL
                self.metrics.count(label, str(code))
                if served is not None:
                    self.stats.failed(name, time.perf_counter() - start)
                if code in REFUSALS:
                    self._refused(label, code, trace)
                if trace is not None:
                    trace.status = code
                    trace.sent(time.perf_counter())
                    self.tracer.finish(trace)
        return Answer(self, name, payload, start, timing, input_s, output_s, samples, trace)

    def _refused(self, model: str, code: int, trace: Trace | None) -> None:
        """A request refused or timed out: one event per model and code every 10 s, with
        how many there were (a flood must not flood the log)."""
        count = self._refusals.due((model, code))
        if count is not None:
            parent = trace.parent if trace is not None else None
            event(
                log,
                "refused",
                "model %s: %d request(s) answered %d (%s) since the last such line",
                model,
                count,
                code,
                REFUSALS[code],
                level=logging.WARNING,
                model=model,
                status=code,
                count=count,
                trace_id=parent.trace_id if parent is not None else None,
            )

    def _read_shared_memory(self, peer: Peer, request: InferRequest) -> None:
        """The request's shared-memory inputs, read from the caller's regions, beside the
        others."""
        shm = self.shared_memory
        for name, (dtype, shape, ref) in request.shm_inputs.items():
            request.inputs[name] = shm.read_input(peer, name, dtype, shape, ref)

    # -- the repository extension's load and unload -------------------------------------
    def check_control(self, peer: Peer, what: str) -> tuple[ModelControl, Peer]:
        """Model load or unload (`what`) is served and `peer` may ask for it."""
        if self.control is None:
            raise RequestError(
                403,
                f'model {what} is off ([server] model_control = "none"); set it to '
                f'"explicit", or edit the config file and reload (SIGHUP)',
            )
        return self.control, self.control_peer(peer, f"model {what}")

    def control_peer(self, peer: Peer, what: str) -> Peer:
        """`peer`, allowed to act on this machine's resources (`what`: shared memory, model
        load/unload), with its uid where it can be known. The Unix sockets' clients may (the
        sockets' mode and group say who connects); loopback TCP clients only with
        [server] tcp_control, as the user owning their socket (edged.serving.peers)."""
        if peer.transport == "tcp":
            if not peer.local:
                raise RequestError(403, f"{what} is accepted from this machine only")
            if not self.tcp_control:
                raise RequestError(
                    403,
                    f"{what} is accepted on the Unix sockets only ([server] tcp_control = "
                    f"false); connect there, or set tcp_control = true",
                )
            peer = peer.with_uid()
            if peer.uid is None:
                raise RequestError(403, f"{what}: cannot tell which user {peer.address} is")
        return peer

    async def load(self, name: str, parameters: Mapping[str, Any], peer: Peer) -> None:
        """Load (or reload) `name`. `parameters` may hold "config": the model's [[models]]
        table as a JSON object (a string, as tritonclient sends it), replacing the file's
        table for that model until it is loaded again without one."""
        control, _ = self.check_control(peer, "load")
        table = None
        config = parameters.get("config")
        if config is not None:
            try:
                table = json.loads(config) if isinstance(config, str | bytes) else config
            except ValueError as exc:
                raise RequestError(400, f"parameters.config is not valid JSON: {exc}") from None
            if not isinstance(table, dict):
                raise RequestError(
                    400, "parameters.config must be a JSON object: the model's [[models]] table"
                )
        unknown = sorted(set(parameters) - {"config"})
        if unknown:
            raise RequestError(400, f"load parameter {unknown[0]!r} is not supported (config)")
        await control.load(name, table)

    async def unload(self, name: str, peer: Peer) -> None:
        control, _ = self.check_control(peer, "unload")
        await control.unload(name)

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """The statistics extension's `model_stats` (Triton's shape): every served model, or
        the one named (RequestError as `model` raises)."""
        names = [self.model(name, version).name] if name else sorted(self.models())
        return [self.stats.model(n).to_dict(n) for n in names]

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Each configured model with its state: READY while it serves, UNAVAILABLE with the
        reason when it did not load (or its worker stopped)."""
        index = []
        models, failed = self.models(), self.failed()
        unloaded = set(self.control.unloaded()) if self.control is not None else set()
        for name in sorted(set(models) | set(failed) | unloaded):
            served = models.get(name)
            if served is not None and served.worker.alive():
                entry = {"name": name, "version": VERSION, "state": "READY", "reason": ""}
            else:
                reason = failed.get(name) or (
                    "unloaded" if name in unloaded else "its worker is not running"
                )
                entry = {"name": name, "version": VERSION, "state": "UNAVAILABLE"}
                entry["reason"] = reason
            if not ready_only or entry["state"] == "READY":
                index.append(entry)
        return index


def _samples(request: InferRequest) -> int:
    """A batchable model's request carries as many inferences as its batch dim (Triton counts
    inference_count so)."""
    first = next(iter(request.inputs.values()), None)
    shape = getattr(first, "shape", ())
    return int(shape[0]) if shape else 1


@dataclass
class Answer(Generic[T]):
    """An encoded answer; `sent()` once it is out counts it (metrics and statistics)."""

    inference: Inference
    name: str
    payload: T
    start: float
    timing: Timing
    input_s: float
    output_s: float
    samples: int
    trace: Trace | None = None

    def sent(self) -> None:
        now = time.perf_counter()
        total = now - self.start
        if self.trace is not None:
            self.trace.sent(now)
            self.inference.tracer.finish(self.trace)
        timing = self.timing
        metrics = self.inference.metrics
        metrics.count(self.name, "200")
        metrics.observe(self.name, timing.queue_s, timing.compute_s, total, timing.batch_size)
        self.inference.stats.succeeded(self.name, self, total)
