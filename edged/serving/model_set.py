"""The served models of a config: what each depends on (`model_key`), and loading them,
keeping those a reload did not change and, when one fails, its version already served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from edged.config import Config, ModelConfig
from edged.logs import event
from edged.serving.models import ServedModel, load_model
from edged.serving.pictures import pictures_of
from edged.trust.verify import UntrustedModel, activate
from sysconf.hardware import HardwareFacts

log = logging.getLogger("edged")  # the daemon's log: its lines keep their logger name

LOAD_TIMEOUT_S = 180.0  # systemd start-timeout extension granted per model load


def model_key(mc: ModelConfig) -> tuple:
    """What a served model depends on; a reload reloads a model when this changes: every
    field of its [[models]] table but the name (derived, so a key added to ModelConfig is
    never forgotten here), and the model files' size and modification time."""

    def file_id(path: Path) -> tuple | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def part(name: str, value: Any) -> Any:
        if name == "path":
            return str(value), file_id(value)
        if name == "variants":
            return tuple((str(v), file_id(v)) for v in value)
        if isinstance(value, dict):  # shapes, backend_options: dicts, not hashable
            return repr(sorted(value.items()))
        return repr(value)  # calibration's spec holds lists; repr covers every field

    return tuple(part(f.name, getattr(mc, f.name)) for f in fields(mc) if f.name != "name")


def load_models(
    config: Config,
    current: Mapping[str, ServedModel],
    hw: HardwareFacts,
    notify: Callable[..., object],
    on_failover: Callable[[str], Callable[[str], None]],
) -> tuple[dict[str, ServedModel], dict[str, str]]:
    """Models for `config`: unchanged ones are kept, the rest loaded. A model that fails
    keeps its current version when it has one. `notify`: sd_notify lines (a model's load
    asks systemd for time); `on_failover(name)`: that model's fail-over hook."""
    models: dict[str, ServedModel] = {}
    failed: dict[str, str] = {}
    state_dir = config.server.state_dir
    trust = activate(config.security)  # the policy of every load from now on
    for mc in config.models:
        key = model_key(mc)
        old = current.get(mc.name)
        if old is not None and old.config_key == key:
            models[mc.name] = old
            continue
        # Selecting may benchmark every backend: ask systemd for time, model by model.
        notify(
            f"STATUS=loading model {mc.name}", f"EXTEND_TIMEOUT_USEC={int(LOAD_TIMEOUT_S * 1e6)}"
        )
        start = time.perf_counter()
        try:
            # Every file of the family checked before any is read by a runtime (edged.trust).
            verdicts = [trust.require(mc.path, mc.sha256, mc.signature, f"model {mc.name}")]
            verdicts += [trust.require(v, what=f"model {mc.name} variant") for v in mc.variants]
            if mc.unread:  # trusted only since its config was read: that read checked nothing
                raise UntrustedModel(
                    f"refused by [security] models = enforce: model {mc.name}: its files were "
                    "not trusted when the config was read, so none was checked; reload "
                    "(SIGHUP) to check them again"
                )
            served = load_model(
                mc.name,
                mc.path,
                mc.policy(config.selection),
                mc.batching,
                hw,
                state_dir,
                key,
                on_failover=on_failover(mc.name),
                period_s=mc.period_s,
                variants=mc.variants,
                calibration=mc.calibration,
                standby=mc.standby,
            )
            session = served.worker.session
            try:
                served.pictures = pictures_of(mc, session.inputs, session.outputs)
            except Exception:
                stop_workers([served], 1.0)  # it was never served: nothing to drain
                raise
            served.serves_as = mc.serves_as
            made = [trust.made_verdicts.get(str(v)) for v in served.variants]
            verdicts += [v for v in made if v is not None]
            served.trust = [v.to_dict() for v in verdicts if v.state != "off"]
        except Exception as exc:  # any failure: this model is not served, others are
            reason = str(exc) or exc.__class__.__name__
            event(
                log,
                "load_failed",
                "model %s: not loaded: %s",
                mc.name,
                reason,
                level=logging.ERROR,
                model=mc.name,
                reason=reason,
            )
            failed[mc.name] = reason
            if old is not None:
                models[mc.name] = old
            continue
        sel = served.selection.selected
        assert sel is not None  # a loaded model has its pick
        event(
            log,
            "selection",
            "model %s: %s on %s:%s (%s) p99 %.3f ms, %s in %.2f s",
            mc.name,
            served.selection.model.name,
            sel.candidate.backend,
            sel.candidate.device,
            sel.precision,
            sel.latency.p99_ms if sel.latency else float("nan"),
            "cached selection" if served.selection.from_cache else "measured",
            time.perf_counter() - start,
            model=mc.name,
            variant=served.selection.model.name,
            backend=sel.candidate.key,
            precision=sel.precision,
            quantized=served.selection.model.precision not in ("fp32", "fp16", "bf16"),
            p99_ms=round(sel.latency.p99_ms, 3) if sel.latency else None,
            from_cache=served.selection.from_cache,
            why=served.selection.why or None,
        )
        if served.selection.why:
            log.info("model %s: %s", mc.name, served.selection.why)
        for warning in served.selection.warnings:
            log.warning("model %s: %s", mc.name, warning)
        models[mc.name] = served
    return models, failed


def stop_workers(models, drain_s: float) -> None:
    """Stop all workers at once, each bounded by `drain_s`, so N models take `drain_s`."""
    for served in models:
        if served.job is not None:
            served.job.stop()
    workers = [served.worker for served in models]
    threads = [threading.Thread(target=w.stop, args=(drain_s,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
