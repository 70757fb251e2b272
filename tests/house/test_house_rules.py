"""The house rules, as tests (rules that are not tests do not last):

* a module in sysconf/, backends/ or edged/ holds at most MAX_LINES lines, unless
  LONG_MODULES names it and says why; none holds more than HARD_MAX_LINES, and an entry that
  no longer needs its place is an error too, so the list only shrinks;
* every package says in its docstring what it holds (a newcomer reads those first);
* no test module imports another one: what tests share lives in tests/support/.

The layers and the order inside edged/ are tests/house/test_layers.py's.
"""

from __future__ import annotations

import ast

from tests.support import REPO

PACKAGES = ("sysconf", "backends", "edged")
MAX_LINES = 500
HARD_MAX_LINES = 700
# Modules allowed past MAX_LINES, each with why. Each is a candidate to split when it grows.
LONG_MODULES = {
    "sysconf/dtcheck.py": "the device-tree rules, one function each over one parsed tree; "
    "split by rule family when another family comes",
    "sysconf/confined.py": "RESOLVE_IN_ROOT by hand: resolving and every file operation in one "
    "place, so no operation can skip the resolution",
    "sysconf/thermal.py": "thermal zones, cooling, cpufreq and system load read in one pass for "
    "telemetry; the readers share the SysRoot walking",
    "sysconf/hardware.py": "the one hardware probe: HardwareFacts and the readers of cpuinfo, "
    "DMI, device tree and device nodes it is made from",
    "sysconf/fdt.py": "the flattened device tree reader (hand-written, see its docstring) and "
    "its live-folder twin, which must agree field by field",
    "sysconf/tuning.py": "kernel noise and boot-line planners; each is short, they share the "
    "boot-line editing",
    "sysconf/changes.py": "the crash-safe journal's state machine (apply, revert, stale boots); "
    "its records and unit links are apart",
    "edged/serving/protocol.py": "the KServe v2 JSON and binary codec, pure functions fuzzed "
    "together in tests/serving/test_protocol.py",
    "edged/serving/models.py": "a served model's selection, sessions, standby and switch-back "
    "in one state machine",
}


def modules() -> dict[str, int]:
    """Each .py of the packages, by path from the repo, with its line count."""
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def test_modules_stay_short_or_say_why() -> None:
    sizes = modules()
    too_long = [
        f"{path}: {lines} lines"
        for path, lines in sizes.items()
        if lines > MAX_LINES and path not in LONG_MODULES
    ]
    assert not too_long, (
        f"modules over {MAX_LINES} lines: split them along their seams, or add them to "
        f"LONG_MODULES saying why:\n  " + "\n  ".join(too_long)
    )
    over = [f"{p}: {n}" for p, n in sizes.items() if n > HARD_MAX_LINES]
    assert not over, f"modules over {HARD_MAX_LINES} lines, whatever the reason: {over}"


def test_the_long_list_only_shrinks() -> None:
    sizes = modules()
    stale = [
        f"{path} ({sizes.get(path, 'gone')})"
        for path in LONG_MODULES
        if sizes.get(path, 0) <= MAX_LINES
    ]
    assert not stale, f"LONG_MODULES entries no longer needed, remove them: {stale}"
    assert all(why.strip() for why in LONG_MODULES.values())


def test_every_package_says_what_it_holds() -> None:
    silent = []
    for package in PACKAGES:
        for init in sorted((REPO / package).rglob("__init__.py")):
            if not ast.get_docstring(ast.parse(init.read_text())):
                silent.append(str(init.relative_to(REPO)))
    assert not silent, f"packages without a docstring saying what they hold: {silent}"


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if "support" in path.relative_to(REPO / "tests").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if name.startswith("tests.") and last.startswith("test_"):
                    offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, "shared test code goes in tests/support/:\n  " + "\n  ".join(offenders)
