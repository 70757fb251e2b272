"""The kernel's CPU list format ("0-3,6,8-9"), as in /sys/devices/system/cpu/online and
isolcpus=. Parsing errors name the text, so a bad config value or kernel file is obvious."""

from __future__ import annotations

from collections.abc import Iterable

# The largest NR_CPUS the kernel can be built with (x86 MAXSMP); also keeps a typo such as
# "0-4000000000" from building a four-billion-element list.
MAX_CPUS = 8192


def parse_cpulist(text: str) -> list[int]:
    """Sorted unique CPU numbers. Accepts the kernel's `a-b:step/group` only as `a-b`."""
    cpus: set[int] = set()
    text = text.strip().rstrip("\x00")
    if not text:
        return []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        lo, hi = lo.strip(), hi.strip()
        # Plain ASCII digits only: int() would also take "1_0", "+1" and other scripts' digits.
        if not (_is_number(lo) and (_is_number(hi) if dash else True)):
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a CPU number or range")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first > last:
            raise ValueError(f"bad CPU list {text!r}: range {part!r} runs backwards")
        if last >= MAX_CPUS:
            raise ValueError(
                f"bad CPU list {text!r}: CPU {last} is beyond the kernel's limit of {MAX_CPUS}"
            )
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


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
