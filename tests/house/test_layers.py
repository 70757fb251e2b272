"""The layers of the design (sysconf at the bottom, backends above, edged on top), checked on
the source with `ast`, so a wrong import fails here and not on a board that lacks a runtime.

Three rules over every .py in sysconf/, backends/ and edged/:
  * imports point down: sysconf imports neither backends nor edged, backends does not import
    edged. Every import counts, at module level, inside functions (lazy imports are still
    dependencies) and under `if TYPE_CHECKING:` (a type named from a higher layer ties the
    lower one to it all the same);
  * inside edged/, its parts keep an order (EDGED_ORDER): an import counts whenever it is
    written, as above; and no two modules of edged/ or sysconf/ import each other even
    lazily (a function's import is a dependency all the same);
  * no import cycle among the project's modules at import time: only the imports that run
    when a module is first imported count (module level and class bodies, `try`/`if`
    included), not those inside functions nor under `if TYPE_CHECKING:`, which never run.
    That is what makes a cycle fail: a partly initialised module met half-way.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("sysconf", "backends", "edged")
# package -> the packages it must never import
FORBIDDEN = {"sysconf": ("backends", "edged"), "backends": ("edged",)}
# Inside edged/, bottom to top: each part imports only parts below it (and sysconf, backends).
# logs formats the daemon's log records (text, JSON, journal) and its decision events;
# vision decodes pictures and detections (numpy only);
# selection measures; quantize makes variants and gates them with selection's accuracy;
# telemetry records latency and publishes (its settings are its own); tracing records and
# writes request traces; autotune turns telemetry windows into verified tuning changes;
# trust checks model files' digests and signatures; config composes every
# part's settings from the TOML file and checks them; serving runs models on the front ends;
# fleet reads what devices publish; then the small single-job modules (repository: the
# daemon's load/unload of one model, supervision: its watch over what it serves, both parts
# of the daemon); the daemon wires it all;
# the CLI may use anything (the daemon never imports the CLI).
EDGED_ORDER = (
    "logs",
    "vision",
    "selection",
    "quantize",
    "telemetry",
    "tracing",
    "autotune",
    "trust",
    "thermal",
    "config",
    "serving",
    "fleet",
    "placement",
    "hotplug",
    "sdnotify",
    "client",
    "repository",
    "supervision",
    "daemon",
    "cli",
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module imported
    line: int
    at_import_time: bool  # runs when `source` is first imported
    implied: bool = False  # a package run first because a module in it was imported


def project_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages' folders."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it runs at import time."""
    todo: list[tuple[ast.AST, bool]] = [(tree, True)]
    while todo:
        node, runs = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runs
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            runs = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [(child, False) for child in node.body]
            todo += [(child, runs) for child in node.orelse]
            continue
        todo += [(child, runs) for child in ast.iter_child_nodes(node)]


def _resolve(name: str, modules: set[str]) -> str | None:
    """The most specific project module `name` is or lies in (a name imported from a module
    is that module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    """The project modules `module` imports. Importing a.b.c also runs the packages a and a.b
    first, so those count too, except the importer's own packages (already running)."""
    is_package = path.name == "__init__.py"
    found = []
    for node, runs in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is None or target == module:
                continue
            found.append(Import(module, target, node.lineno, runs))
            own = {*_ancestors(module), module}
            found += [
                Import(module, package, node.lineno, runs, implied=True)
                for package in _ancestors(target)
                if package not in own
            ]
    return found


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    modules = project_modules(root, packages)
    names = set(modules)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, names)]


def layer_violations(imports: Iterable[Import]) -> list[str]:
    found = []
    for imp in imports:
        banned = FORBIDDEN.get(imp.source.split(".")[0], ())
        if not imp.implied and imp.target.split(".")[0] in banned:
            found.append(f"{imp.source} (line {imp.line}) imports {imp.target}")
    return sorted(set(found))


def import_cycles(imports: Iterable[Import]) -> list[list[str]]:
    """Each cycle of import-time imports, as a path `a, b, ..., a`; one a strongly connected
    group of modules (Tarjan), so a tangle of several loops is reported once."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.at_import_time:
            edges.setdefault(imp.source, set()).add(imp.target)
            edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth: the longest import chain, a few dozen
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_loop_in(sorted(group)[0], group, edges) for group in groups]


def _loop_in(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside the group (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges[node] & group):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return sorted(group)  # not reached: a strongly connected group has a loop through start


def test_imports_point_down() -> None:
    violations = layer_violations(import_graph(REPO))
    assert not violations, (
        "imports against the layers (sysconf < backends < edged):\n  " + "\n  ".join(violations)
    )


def test_no_import_cycle() -> None:
    cycles = import_cycles(import_graph(REPO))
    assert not cycles, "import cycles at import time:\n  " + "\n  ".join(
        " -> ".join(cycle) for cycle in cycles
    )


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "sysconf/__init__.py": "",
            # upward, but only inside a function and for type checking: still against the layers
            "sysconf/probe.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from backends.base import Session\n"
            "def f():\n    import edged.a\n",
            "backends/__init__.py": "",
            "backends/base.py": "from sysconf import probe\n",
            "edged/__init__.py": "",
            # a real cycle through a relative import and a name imported from a module
            "edged/a.py": "from . import b\n",
            "edged/b.py": "from edged.c import thing\n",
            "edged/c.py": "import edged.a\n",
            # not cycles: the way back runs only in a function or for type checking
            "edged/d.py": "import edged.e\n",
            "edged/e.py": "import typing\nif typing.TYPE_CHECKING:\n    import edged.d\n"
            "def g():\n    from edged import d\n",
        },
    )
    graph = import_graph(root)
    assert layer_violations(graph) == [
        "sysconf.probe (line 3) imports backends.base",
        "sysconf.probe (line 5) imports edged.a",
    ]
    assert import_cycles(graph) == [["edged.a", "edged.b", "edged.c", "edged.a"]]


def test_importing_a_submodule_runs_its_package_first(tmp_path: Path) -> None:
    """A package whose __init__ imports its importer closes a loop through the submodule."""
    root = _tree(
        tmp_path,
        {
            "edged/__init__.py": "",
            "edged/top.py": "from edged.sub.leaf import x\n",
            "edged/sub/__init__.py": "from edged import top\n",
            "edged/sub/leaf.py": "from edged.sub import y\n",  # its own package: no new edge
        },
    )
    assert import_cycles(import_graph(root)) == [["edged.sub", "edged.top", "edged.sub"]]


def edged_part(module: str) -> str | None:
    """The part of edged/ a module is in (its sub-package, or its own name at the top)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "edged" and len(parts) > 1 else None


def order_violations(imports: Iterable[Import], order: tuple[str, ...] = EDGED_ORDER) -> list[str]:
    rank = {part: i for i, part in enumerate(order)}
    found = []
    for imp in imports:
        source, target = edged_part(imp.source), edged_part(imp.target)
        if imp.implied or source is None or target is None or source == target:
            continue
        if source not in rank or target not in rank:
            found.append(
                f"{imp.source}: edged.{source if source not in rank else target} "
                "is in no place of EDGED_ORDER"
            )
        elif rank[source] < rank[target]:
            found.append(f"{imp.source} (line {imp.line}) imports {imp.target}, which is above it")
    return sorted(set(found))


def test_edged_parts_keep_their_order() -> None:
    violations = order_violations(import_graph(REPO))
    assert not violations, (
        f"imports against the order inside edged/ ({' < '.join(EDGED_ORDER)}):\n  "
        + "\n  ".join(violations)
    )


def test_the_order_test_sees_an_import_upwards(tmp_path: Path) -> None:
    """The rule can fail: a lazy import from config up into serving is caught."""
    for part in ("config", "serving"):
        (tmp_path / "edged" / part).mkdir(parents=True)
        (tmp_path / "edged" / part / "__init__.py").write_text("")
    (tmp_path / "edged" / "__init__.py").write_text("")
    (tmp_path / "edged" / "serving" / "engine.py").write_text("X = 1\n")
    (tmp_path / "edged" / "config" / "load.py").write_text(
        "def f():\n    from edged.serving.engine import X\n    return X\n"
    )
    found = order_violations(import_graph(tmp_path, ("edged",)))
    assert found == ["edged.config.load (line 2) imports edged.serving.engine, which is above it"]


def test_no_two_modules_import_each_other_even_lazily() -> None:
    """edged/ and sysconf/: every import counts except those under TYPE_CHECKING (never
    run). backends/ still has one (the format registry asks the backends package, whose
    modules read model files through backends.model_info, which asks the registry)."""
    runtime = [
        imp
        for imp in import_graph(REPO)
        if imp.source.split(".")[0] in ("edged", "sysconf") and not _type_only(imp)
    ]
    cycles = import_cycles([Import(i.source, i.target, i.line, True, i.implied) for i in runtime])
    assert not cycles, "modules that import each other (lazily too):\n  " + "\n  ".join(
        " -> ".join(cycle) for cycle in cycles
    )


def _type_only(imp: Import) -> bool:
    """Whether the import sits under `if TYPE_CHECKING:` (read from its line)."""
    return imp.line in _type_checking_lines(imp.source)


_TYPE_LINES: dict[str, set[int]] = {}


@functools.cache
def _modules() -> dict[str, Path]:
    return project_modules(REPO)


def _type_checking_lines(module: str) -> set[int]:
    if module not in _TYPE_LINES:
        path = _modules()[module]
        lines: set[int] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    for sub in ast.walk(child):
                        if isinstance(sub, ast.Import | ast.ImportFrom):
                            lines.add(sub.lineno)
        _TYPE_LINES[module] = lines
    return _TYPE_LINES[module]
