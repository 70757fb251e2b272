"""Everything about a runtime lives in its backend (backends/<name>_backend.py or
backends/<name>/): no module of edged/ or sysconf/ imports a runtime, reaches into a
backend's own modules, or spells a backend's name. Adding TensorRT or QNN is then one file or
one folder, and these checks say where a new module broke that.

Read from the source with `ast` (imports anywhere, lazy ones included; string constants that
are not docstrings). Names come from the backends' own declarations, so a new backend is
covered without editing this file.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import backends

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = ("edged", "sysconf")  # everything above or below the backends
# The Python packages of the runtimes (and their vendors' tools).
RUNTIMES = (
    "onnxruntime",
    "openvino",
    "ai_edge_litert",
    "tflite_runtime",
    "tensorflow",
    "hailo_platform",
    "rknnlite",
    "rknn",
    "tensorrt",
)
# The backends package's API for the layers above: the interface, errors, tensor specs, the
# model inspector, the format table, the .tflite graph editor (the TFLite quantizer's) and Vela
# (Arm's Ethos-U compiler, a tool edgectl runs).
API = {
    "backends.tflite_edit",
    "backends",
    "backends.base",
    "backends.errors",
    "backends.tensors",
    "backends.model_info",
    "backends.formats",
    "backends.vela",
}
# file -> why it may name a runtime. Each entry is a tool, not a place that serves models.
ALLOWED = {
    "edged/quantize/recipes.py": "the ONNX quantizer is onnxruntime.quantization, and its "
    "float reference runs where that tool's calibration ran",
    "edged/quantize/tflite_quantizer.py": "the TFLite quantizer is LiteRT's calibration "
    "wrapper, and its float reference is LiteRT's built-in kernels",
    "sysconf/hardware.py": "'rknpu' is the kernel's DRM driver name of Rockchip's NPU (a "
    "hardware fact the probe reads), which RKNN's backend also takes as an alias",
}


def sources() -> Iterator[tuple[str, ast.Module]]:
    for package in OUTSIDE:
        for path in sorted((REPO / package).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def imported(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "backends":  # `from backends import hailo` is a module too
                for alias in node.names:
                    folder = REPO / "backends" / alias.name
                    if folder.is_dir() or folder.with_suffix(".py").exists():
                        yield node.lineno, f"backends.{alias.name}"


def constants(tree: ast.Module) -> Iterator[tuple[int, str]]:
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


@functools.cache
def backend_words() -> frozenset[str]:
    """Every backend's name and aliases, less the words that are also a model format's name
    ("tflite", "rknn": a format is everyone's business)."""
    names = set(backends.backend_names()) | set(backends.ALIASES)
    return frozenset(names - set(backends.model_formats()))


def names_a_backend(text: str) -> bool:
    head = text.split(":", 1)[0].strip().lower()
    return head in backend_words() and (text == head or text.startswith(f"{head}:"))


def test_no_module_outside_the_backends_imports_a_runtime() -> None:
    found = [
        f"{path}:{line}: imports {name}"
        for path, tree in sources()
        if path not in ALLOWED
        for line, name in imported(tree)
        if name.split(".")[0] in RUNTIMES
    ]
    assert not found, "a runtime belongs to its backend module:\n" + "\n".join(found)


def test_the_layers_above_use_only_the_backends_api() -> None:
    found = [
        f"{path}:{line}: imports {name}"
        for path, tree in sources()
        for line, name in imported(tree)
        if name.startswith("backends.") and name not in API
    ]
    assert not found, (
        "a backend's own modules are its business; ask through the backends package "
        f"({', '.join(sorted(API))}):\n" + "\n".join(found)
    )


def test_no_module_outside_the_backends_spells_a_backends_name() -> None:
    found = [
        f"{path}:{line}: {text!r}"
        for path, tree in sources()
        if path not in ALLOWED
        for line, text in constants(tree)
        if names_a_backend(text)
    ]
    assert not found, (
        "a backend's name in the layers above: declare what it stands for in the backend "
        "(OPTIONS, QUANTIZE_TARGETS, CPU_DEVICES, ...):\n" + "\n".join(found)
    )


def test_the_allow_list_is_needed() -> None:
    """Each allowed file still names a runtime; one that no longer does leaves the list."""
    trees = dict(sources())
    for path in ALLOWED:
        tree = trees[path]
        uses = any(n.split(".")[0] in RUNTIMES for _, n in imported(tree)) or any(
            names_a_backend(t) or t.lower() in backends.ALIASES for _, t in constants(tree)
        )
        assert uses, f"{path} names no runtime any more: take it off ALLOWED"


def test_the_checks_see_what_they_look_for() -> None:
    """The checks on a made-up module: each rule catches its case (they cannot pass by
    looking at nothing)."""
    tree = ast.parse(
        '"""Mentions openvino in a docstring, which is fine."""\n'
        "import onnxruntime.quantization\n"
        "from backends import hailo\n"
        "from backends.rknn.soc import core_mask\n"
        'TARGET = "openvino:CPU"\n'
        'FORMAT = "tflite"\n'
    )
    assert [n for _, n in imported(tree) if n.split(".")[0] in RUNTIMES] == [
        "onnxruntime.quantization"
    ]
    private = [n for _, n in imported(tree) if n.startswith("backends.") and n not in API]
    assert private == ["backends.hailo", "backends.rknn.soc"]
    assert [t for _, t in constants(tree) if names_a_backend(t)] == ["openvino:CPU"]
