"""THM: thermal zones past their trips, engaged cooling, thermally capped CPUs and the
Raspberry Pi firmware's throttled bits, from `sysconf.thermal.read_thermal`."""

from __future__ import annotations

from collections.abc import Iterator

from sysconf.audit.findings import AuditContext, Catalogue, Evidence, Finding, Rule, register
from sysconf.thermal import CPU_DIR, THERMAL_DIR, THROTTLED_PATH, read_thermal

CATALOGUE = Catalogue(
    prefix="THM",
    sections={"THM": 60},
    rules={
        "THM-ZONES": Rule("info", "thermal zones are readable"),
        # past a passive trip it warns; past a hot or critical one the kernel cuts hard: fail
        "THM-ZONE-TRIP": Rule("warn", "every thermal zone is below its trips", escalated="fail"),
        "THM-COOLING-ACTIVE": Rule("info", "no cooling device is engaged"),
        "THM-CPU-CAPPED": Rule("warn", "no CPU is thermally capped"),
        "THM-PI-THROTTLED-NOW": Rule("fail", "the Raspberry Pi firmware reports no throttling now"),
        "THM-PI-THROTTLED-BOOT": Rule(
            "warn", "the Raspberry Pi firmware reports no throttling since boot"
        ),
    },
)
_finding = CATALOGUE.finding
_COOLING = "improve cooling; a capped core runs inference slower"
_POWER = "use the official power supply and improve cooling"


@register("thermal", CATALOGUE, order=40)
def check_thermal(ctx: AuditContext) -> Iterator[Finding]:
    state = read_thermal(ctx.root)
    if not state.zones:
        yield _finding(
            "THM-ZONES",
            "skip",
            "no thermal zones (VM?)",
            evidence=(Evidence(THERMAL_DIR, "no thermal_zone*", "thermal zones"),),
        )
        return

    for zone in state.zones:
        label = f"{zone.name} ({zone.type})" if zone.type else zone.name
        path = f"{THERMAL_DIR}/{zone.name}/temp"
        zone_state = zone.state
        trips = ", ".join(f"{t.type} {t.temp_c:g} °C" for t in zone.trips) or "no trips"
        observed = "unknown" if zone.temp_c is None else f"{zone.temp_c:g} °C"
        if zone_state == "ok":
            yield _finding(
                "THM-ZONE-TRIP",
                "pass",
                f"{label} is below its passive/hot/critical trips",
                evidence=(Evidence(path, observed, f"below {trips}"),),
                subject=zone.name,
            )
            continue
        bad = zone_state in ("hot", "critical")
        yield _finding(
            "THM-ZONE-TRIP",
            "fail" if bad else "warn",
            f"{label} is past its {zone_state} trip point: the kernel is cutting performance",
            escalated=bad,
            evidence=(Evidence(path, observed, f"below {trips}"),),
            remedy="improve cooling (heatsink, fan, airflow) or lower the inference load",
            subject=zone.name,
        )

    active = [dev for dev in state.cooling if dev.active]
    for dev in active:
        yield _finding(
            "THM-COOLING-ACTIVE",
            "warn",
            f"cooling device {dev.name} ({dev.type}) is engaged",
            evidence=(
                Evidence(
                    f"{THERMAL_DIR}/{dev.name}/cur_state",
                    str(dev.cur_state),
                    f"0 (max {dev.max_state})",
                ),
            ),
            subject=dev.name,
        )
    if not active:
        yield _finding("THM-COOLING-ACTIVE", "pass")

    capped = state.thermally_capped_cpus()
    freqs = {f.cpu: f for f in state.cpufreq}
    for cpu in capped:
        f = freqs[cpu]
        yield _finding(
            "THM-CPU-CAPPED",
            "warn",
            f"CPU {cpu} is thermally capped below its maximum frequency",
            evidence=(
                Evidence(
                    f"{CPU_DIR}/cpu{cpu}/cpufreq/scaling_max_freq",
                    f"{f.scaling_max_khz} kHz",
                    f"{f.max_khz} kHz",
                ),
            ),
            remedy=_COOLING,
            subject=f"cpu{cpu}",
        )
    if not capped:
        yield _finding("THM-CPU-CAPPED", "pass")

    throttled = state.throttled
    if throttled is None:
        return
    raw = f"0x{throttled.raw:x}"
    now = throttled.now
    yield _finding(
        "THM-PI-THROTTLED-NOW",
        "fail" if now else "pass",
        f"the Raspberry Pi firmware reports now: {', '.join(now)}" if now else None,
        evidence=(Evidence(THROTTLED_PATH, raw, "0x0 in bits 0-3"),),
        remedy=_POWER if now else "",
    )
    since = throttled.since_boot
    yield _finding(
        "THM-PI-THROTTLED-BOOT",
        "warn" if since else "pass",
        f"the Raspberry Pi firmware reports since boot: {', '.join(since)}" if since else None,
        evidence=(Evidence(THROTTLED_PATH, raw, "0x0 in bits 16-19"),),
        remedy=_POWER if since else "",
    )
