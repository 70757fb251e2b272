"""What the config file holds: one frozen dataclass per table, each field one key.

A field's default is the key's one default, and the keys a table allows are its fields
(`toml_keys`), so a new setting is one field here plus its check in `sections`/`models`.
Field metadata: `toml` is the key's spelling where it differs from the field (`listen` is
listen_host and listen_port; a tuple: several spellings), None for a field that is no key of
its table; `table` on `Config` names the dataclass of each top-level table. Field order is
the order of the keys in "unknown key ...; allowed: ..." errors.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from edged.autotune.settings import TuningConfig
from edged.quantize.calibration_spec import CalibrationSpec, Preprocess
from edged.selection.policy import Policy
from edged.telemetry.settings import MqttSettings
from edged.thermal.settings import ThermalConfig
from edged.tracing.settings import TraceConfig
from edged.trust.settings import SecurityConfig
from edged.vision.settings import Preprocessing

LOG_LEVELS = ("debug", "info", "warning", "error")
MODEL_CONTROL = ("none", "explicit")
MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# sun_path is 108 bytes on Linux, one of them the terminating NUL; bind() fails beyond that.
MAX_SOCKET_PATH = 107
# Upper bounds of model settings: past these a value is a typo, and taken literally it would
# wedge the daemon (a million threads, a delay of days) instead of failing here.
MAX_THREADS = 256
MAX_BATCH = 1024
MAX_MS = 3_600_000  # one hour, for timeouts, watchdogs and periods
MQTT_PROTOCOLS = ("5", "3.1.1")
_NOT_A_KEY = {"toml": None}


@dataclass(frozen=True)
class ServerConfig:
    listen_host: str | None = field(
        default="127.0.0.1",  # None: no TCP listener
        metadata={"toml": "listen"},
    )
    listen_port: int | None = field(
        default=8000,  # 0: the kernel picks a free port
        metadata={"toml": "listen"},
    )
    socket: Path | None = Path("/run/edged/edged.sock")  # None: no Unix socket
    socket_mode: int = 0o660
    state_dir: Path = Path("/var/lib/edged")
    max_body_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"
    # CPUs for the API, reload and telemetry threads; None: every online CPU that no model is
    # pinned to (and all of them when no model is pinned).
    housekeeping_cpus: tuple[int, ...] | None = None
    mlockall: bool = False  # lock the daemon's memory (no page faults on the inference path)
    # TCP connections served at once; one more gets a JSON 503 at once and is closed, so a
    # flood of clients cannot exhaust file descriptors or memory. The Unix socket has its own
    # budget, so idle TCP connections cannot lock out edgectl and health checks.
    max_connections: int = 64
    # A worker busy on one batch longer than this is hung: WATCHDOG=1 pings stop, so systemd
    # restarts the daemon. Longer than every model's watchdog_ms, so fail-over to another
    # backend gets its chance first. Default: 30 s, or twice the largest watchdog_ms.
    hang_s: float = 30.0
    socket_max_connections: int = 32
    # A connection's request line and headers: complete within header_timeout_s of its
    # opening (or of a later request's first byte), at most max_header_bytes (431 beyond).
    # A connection that sends nothing is closed when the time is up; a partial head gets 408.
    header_timeout_s: float = 10.0
    # The body within body_timeout_s of the headers (408; the request's queue slot is freed).
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0  # a kept-alive connection idle this long between requests
    max_header_bytes: int = 64 * 1024
    # Memory that JSON tensor data of large requests may take while it is decoded, estimated
    # before decoding, for all such requests at once: one alone over it gets 413.
    max_decode_bytes: int = 256 * 1024 * 1024
    # gRPC (inference.GRPCInferenceService) on TCP; None: off. Unset, it follows `listen`:
    # the same host and the next port (Triton's 8000/8001 pair; a picked port 0 stays 0).
    grpc_listen_host: str | None = field(default="127.0.0.1", metadata={"toml": "grpc_listen"})
    grpc_listen_port: int | None = field(default=8001, metadata={"toml": "grpc_listen"})
    # gRPC on a Unix socket (socket_mode applies); None: off. Unset: grpc.sock beside `socket`.
    grpc_socket: Path | None = Path("/run/edged/grpc.sock")
    # The system shared-memory extension (clients' /dev/shm regions); off, as Triton's is.
    allow_shared_memory: bool = False
    # The repository extension's load and unload: "explicit" serves them (from loopback and
    # the Unix sockets only), "none" refuses them.
    model_control: str = "none"
    # /metrics in edged's names (the default) or Triton's (nv_inference_*), for dashboards
    # that scrape Triton.
    metrics_names: str = "edged"
    # Shared memory and the repository's load/unload are for clients on the Unix sockets
    # (their file mode and group gate who connects). true: loopback TCP clients too, each as
    # the user that owns its socket (read from /proc/net/tcp at each such request).
    tcp_control: bool = False
    # Shared-memory regions registered at once, in all and per client user: each holds an
    # open descriptor (systemd/edged.service's LimitNOFILE is sized for the defaults).
    max_shm_regions: int = 64
    max_shm_regions_per_client: int = 16
    # A gRPC connection with no RPC in flight for this long is closed (streams included:
    # an open stream is an RPC in flight, so a stream idle this long is closed too).
    grpc_idle_timeout_s: float = 300.0
    # Models served at once (the file's and those a client loaded); a load past it is 409.
    max_models: int = 32
    # The largest model file (original, variant) read at load: a sparse or endless file
    # fails here instead of filling memory.
    max_model_bytes: int = 4 * 2**30
    # Folders a client's load table (the repository extension's parameters.config) may name
    # files in; empty: the folders of the config file's own models.
    load_dirs: tuple[Path, ...] = ()


@dataclass(frozen=True)
class FrigateConfig:
    """[frigate]: Frigate's ZMQ detector protocol (edged.serving.frigate_zmq), for Frigate's
    `type: zmq` detectors and other apps that speak it. Peers name a model by a name in its
    [[models]] `serves_as` (or its own name)."""

    enabled: bool = False
    # The IPC socket (Frigate's endpoint: ipc://<socket>); unset: frigate.sock beside
    # [server] socket; "": none. [server] socket_mode applies.
    socket: Path | None = Path("/run/edged/frigate.sock")
    # Loopback TCP too ("127.0.0.1:5555"); unset: not. Any local user may connect there.
    listen_host: str | None = field(default=None, metadata={"toml": "listen"})
    listen_port: int | None = field(default=None, metadata={"toml": "listen"})
    # Peers (Frigate detector processes, apps) remembered at once: the oldest is forgotten
    # and must handshake again (it does: Frigate re-handshakes after a timeout).
    max_peers: int = 256


@dataclass(frozen=True)
class BatchingConfig:
    """A model's queue and batching: what its worker (edged.serving.engine) runs with. The one
    definition of these keys' defaults; ModelConfig takes its own from here."""

    max_batch_size: int = 1
    preferred_batch_sizes: tuple[int, ...] = ()  # sorted, each <= max_batch_size
    max_queue_delay_us: int = 0
    max_queue_size: int = 64
    timeout_ms: int = 1000
    watchdog_ms: int = 5000  # one batch running longer than this: the backend has stalled
    rt_priority: int = 0  # SCHED_FIFO priority of the worker thread (1-99); 0: normal


@dataclass(frozen=True)
class DetectorConfig:
    """[models.detector]: the model is an object detector; how its outputs become boxes."""

    type: str  # the family (edged.vision.decoders.DECODERS): Frigate's model_type names
    # "coco80" (the 80 COCO names by 0-based id) or a label map file; held as (id, name).
    labels: tuple[tuple[int, str], ...] = field(default=(), metadata={"toml": "labels"})
    # Boxes scoring below this are dropped before NMS; apps apply their own threshold above.
    min_score: float = 0.25

    @property
    def label_names(self) -> dict[int, str]:
        return dict(self.labels)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path  # absolute, and the file existed at load: the original (FP32 ONNX/TFLite/IR)
    # Prebuilt versions of it (INT8 QDQ ONNX, full-integer TFLite...), each checked at load
    # to take and give the same inputs and outputs; selection picks among all of them.
    variants: tuple[Path, ...] = ()
    # Data to make INT8 variants from on the device, in the background (edged.quantize.variants).
    calibration: CalibrationSpec | None = None
    precision: str = "auto"  # "int8": serve an INT8 variant only
    backend: str = "auto"  # or "backend[:device[:precision]]", backend name canonical
    # A detector's score output (logits): accuracy is judged on detections, not raw values.
    scores: str | None = None
    threads: int | None = None
    cpus: tuple[int, ...] | None = None  # sorted, unique
    # A plain dict (not a MappingProxyType: that breaks dataclasses.asdict, pickle and
    # deepcopy), left out of the hash so the config stays hashable. Do not mutate it.
    shapes: dict[str, tuple[int, ...]] | None = field(default=None, hash=False)
    # The batching keys, flat in the [[models]] table (defaults: BatchingConfig's).
    max_batch_size: int = BatchingConfig.max_batch_size
    preferred_batch_sizes: tuple[int, ...] = BatchingConfig.preferred_batch_sizes
    max_queue_delay_us: int = BatchingConfig.max_queue_delay_us
    max_queue_size: int = BatchingConfig.max_queue_size
    timeout_ms: int = BatchingConfig.timeout_ms
    watchdog_ms: int = BatchingConfig.watchdog_ms  # then fail over to the next backend
    rt_priority: int = BatchingConfig.rt_priority
    # The period of a periodic client (a 200 Hz control loop: 5.0); None: requests arrive
    # when they arrive. Lets latency be measured from each scheduled start (coordinated
    # omission): a stall delays the requests that should have been sent during it too.
    period_ms: float | None = None
    # Keep the next verified candidate loaded for an instant fail-over; None: on when the
    # pick is an accelerator and the standby's memory fits.
    standby: bool | None = None
    # Each backend's own keys ([models.backend_options.<backend>]), read by that backend's
    # OPTIONS; by canonical backend name. `npu_cores` is the older spelling of
    # backend_options.rknn.npu_cores. Left out of the hash, like shapes; do not mutate it.
    backend_options: dict[str, dict[str, Any]] = field(
        default_factory=dict, hash=False, metadata={"toml": ("backend_options", "npu_cores")}
    )
    # How pictures become its input ([models.image]): for image inputs, Frigate's frames and
    # DeepStack uploads. None: the defaults, when a picture path needs them.
    image: Preprocessing | None = None
    detector: DetectorConfig | None = None  # [models.detector]
    # The names Frigate's ZMQ peers may ask for this model by (their model file's name):
    # a peer's name maps to a served model only through these, never to a path.
    serves_as: tuple[str, ...] = ()
    # [security] models: the original's pinned sha256 (64 hex digits), and its signature file
    # (None: <path>.sig beside it; a variant's is always beside it).
    sha256: str | None = None
    signature: Path | None = None
    # Under [security] models = "enforce": its file was not trusted when the config was read,
    # so nothing of it was read (edged.config.models._unread); the daemon refuses it.
    unread: bool = field(default=False, metadata=_NOT_A_KEY)

    @property
    def period_s(self) -> float | None:
        return None if self.period_ms is None else self.period_ms / 1000.0

    @property
    def batching(self) -> BatchingConfig:
        return BatchingConfig(**{f.name: getattr(self, f.name) for f in fields(BatchingConfig)})

    def policy(self, base: Policy) -> Policy:
        """The selection policy for this model: measurement settings from `base`, what the
        model runs with (threads, cpus, shapes, backend) from the model."""
        return replace(
            base,
            threads=self.threads,
            cpus=self.cpus,
            shapes=self.shapes,
            backend=self.backend,
            precision=self.precision,
            scores=self.scores,
            backend_options=self.backend_options,
        )


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = True  # false: no telemetry thread, no counter sampling, no publisher
    interval_s: float = 10.0
    mqtt: MqttSettings | None = None  # None: telemetry goes to the log (a summary line each)
    # No broker: every full payload appended here as a JSON line (rotated to <file>.1 at
    # 10 MB); None: full payloads only at log level debug.
    payload_file: Path | None = None


@dataclass(frozen=True)
class AuditConfig:
    trim: tuple[str, ...] = ()  # extra units to trim (mask), beside the built-in candidates
    keep: tuple[str, ...] = ()  # units never to trim


@dataclass(frozen=True)
class Config:
    source: Path = field(metadata=_NOT_A_KEY)  # absolute
    server: ServerConfig = field(default_factory=ServerConfig, metadata={"table": ServerConfig})
    selection: Policy = field(default_factory=Policy, metadata={"table": Policy})
    models: tuple[ModelConfig, ...] = field(default=(), metadata={"table": ModelConfig})
    telemetry: TelemetryConfig = field(
        default_factory=TelemetryConfig, metadata={"table": TelemetryConfig}
    )
    audit: AuditConfig = field(default_factory=AuditConfig, metadata={"table": AuditConfig})
    frigate: FrigateConfig = field(default_factory=FrigateConfig, metadata={"table": FrigateConfig})
    trace: TraceConfig = field(default_factory=TraceConfig, metadata={"table": TraceConfig})
    tuning: TuningConfig = field(default_factory=TuningConfig, metadata={"table": TuningConfig})
    security: SecurityConfig = field(
        default_factory=SecurityConfig, metadata={"table": SecurityConfig}
    )
    thermal: ThermalConfig = field(default_factory=ThermalConfig, metadata={"table": ThermalConfig})

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def toml_keys(cls: type) -> tuple[str, ...]:
    """The keys a table of `cls` may hold, in field order (module docstring)."""
    keys: list[str] = []
    for f in fields(cls):
        names = f.metadata.get("toml", f.name)
        for name in (names,) if isinstance(names, str) else names or ():
            if name not in keys:
                keys.append(name)
    return tuple(keys)


def default_of(f: Field[Any]) -> Any:
    """A field's default value; MISSING for a required one (`name`, `path`, `url`)."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


SERVER_KEYS = toml_keys(ServerConfig)
SELECTION_KEYS = toml_keys(Policy)
MODEL_KEYS = toml_keys(ModelConfig)
TELEMETRY_KEYS = toml_keys(TelemetryConfig)
MQTT_KEYS = toml_keys(MqttSettings)
AUDIT_KEYS = toml_keys(AuditConfig)
# `calibration = { ... }`: the data, a separate evaluation set, and how images become inputs
CALIBRATION_KEYS = toml_keys(CalibrationSpec) + toml_keys(Preprocess)
TOP_KEYS = {f.name: toml_keys(f.metadata["table"]) for f in fields(Config) if "table" in f.metadata}
