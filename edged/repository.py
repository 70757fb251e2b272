"""The daemon's side of the repository extension (`[server] model_control = "explicit"`):
load one model (from the config file, or from a client's table held to the operator's
rules) and unload one, through the same path a reload takes, serialized with reloads, the
other models untouched. A mixin of `edged.daemon.Daemon`, whose state it works on: the
model set (`models`, `failed`, `config`), the reload lock, and the loads and unloads a
reload must keep (`overrides`, `unloaded`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from edged.config import Config, ConfigError, ModelConfig, load_config

if TYPE_CHECKING:
    from collections.abc import Callable

    from edged.sdnotify import Notifier
    from edged.serving.models import ServedModel

log = logging.getLogger("edged")


class RepositoryControl:
    """Load and unload one model (what `Inference`'s ModelControl calls)."""

    # Daemon's, set in its __init__ (declared here for the reader and the type checker).
    config: Config
    models: dict[str, ServedModel]
    failed: dict[str, str]
    unloaded: set[str]
    overrides: dict[str, ModelConfig]
    _reload_lock: asyncio.Lock | None
    notifier: Notifier
    # ... and Daemon's methods (or Supervision's) it calls.
    with_cpu_plan: Callable[[Config], Config]
    load_models: Callable[
        [Config, dict[str, ServedModel]], tuple[dict[str, ServedModel], dict[str, str]]
    ]
    _stop_models: Callable[[list[ServedModel]], None]
    _status_line: Callable[[], str]
    start_variant_jobs: Callable[[], None]
    _event: Callable[..., None]

    def _with_control(self, config: Config) -> Config:
        """`config` with the loads' tables in place of the file's and the unloaded models
        left out."""
        if not (self.overrides or self.unloaded):
            return config
        names = {m.name for m in config.models}
        models = [self.overrides.get(m.name, m) for m in config.models]
        models += [mc for name, mc in self.overrides.items() if name not in names]
        kept = tuple(m for m in models if m.name not in self.unloaded)
        return replace(config, models=kept)

    async def load_one(self, name: str, table: dict[str, Any] | None) -> None:
        """Load one model through the reload path (serialized with reloads, the others
        untouched): the config file's [[models]] table for it, or `table` instead. A model
        that fails to load keeps the version it served; the error says why (RequestError)."""
        from edged.serving.inference import RequestError

        assert self._reload_lock is not None
        async with self._reload_lock:
            if name not in self.models and len(self.models) >= self.config.server.max_models:
                raise RequestError(
                    409,
                    f"cannot load {name!r}: {len(self.models)} models are served, the most "
                    f"[server] max_models allows; unload one first",
                )
            mc: ModelConfig | None
            if table is not None:
                mc = await asyncio.to_thread(self._model_table, name, table)
            else:
                try:
                    mc = (await asyncio.to_thread(load_config, self.config.source)).model(name)
                except ConfigError as exc:
                    raise RequestError(400, f"cannot load {name!r}: {exc}") from None
                if mc is None:
                    raise RequestError(
                        400, f"cannot load {name!r}: no such model in {self.config.source}"
                    )
            others = tuple(m for m in self.config.models if m.name != name)
            config = self.with_cpu_plan(replace(self.config, models=(*others, mc)))
            planned = config.model(name)
            assert planned is not None
            old = self.models.get(name)
            models, failed = await asyncio.to_thread(
                self.load_models, replace(config, models=(planned,)), {name: old} if old else {}
            )
            if name in failed:
                self.failed = {**self.failed, name: failed[name]}
                kept = "; its previous version still serves" if old is not None else ""
                raise RequestError(400, f"failed to load {name!r}: {failed[name]}{kept}")
            served = models[name]
            self.models = {**self.models, name: served}  # the atomic swap
            self.failed = {k: v for k, v in self.failed.items() if k != name}
            self.config = config
            self.unloaded.discard(name)
            if table is not None:
                self.overrides[name] = mc
            else:
                self.overrides.pop(name, None)
            if old is not None and old is not served:
                await asyncio.to_thread(self._stop_models, [old])
        self.notifier.notify(f"STATUS={self._status_line()}")
        self.start_variant_jobs()
        self._event(
            "model_load",
            f"model {name}: loaded (repository load)",
            model=name,
            replaced=old is not None and old is not served,
        )

    def _model_table(self, name: str, table: dict[str, Any]) -> ModelConfig:
        """A load's config from a client's table, held to what the operator allowed
        (edged.config.client_table). Reads the model files: called in a thread."""
        from edged.config.client_table import allowed_dirs, client_model
        from edged.config.load import live_online_cpus
        from edged.serving.inference import RequestError

        srv = self.config.server
        try:
            mc = client_model(
                table,
                name,
                self.config.source,
                srv,
                allowed_dirs(srv, self.config.models),
                live_online_cpus(),
            )
        except ConfigError as exc:
            raise RequestError(400, f"{exc.key}: {exc.problem}") from None
        if mc.watchdog_ms / 1000.0 >= srv.hang_s:
            raise RequestError(
                400,
                f"parameters.config: watchdog_ms {mc.watchdog_ms} is not shorter than "
                f"[server] hang_s ({srv.hang_s:g} s)",
            )
        return mc

    async def unload_one(self, name: str) -> None:
        """Stop serving one model: new requests are refused at once (503, "unloaded"), those
        in flight finish within DRAIN_S (or get the worker's shutting-down error)."""
        from edged.serving.inference import UnknownModel

        assert self._reload_lock is not None
        async with self._reload_lock:
            served = self.models.get(name)
            if served is None and name not in self.failed:
                if name in self.unloaded:
                    return  # unloaded already: done, as Triton answers
                raise UnknownModel(name)
            self.models = {k: v for k, v in self.models.items() if k != name}
            self.failed = {k: v for k, v in self.failed.items() if k != name}
            self.unloaded.add(name)
            if served is not None:
                await asyncio.to_thread(self._stop_models, [served])
        self.notifier.notify(f"STATUS={self._status_line()}")
        self._event("model_unload", f"model {name}: unloaded (repository unload)", model=name)
