"""LiteRT (TensorFlow Lite): XNNPACK on the CPU by default, NPUs through external delegates.

Imports `ai_edge_litert` (LiteRT, works with numpy 2) and falls back to `tflite_runtime` where
that is the one installed on the board. NPU delegates come from a table keyed by SoC
compatible and device node; a delegate that fails to load is a candidate marked unavailable
with the loader's own message, and one that loads reports how much of the graph it took.

Each delegate also says what form of model it runs (`DelegateSpec.needs`): full-integer for
VX and Neutron, Vela-compiled for Ethos-U, edgetpu-compiled for the Edge TPU. A model in
another form is an unavailable candidate with the step that would make it right, not a
failed load; a Vela model carries Vela's estimate (`backends.vela`), shown as an estimate.
For an image root (offline, e.g. `edgectl backends --root IMG --dtb BOARD.dtb`) a delegate
library is looked for in the image, never loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends import tflite_file
from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, ModelError
from backends.formats import ModelFormat
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec
from backends.tflite_form import TfliteForm, tflite_form
from sysconf.hardware import DeviceNode

NAME = "litert"
ALIASES = ("tflite",)  # other names config and --backend accept
ORDER = 30  # place among the candidates (backends.REGISTRY)
FORMATS = (
    ModelFormat(
        "tflite",
        "TFLite",
        (".tflite",),
        "tensorflow_lite",
        tflite_file.read,
        recognise=tflite_file.recognise,
        not_it=f"no {tflite_file.MAGIC.decode()} identifier at byte 4",
        signature=tflite_file.signature,
    ),
)
# The delegates' drivers make only a character device (no udev class lists them; an image
# root's /dev still has them). The USB Coral is found by its USB id (sysconf.hardware).
DEVICES = (
    DeviceNode("npu", "/dev/galcore", "Vivante NPU (galcore)", "misc"),
    DeviceNode("npu", "/dev/ethosu*", "Arm Ethos-U NPU", "misc"),
    DeviceNode("npu", "/dev/neutron*", "NXP Neutron NPU", "misc"),
    DeviceNode("tpu", "/dev/apex_*", "Coral Edge TPU (PCIe)", "apex"),
)
# Its device labels that are the CPU itself (the XNNPACK delegate and the built-in kernels);
# every other label is an NPU delegate.
CPU_DEVICES = frozenset({"XNNPACK", "CPU"})
OPTIONS = ()  # no [models.backend_options.litert] keys yet
# Where `edgectl quantize` gates an INT8 model of each format: (target, device); a
# .tflite on XNNPACK and on the built-in (reference) kernels.
QUANTIZE_TARGETS = {"tflite": (("litert", "XNNPACK"), ("litert:CPU", "CPU"))}


@dataclass(frozen=True)
class DelegateSpec:
    name: str  # the candidate's device label
    library: str
    socs: tuple[str, ...]  # SoC compatible prefixes where the NPU exists
    nodes: tuple[str, ...]  # device nodes the driver creates
    note: str
    options: tuple[tuple[str, str], ...] = ()
    needs: str = "full-integer"  # the model form it runs: full-integer, vela, edgetpu
    accelerator: str | None = None  # Vela's name for the board's Ethos-U configuration


# Vendor NPU delegates as the board vendors ship them (untested here: no NPU on this machine).
DELEGATES = (
    DelegateSpec(
        "NPU-VX",
        "/usr/lib/libvx_delegate.so",
        ("fsl,imx8mp",),
        ("/dev/galcore",),
        "i.MX8M Plus VeriSilicon NPU (TIM-VX delegate)",
    ),
    DelegateSpec(
        "NPU-EthosU",
        "/usr/lib/libethosu_delegate.so",
        ("fsl,imx93",),
        ("/dev/ethosu0",),
        "i.MX93 Ethos-U65 (needs a Vela-compiled model)",
        needs="vela",
        accelerator="ethos-u65-256",
    ),
    DelegateSpec(
        "NPU-Neutron",
        "/usr/lib/libneutron_delegate.so",
        ("fsl,imx95",),
        ("/dev/neutron0",),
        "i.MX95 eIQ Neutron NPU",
    ),
    DelegateSpec(
        "EdgeTPU",
        "libedgetpu.so.1",
        (),
        ("/dev/apex_0",),
        "Coral Edge TPU (needs an edgetpu-compiled model)",
        (("device", "pci:0"),),
        needs="edgetpu",
    ),
    DelegateSpec(
        "EdgeTPU-USB",
        "libedgetpu.so.1",
        (),
        (),
        "Coral USB Edge TPU",
        (("device", "usb"),),
        needs="edgetpu",
    ),
)
# Where a library named without a folder is looked for in an image root.
LIBRARY_DIRS = ("/usr/lib", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib")


def form_problem(spec: DelegateSpec, form: TfliteForm) -> str | None:
    """Why a model in `form` is not what `spec`'s delegate runs, with the step that makes
    it so; None when it is."""
    if spec.needs == "vela":
        if form.compiled_for == "vela":
            return None
        if form.compiled_for:
            return f"the model is compiled for {form.compiled_for}, not for the Ethos-U"
        step = f"edgectl compile MODEL --target {spec.accelerator}"
        if not form.full_integer:
            return (
                f"not Vela-compiled and not full-integer ({form.precision}): make it with "
                f"edgectl quantize MODEL --target {spec.accelerator}"
            )
        return f"full-integer but not Vela-compiled: {step}"
    if spec.needs == "edgetpu":
        if form.compiled_for == "edgetpu":
            return None
        if form.compiled_for:
            return f"the model is compiled for {form.compiled_for}, not for the Edge TPU"
        base = (
            "not compiled for the Edge TPU: run Coral's edgetpu_compiler on it (Coral's apt "
            "repository; not on the package registries edged installs from)"
        )
        if not form.full_integer:
            return f"{base}, after making it full-integer (edgectl quantize MODEL --target edgetpu)"
        if not form.static_shapes:
            return f"{base}; it needs static input shapes first"
        return base
    if form.compiled_for:
        return f"the model is compiled for {form.compiled_for}; {spec.name} runs plain .tflite"
    if not form.full_integer:
        return (
            f"a {form.precision} model: the NPU runs full-integer models and leaves float ops "
            f"to the CPU; make one with edgectl quantize MODEL --target "
            f"{TARGET_OF.get(spec.name, 'litert')}"
        )
    return None


# The `edgectl quantize --target` that makes a model for each delegate.
TARGET_OF = {"NPU-VX": "npu-vx", "NPU-Neutron": "npu-neutron", "EdgeTPU": "edgetpu"}
# The NPUs `edgectl quantize --target` makes a full-integer .tflite for (through a delegate).
NPU_TARGETS = tuple(TARGET_OF.values())


def form_note(target: str, path: Path) -> str:
    """Whether the model at `path` is in the form `target`'s delegate runs (one line for
    `edgectl quantize`'s report), or the step that makes it so."""
    [spec] = [s for s in DELEGATES if TARGET_OF.get(s.name) == target]
    problem = form_problem(spec, tflite_form(path))
    return f"{spec.name}: " + (
        problem.replace("MODEL", str(path)) if problem else "the model is in the form it runs"
    )


_quiet = False
_stderr_lock = threading.Lock()


def quiet_native_info(enabled: bool = True) -> None:
    """Drop the runtime's native "INFO: ..." lines (e.g. "Created TensorFlow Lite XNNPACK
    delegate for CPU"), which it writes straight to fd 2 when an interpreter is created.
    The CLI turns this on so that its stderr holds only its own one-line errors."""
    global _quiet
    _quiet = enabled


@contextlib.contextmanager
def _native_info_filtered() -> Iterator[None]:
    """While on, fd 2 goes to a temporary file; afterwards every line but "INFO: " ones is
    written back, so warnings and errors from the runtime still reach stderr."""
    if not _quiet:
        yield
        return
    with _stderr_lock, tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [
                line
                for line in capture.read().splitlines(keepends=True)
                if not line.startswith(b"INFO: ")
            ]
            if kept:
                os.write(2, b"".join(kept))


def _import():
    """The interpreter module: LiteRT first, tflite_runtime where only that is installed."""
    try:
        from ai_edge_litert import interpreter
    except ImportError:
        from tflite_runtime import interpreter  # type: ignore[no-redef]
    return interpreter


def board_has(spec: DelegateSpec, hw) -> bool:
    """Whether the board (its SoC compatible, device nodes, USB devices) has this NPU."""
    if spec.name == "EdgeTPU-USB":
        return any(acc.kind == "tpu" and "USB" in acc.name for acc in hw.accelerators)
    return hw.soc_matches(spec.socs) or any(hw.has_node(node) for node in spec.nodes)


class LiteRtBackend:
    name = NAME
    formats = ("tflite",)

    def version(self) -> str | None:
        return dist_version("ai-edge-litert", "tflite-runtime")

    def candidates(self, hw, model: ModelInfo | None) -> list[Candidate]:
        try:
            _import()
        except ImportError as exc:
            return [
                unavailable(
                    NAME,
                    "XNNPACK",
                    f"neither ai-edge-litert nor tflite_runtime is installed ({exc})",
                )
            ]
        wrong_format = model is not None and model.format not in self.formats
        form = tflite_form(model.path, model) if model is not None and not wrong_format else None
        offline = hw.offline
        result = []
        for device, note in (
            ("XNNPACK", "XNNPACK CPU delegate"),
            ("CPU", "built-in kernels, no delegate"),
        ):
            if wrong_format:
                assert model is not None  # wrong_format says so
                result.append(
                    unavailable(NAME, device, f"LiteRT reads only .tflite, not {model.format}")
                )
            elif form is not None and form.compiled_for:
                result.append(
                    unavailable(
                        NAME,
                        device,
                        f"the model is compiled for {form.compiled_for}: only that NPU's "
                        "delegate runs it (give the uncompiled model for the CPU)",
                    )
                )
            else:
                result.append(Candidate(NAME, device, "model", note=note))
        for spec in DELEGATES:
            if not board_has(spec, hw):
                where = ", ".join(spec.nodes + spec.socs) or "a Coral USB device"
                result.append(
                    unavailable(
                        NAME, spec.name, f"{spec.note}: not on this device (looked for {where})"
                    )
                )
                continue
            if offline and hw.root == "/":
                error = None  # a .dtb alone: no image to look in (give --root IMG for that)
            elif offline:
                found = _library_in_image(hw.root, spec.library)
                error = None if found else f"delegate {spec.library} is not in the image"
            else:
                error = _library_error(spec.library)
                error = error and f"delegate did not load: {error}"
            if wrong_format:
                result.append(unavailable(NAME, spec.name, "LiteRT reads only .tflite"))
                continue
            problems = [p for p in (error, form and form_problem(spec, form)) if p]
            if problems:
                result.append(unavailable(NAME, spec.name, f"{spec.note}: {'; '.join(problems)}"))
                continue
            options: dict[str, Any] = {
                "delegate": spec.library,
                "delegate_options": dict(spec.options),
            }
            note = spec.note
            if offline:
                note += (
                    " (delegate library not checked: no --root image)"
                    if hw.root == "/"
                    else " (delegate in the image; not loaded offline)"
                )
            if form is not None and form.compiled_for == "vela":
                assert model is not None  # form is read from it
                estimate = vela_estimate(model.path, spec.accelerator)
                if estimate:
                    options["estimate"] = estimate
                    note += f"; {estimate['summary']}"
            result.append(Candidate(NAME, spec.name, "model", True, "", options, note=note))
        return result

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions):
        return LiteRtSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return Candidate(NAME, "CPU", "model")  # built-in kernels: no delegate rewrites it

    def board_devices(self, hw) -> list[str]:
        """The board's NPUs among this backend's delegates (offline plans ask this)."""
        return [spec.name for spec in DELEGATES if board_has(spec, hw)]


def _library_in_image(root: str, library: str) -> bool:
    """Whether the image at `root` has the delegate library (a bare name is looked for in
    the usual library folders)."""
    from pathlib import Path

    folders = ("",) if "/" in library else LIBRARY_DIRS
    return any(
        (Path(root) / folder.lstrip("/") / library.lstrip("/")).is_file() for folder in folders
    )


def vela_estimate(path, accelerator: str | None) -> dict[str, Any] | None:
    """The Vela report embedded in a model compiled by `edgectl compile`/`quantize`: its
    estimate, marked as one, with a one-line summary; None when it has none."""
    from backends.vela import read_report

    try:
        report = read_report(path)
    except ImportError:  # reading the report needs ai-edge-litert's schema (not tflite_runtime)
        return None
    if report is None:
        return None
    est = dict(report.estimate)
    summary = (
        f"Vela estimate {est.get('inference_ms', float('nan')):.2f} ms per inference on "
        f"{report.accelerator} (a performance model, not a measurement)"
    )
    if accelerator and report.accelerator.lower() != accelerator.lower():
        summary += f"; compiled for {report.accelerator}, the board has {accelerator}"
    return {**est, "kind": "estimate", "accelerator": report.accelerator, "summary": summary}


def _library_error(library: str) -> str | None:
    """The dynamic loader's message for a delegate library that cannot load, else None.

    Checked with ctypes first: LiteRT's load_delegate raises too, but its Delegate object
    then prints a traceback from __del__ on the way out.
    """
    try:
        ctypes.CDLL(library)
    except OSError as exc:
        return str(exc)
    return None


class LiteRtSession:
    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        interp = _import()
        self.candidate = candidate
        self.model = model
        delegates = []
        if "delegate" in candidate.options:
            try:
                delegates.append(
                    interp.load_delegate(
                        candidate.options["delegate"], candidate.options.get("delegate_options")
                    )
                )
            except (OSError, ValueError, RuntimeError) as exc:
                raise BackendError(
                    f"{candidate.device}: delegate {candidate.options['delegate']} failed: {exc}"
                ) from None
        kwargs: dict[str, Any] = {"num_threads": options.thread_count()}
        if candidate.device != "XNNPACK":
            # No default XNNPACK delegate: the plain built-in kernels (the reference), or an
            # external NPU delegate that should take the graph itself.
            kwargs["experimental_op_resolver_type"] = (
                interp.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
            )
        try:
            with _native_info_filtered():
                self._interp = interp.Interpreter(
                    model_path=str(model.path), experimental_delegates=delegates or None, **kwargs
                )
                self._resize(options)
                self._interp.allocate_tensors()
        except (ValueError, RuntimeError) as exc:
            raise ModelError(
                f"{model.path}: LiteRT cannot load it: {str(exc).splitlines()[0][:300]}"
            ) from None
        self._in = self._interp.get_input_details()
        self._out = self._interp.get_output_details()
        self.inputs = [_spec(d) for d in self._in]
        self.outputs = [_spec(d) for d in self._out]
        # Integer inputs/outputs of a full-integer model and their (scale, zero point), for
        # callers that feed it float (backends.base.float_io).
        self.io_quantization = {
            d["name"]: (float(d["quantization"][0]), int(d["quantization"][1]))
            for d in (*self._in, *self._out)
            if np.dtype(d["dtype"]).kind in "iu" and d["quantization"][0]
        }
        self._coverage = _delegate_coverage(self._interp._get_ops_details())

    def _resize(self, options: LoadOptions) -> None:
        if not options.shapes:
            return
        for detail in self._interp.get_input_details():
            shape = options.shapes.get(detail["name"])
            if shape is not None and list(shape) != list(detail["shape"]):
                self._interp.resize_tensor_input(detail["index"], list(shape))

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        try:
            for detail in self._in:
                self._interp.set_tensor(detail["index"], feeds[detail["name"]])
            self._interp.invoke()
        except (ValueError, RuntimeError) as exc:
            raise BackendError(f"{self.model.name}: LiteRT invoke failed: {exc}") from None
        return {d["name"]: self._interp.get_tensor(d["index"]).copy() for d in self._out}

    def info(self) -> dict[str, Any]:
        precision = {"int8": "int8"}.get(self.model.precision, "fp32")
        return {"precision": precision, **self._coverage}

    def close(self) -> None:
        self._interp = None


def _delegate_coverage(ops: list[dict]) -> dict[str, Any]:
    """How many of the graph's ops the delegate nodes took over.

    The Python API lists the original nodes and appends one DELEGATE node per partition;
    the nodes a partition replaced are those on the paths between its inputs and outputs,
    found by walking producers back from the partition's outputs.
    """
    delegate_nodes = [op for op in ops if op["op_name"] == "DELEGATE"]
    original = [op for op in ops if op["op_name"] != "DELEGATE"]
    if not delegate_nodes:
        return {"delegated_ops": 0, "total_ops": len(original), "delegate_coverage": 0.0}
    producer = {int(t): op["index"] for op in original for t in op["outputs"]}
    by_index = {op["index"]: op for op in original}
    taken: set[int] = set()
    for node in delegate_nodes:
        boundary = {int(t) for t in node["inputs"]}
        stack = [int(t) for t in node["outputs"]]
        seen: set[int] = set()
        while stack:
            tensor = stack.pop()
            if tensor in seen or tensor in boundary or tensor not in producer:
                continue
            seen.add(tensor)
            index = producer[tensor]
            taken.add(index)
            stack.extend(int(t) for t in by_index[index]["inputs"] if t >= 0)
    return {
        "delegated_ops": len(taken),
        "total_ops": len(original),
        "delegate_coverage": round(len(taken) / len(original), 4) if original else 0.0,
    }


def _spec(detail: dict) -> TensorSpec:
    signature = detail.get("shape_signature", detail["shape"])
    shape = tuple(None if int(d) < 0 else int(d) for d in signature)
    return TensorSpec(detail["name"], np.dtype(detail["dtype"]).name, shape)


BACKEND = LiteRtBackend()
