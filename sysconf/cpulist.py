"""The kernel's CPU list format ("0-3,6,8-9"), as in /sys/devices/system/cpu/online and
isolcpus=. Parsing errors name the text, so a bad config value or kernel file is obvious."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str) -> list[int]:
    """Sorted unique CPU numbers. Accepts the kernel's `a-b:step/group` only as `a-b`."""
    cpus: set[int] = set()
    text = text.strip().rstrip("\x00")
    if not text:
        return []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi or lo < 0:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError
                cpus.add(value)
        except ValueError:
            raise ValueError(
                f"bad CPU list {text!r}: {part!r} is not a CPU number or range"
            ) from None
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The shortest kernel-style text for `cpus` ([0,1,2,5] -> "0-2,5")."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:
            prev = cpu
        else:
            ranges.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = cpu
    if start is not None:
        ranges.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(ranges)
