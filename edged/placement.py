"""Where the daemon runs: which CPUs inference and housekeeping get (the CPU plan), its
threads pinned to housekeeping, its memory kept resident (mlockall), and what CPU set and
scheduling each of its threads ended up with (for status).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Set
from dataclasses import replace
from pathlib import Path
from typing import Any

from edged.config import Config
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

log = logging.getLogger("edged")  # the daemon's log: its lines keep their logger name


def plan_cpus(
    config: Config,
    root: SysRoot,
    allowed: Set[int],
    housekeeping: list[int] | None,
    previous: CpuPlan | None,
) -> tuple[Config, CpuPlan | None]:
    """`config` with its models on the plan's inference CPUs, and the plan (None: models
    stay unpinned). When no model names its CPUs, decide them as `edgectl apply` (the tune
    unit) does: sysconf.cpusets.decide() (an isolated set, else the last core) for
    inference, the rest for housekeeping; models without `cpus` then run on the inference
    cores, so the daemon and the tuned system agree. A model that sets `cpus` keeps them
    (and then the config, not decide(), says what is where). `root`: where CPU sets are
    read; `allowed`: this process's CPU set before pinning; `housekeeping`: the CPUs the
    daemon's threads are pinned to (None before they are); `previous`: the plan in force,
    so an unchanged one is not logged again."""
    from sysconf.cpusets import decide, read_cpusets

    pinned = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})
    if pinned or not config.models:
        plan = (
            None
            if not pinned
            else CpuPlan(
                tuple(pinned),
                tuple(config.server.housekeeping_cpus or housekeeping or ()),
                "models",
            )
        )
        if pinned:
            try:  # what the tune unit will do differently, said where operators look
                for note in decide(read_cpusets(root), pinned).notes:
                    log.warning("CPU plan: %s", note)
            except ValueError as exc:
                log.warning("CPU plan: the models' cpus: %s", exc)
        return config, plan
    try:
        plan = decide(read_cpusets(root))
    except ValueError as exc:
        log.warning("models stay unpinned: %s", exc)
        return config, None
    allowed = allowed if root.is_live else set(plan.inference)
    if not set(plan.inference) <= allowed:
        log.warning(
            "models stay unpinned: inference CPUs %s (%s) are outside this process's CPU set %s",
            list(plan.inference),
            plan.source,
            sorted(allowed),
        )
        return config, None
    if previous != plan:
        log.info(
            "CPU plan (%s): models on CPUs %s, housekeeping on %s",
            plan.source,
            plan.to_dict()["inference_list"],
            plan.to_dict()["housekeeping_list"],
        )
    return replace(
        config, models=tuple(replace(mc, cpus=plan.inference) for mc in config.models)
    ), plan


def pin_housekeeping(config: Config) -> list[int] | None:
    """Put this (main) thread, and so every thread it starts later (HTTP, reload, telemetry),
    on the housekeeping CPUs: the configured set, else the CPUs no model is pinned to. Model
    workers and their runtimes' threads set their own CPU sets. None: nothing pinned."""
    allowed = sorted(os.sched_getaffinity(0))
    wanted = config.server.housekeeping_cpus
    if wanted is None:
        pinned = {cpu for mc in config.models for cpu in (mc.cpus or ())}
        if not pinned:
            return None
        wanted = tuple(cpu for cpu in allowed if cpu not in pinned)
    usable = [cpu for cpu in wanted if cpu in allowed]
    if not usable:
        log.warning(
            "no housekeeping CPU left (models pinned to %s of %s); the API threads stay unpinned",
            sorted(set(allowed) - set(wanted)),
            allowed,
        )
        return None
    # Threads that already exist (a BLAS pool started at import, say) keep the CPU set they
    # were born with, so every task of the process is moved, not only this one. No model
    # worker exists yet: they are started after this and pin themselves.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), usable)
        except (ProcessLookupError, PermissionError):
            continue  # the thread ended meanwhile, or is not ours to move
    log.info("housekeeping threads on CPUs %s", usable)
    return usable


def lock_memory() -> bool:
    """mlockall(MCL_CURRENT | MCL_FUTURE): no page faults on the inference path. ctypes: the
    standard library has no binding, and it is one call."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    mcl_current, mcl_future = 1, 2
    if libc.mlockall(mcl_current | mcl_future) != 0:
        err = ctypes.get_errno()
        log.warning(
            "mlockall failed (%s): needs CAP_IPC_LOCK and LimitMEMLOCK=infinity; "
            "running with unlocked memory",
            os.strerror(err),
        )
        return False
    log.info("memory locked (mlockall)")
    return True


SCHED_POLICIES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}


def thread_affinities() -> list[dict[str, Any]]:
    """Per-thread CPU sets and scheduling of this process, as the kernel reports them."""
    rows = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended while we looked
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        # stat: fields after the ")" closing comm; policy is field 41, rt_priority 40.
        after = stat.rsplit(")", 1)[-1].split()
        policy = SCHED_POLICIES.get(int(after[38]), after[38]) if len(after) > 38 else "?"
        priority = int(after[37]) if len(after) > 37 else 0
        rows.append(
            {
                "tid": int(tid),
                "name": comm,
                "cpus": fields.get("Cpus_allowed_list", "?").strip(),
                "policy": policy if not priority else f"{policy}:{priority}",
                "involuntary_switches": int(fields.get("nonvoluntary_ctxt_switches", "0").strip()),
            }
        )
    return rows
