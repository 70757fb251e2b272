"""sysconf.cpulist: the kernel's CPU list text, both ways, and errors that name the text."""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import pytest

from sysconf.cpulist import MAX_CPUS, format_cpulist, parse_cpulist


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,5,7-8", [0, 1, 2, 3, 5, 7, 8]),
        ("", []),
        ("0", [0]),
        ("0-1", [0, 1]),  # the kernel prints a pair as a range too
        ("1,3,5", [1, 3, 5]),
        ("0-127", list(range(128))),
        ("2-3,64-65,8190-8191", [2, 3, 64, 65, 8190, 8191]),
    ],
)
def test_round_trip(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus
    assert format_cpulist(cpus) == text


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3\n", [0, 1, 2, 3]),  # sysfs: /sys/devices/system/cpu/online
        ("0-3\x00", [0, 1, 2, 3]),  # a device-tree string property
        ("0-3\n\x00", [0, 1, 2, 3]),
        ("  1,4-5 \n", [1, 4, 5]),
        ("\n", []),
        ("\x00", []),
        ("0 - 2, 4", [0, 1, 2, 4]),
    ],
)
def test_kernel_spacing(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


def test_normalises_order_and_overlap() -> None:
    assert parse_cpulist("5,0-2,1,2-3") == [0, 1, 2, 3, 5]
    assert format_cpulist([5, 3, 3, 0, 1, 2]) == "0-3,5"
    assert format_cpulist(iter({7, 6, 9})) == "6-7,9"
    assert format_cpulist([]) == ""


def test_random_sets_round_trip() -> None:
    rng = random.Random(20240611)
    for _ in range(500):
        cpus = sorted(rng.sample(range(96), rng.randint(0, 96)))
        text = format_cpulist(cpus)
        assert parse_cpulist(text) == cpus
        assert re.fullmatch(r"(\d+(-\d+)?(,\d+(-\d+)?)*)?", text)
        # Shortest form: no range could be merged with its neighbour.
        bounds = [[int(x) for x in part.split("-")] for part in text.split(",") if part]
        for left, right in itertools.pairwise(bounds):
            assert right[0] > left[-1] + 1


@pytest.mark.parametrize("name", ["online", "possible", "present"])
def test_this_machines_kernel_lists(name: str) -> None:
    """The kernel formats these with the same shortest-range rule, so text survives a trip."""
    path = Path("/sys/devices/system/cpu") / name
    text = path.read_text()
    cpus = parse_cpulist(text)
    assert cpus
    assert format_cpulist(cpus) == text.strip()


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("1-", "1-"),
        ("a", "a"),
        ("3-1", "3-1"),
        ("-1", "-1"),
        ("0-3,1-", "1-"),
        ("0,,1", ""),
        ("0-7:2/4", "0-7:2/4"),  # the kernel's stride form is not supported: say so
        ("1_0", "1_0"),  # int() would read 10
        ("+1", "+1"),
        ("0x3", "0x3"),
        ("\u0661", "\u0661"),  # ARABIC-INDIC DIGIT ONE: int() would read 1
        ("1 2", "1 2"),
    ],
)
def test_errors_name_the_text(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))) as err:
        parse_cpulist(text)
    assert repr(bad) in str(err.value)
    assert str(err.value).startswith("bad CPU list")


def test_backwards_range_says_so() -> None:
    with pytest.raises(ValueError, match="backwards"):
        parse_cpulist("3-1")


def test_beyond_kernel_limit() -> None:
    assert parse_cpulist(f"{MAX_CPUS - 1}") == [MAX_CPUS - 1]
    with pytest.raises(ValueError, match=r"'0-4000000000'.*8192"):
        parse_cpulist("0-4000000000")
    with pytest.raises(ValueError, match=str(MAX_CPUS)):
        parse_cpulist(str(MAX_CPUS))
