"""Prometheus metrics of the serving path (prometheus_client, one registry per daemon)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily

# Log-spaced buckets from 50 µs to 10 s: edge models answer in well under a millisecond up to
# seconds, and the tail is what matters.
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.duration = Histogram(
            "edged_request_duration_seconds",
            "Inference request time by phase",
            ["model", "phase"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "edged_requests",
            "Inference requests by HTTP status code",
            ["model", "code"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "edged_queue_depth",
            "Requests waiting in the model's queue",
            ["model"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "edged_batch_size",
            "Requests per executed batch",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.backend = Info(
            "edged_backend",
            "Active backend per model: what really runs it, the pick and the standby",
            ["model"],
            registry=self.registry,
        )
        self.degraded = Gauge(
            "edged_model_degraded",
            "1 while the model serves on a fall-back, not on its selected backend",
            ["model"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "edged_failovers",
            "Switches to another verified backend",
            ["model"],
            registry=self.registry,
        )

        self._children: dict[str, tuple] = {}
        self._counted: dict[tuple[str, str], Any] = {}

    def count(self, model: str, code: str) -> None:
        """One request answered with `code` (cached child: see `observe`). The caller keeps
        `model` bounded (configured names, or one label for the rest)."""
        child = self._counted.get((model, code))
        if child is None:
            child = self._counted[(model, code)] = self.requests.labels(model, code)
        child.inc()

    def observe(
        self, model: str, queue_s: float, compute_s: float, total_s: float, batch_size: int
    ) -> None:
        # Labelled children are looked up once per model: `.labels()` takes a lock and builds
        # a key on every call, which is measurable on a sub-millisecond request path.
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = (
                self.duration.labels(model, "queue"),
                self.duration.labels(model, "compute"),
                self.duration.labels(model, "total"),
                self.batch_size.labels(model),
            )
        queue, compute, total, batch = children
        queue.observe(queue_s)
        compute.observe(compute_s)
        total.observe(total_s)
        # Every request of a batch reports it; the histogram counts requests by batch size.
        batch.observe(batch_size)


class IntrusionCollector:
    """Kernel counters of what interrupts the inference cores, read at scrape time (the
    node_exporter way: no background thread, no second copy of the kernel's numbers).

    `inference_cpus()` gives the CPUs models are pinned to (labelled role="inference", the
    rest "housekeeping"); `worker_threads()` maps model name -> worker thread id."""

    def __init__(
        self,
        inference_cpus: Callable[[], set[int]],
        worker_threads: Callable[[], Mapping[str, int | None]],
    ) -> None:
        self._inference = inference_cpus
        self._workers = worker_threads

    def collect(self) -> Iterator[CounterMetricFamily]:
        from sysconf import SysRoot
        from sysconf.intrusions import interrupts_per_cpu, softirqs_per_cpu, thread_switches

        root = SysRoot()
        inference = self._inference()
        irqs = CounterMetricFamily(
            "edged_cpu_interrupts", "Hard interrupts handled per CPU", labels=["cpu", "role"]
        )
        for cpu, count in sorted(interrupts_per_cpu(root).items()):
            irqs.add_metric([str(cpu), _role(cpu, inference)], count)
        yield irqs
        soft = CounterMetricFamily(
            "edged_cpu_softirqs", "Softirqs run per CPU and kind", labels=["cpu", "role", "kind"]
        )
        for cpu, kinds in sorted(softirqs_per_cpu(root).items()):
            for kind, count in kinds.items():
                soft.add_metric([str(cpu), _role(cpu, inference), kind], count)
        yield soft
        switches = CounterMetricFamily(
            "edged_worker_involuntary_switches",
            "Times a model's worker thread was preempted",
            labels=["model"],
        )
        for model, tid in self._workers().items():
            counts = thread_switches(tid) if tid else None
            if counts is not None:
                switches.add_metric([model], counts.involuntary)
        yield switches


def _role(cpu: int, inference: set[int]) -> str:
    return "inference" if cpu in inference else "housekeeping"


# Triton's per-model inference metrics (its metrics.md: "Inference Request Metrics"), as
# counters named without `_total` and durations in cumulative microseconds, labelled
# model and version, so that dashboards built for Triton read edged unchanged. Each name is
# what edged measures for it (edged.serving.inference.ModelStatistics says what each phase
# is): (name, help, the statistics' field, "count" or "us").
TRITON_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests", "success", "count"),
    ("nv_inference_request_failure", "Number of failed inference requests", "fail", "count"),
    (
        "nv_inference_count",
        "Number of inferences performed (a batch of n counts n)",
        "inferences",
        "count",
    ),
    ("nv_inference_exec_count", "Number of model executions performed", "executions", "count"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration", "success", "us"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration", "queue", "us"),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration",
        "compute_input",
        "us",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration",
        "compute_infer",
        "us",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration",
        "compute_output",
        "us",
    ),
)


# edged's families that the Triton set renames: left out of a scrape under Triton's names.
# The others (backends, fail-overs, CPU intrusion, ...) have no Triton name and stay.
RENAMED_BY_TRITON = frozenset(
    {"edged_requests", "edged_request_duration_seconds", "edged_queue_depth"}
)


class WithoutFamilies:
    """A registry's families but `names`, for prometheus_client's `generate_latest` (which
    takes anything with `collect()`)."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterator[Any]:
        return (family for family in self.registry.collect() if family.name not in self.names)


def triton_metrics_text(rows: list[dict[str, Any]], pending: Mapping[str, int]) -> bytes:
    """`/metrics` under Triton's names (`[server] metrics_names = "triton"`), from the
    statistics extension's rows (Triton's JSON shape: one source for both) and the pending
    requests per model. Written here, not by prometheus_client: its text format names every
    counter family `..._total`, and Triton's counters (what dashboards query) have no suffix."""
    lines = []
    for name, doc, source, unit in TRITON_COUNTERS:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
        lines += [f"{name}{_label_text(row)} {_value(row, source, unit)!r}" for row in rows]
    name = "nv_inference_pending_request_count"
    lines += [
        f"# HELP {name} Instantaneous number of pending requests awaiting execution per-model",
        f"# TYPE {name} gauge",
    ]
    lines += [
        f"{name}{_label_text({'name': model})} {float(count)!r}"
        for model, count in sorted(pending.items())
    ]
    return ("\n".join(lines) + "\n").encode()


def _label_text(row: Mapping[str, Any]) -> str:
    return ",".join(f'{key}="{_escape(value)}"' for key, value in _labels(row).items()).join("{}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(row: Mapping[str, Any]) -> dict[str, str]:
    return {"model": row["name"], "version": str(row.get("version") or "1")}


def _value(row: Mapping[str, Any], source: str, unit: str) -> float:
    if source == "inferences":
        return float(row["inference_count"])
    if source == "executions":
        return float(row["execution_count"])
    phase = row["inference_stats"][source]
    return float(phase["count"]) if unit == "count" else phase["ns"] / 1000.0  # ns -> µs
