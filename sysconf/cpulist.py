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
    start: int | None = None
    prev = 0  # set with start: read only once start is
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


def parse_cpumask(text: str) -> list[int]:
    """The kernel's hex mask format ("f", "00000000,0000000f": 32-bit groups, high first), as
    in /proc/irq/default_smp_affinity and /sys/devices/virtual/workqueue/cpumask."""
    cleaned = text.strip().rstrip("\x00").replace(",", "")
    if not cleaned:
        return []
    try:
        value = int(cleaned, 16)
    except ValueError:
        raise ValueError(f"bad CPU mask {text.strip()!r}: not hexadecimal") from None
    return [cpu for cpu in range(value.bit_length()) if value >> cpu & 1]


def format_cpumask(cpus: Iterable[int], like: str | None = None) -> str:
    """Hex mask for `cpus`. With `like` (the file's current content) the result keeps its
    width and comma grouping, so the kernel reads it the same way it writes it."""
    value = 0
    for cpu in cpus:
        value |= 1 << cpu
    if like is None or not like.strip():
        return f"{value:x}"
    groups = like.strip().split(",")
    width = len(groups[-1])
    digits = f"{value:0{width * len(groups)}x}"
    if len(digits) > width * len(groups):
        return f"{value:x}"
    return ",".join(digits[i : i + width] for i in range(0, len(digits), width))
