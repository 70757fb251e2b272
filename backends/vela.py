"""Arm Ethos-U models through Arm's Vela compiler (`ethos-u-vela`).

Vela turns a full-integer .tflite into one whose NPU part is a single custom op, "ethos-u"
(a command stream and its weights, run by the Ethos-U driver under TFLite Micro or the
Linux delegate); the operators it cannot map stay ordinary TFLite ops for the CPU. Vela
runs in a subprocess: it writes its results into a folder, prints its per-operator
fallback warnings from native code (Regor, its C++ core since 4.x), and a crash there
must not take the caller with it.

The estimate it reports is Vela's performance model of the chosen system configuration,
not a measurement on a board; the report says so wherever it travels (`kind`, `note`). The
report is embedded in the written model as the metadata entry "edged.vela", so whoever
loads the model later knows what it was compiled for and what the compiler expected.
"""

from __future__ import annotations

import ast
import csv
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from backends.errors import BackendError, ModelError
from backends.model_info import inspect_model, read_model_file, write_model_file
from backends.tflite_file import custom_codes

TESTED_VELA = "5.2.0"
CUSTOM_CODE = "ethos-u"  # the op code Vela 5.2 gives every NPU partition
METADATA_NAME = "edged.vela"
INSTALL_HINT = f"pip install ethos-u-vela=={TESTED_VELA} (or the extra edged[npu])"
ESTIMATE_NOTE = "Vela's performance model of the system configuration, not a measurement"
CPU_REASON = "left on the CPU by Vela"
# The Ethos-U driver wants the command stream and weights 16-byte aligned; Vela writes them
# so, and the metadata edit must keep them so.
BUFFER_ALIGNMENT = 16
PRECISION_NAMES = {
    "fp32": "a float32 model",
    "fp16": "a float model (float16 weights)",
    "mixed": "a partly quantized model (float and integer ops)",
}
# Vela's error classes that mean bad input (its options, config file or the network), as
# the last line of its traceback names them.
INPUT_ERRORS = ("CliOptionError", "ConfigOptionError", "InputFileError", "UnsupportedFeatureError")

_FALLBACK = re.compile(r"^Warning \(supported operators\) operator: (\S+), ofm: '(.*)'$")
_DEFAULT = re.compile(
    r"^Warning: No (configuration file|system configuration|memory mode) specified\. "
    r"Using a default of (.*?)\. Compilation"
)
_OP_COUNT = re.compile(r"^(CPU|NPU) operators = (\d+)")
_VELA_ERROR = re.compile(r"^ethosu\.vela\.errors\.(\w+): (.*)$")  # str() is a repr


class VelaNotInstalled(BackendError):
    """Vela is not installed here (a setup to fix: the CLI exits 2 with how)."""


@dataclass(frozen=True)
class CpuOp:
    op: str  # the TFLite operator type, e.g. "DEQUANTIZE"
    name: str  # its first output tensor (Vela's "ofm")
    reason: str


@dataclass
class VelaReport:
    accelerator: str
    system_config: str
    memory_mode: str
    vela_version: str
    npu_ops: int
    cpu_ops: list[CpuOp]
    # inference_ms, inferences_per_second, cycles_*, clock_mhz, macs, *_used_kib, ...
    estimate: dict[str, Any]
    output: str
    source: str = ""  # the full-integer model compiled
    source_sha256: str = ""
    config: str = ""  # the Vela .ini the configurations came from
    defaults: list[str] = field(default_factory=list)  # what Vela chose itself
    npu_partitions: int = 0  # "ethos-u" ops in the output
    warnings: list[str] = field(default_factory=list)  # Vela's other warnings
    kind: str = "estimate"  # the figures are Vela's model (ESTIMATE_NOTE), never measured

    @property
    def all_on_npu(self) -> bool:
        return not self.cpu_ops

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "note": ESTIMATE_NOTE}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VelaReport:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["cpu_ops"] = [CpuOp(**op) for op in data.get("cpu_ops", ())]
        return cls(**values)


def vela_version() -> str:
    """The installed Vela's version, or VelaNotInstalled saying how to install it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ethos-u-vela")
    except PackageNotFoundError:
        raise VelaNotInstalled(f"Vela is not installed: {INSTALL_HINT}") from None


def accelerators() -> list[str]:
    """The accelerator configurations the installed Vela compiles for, in its own order
    (e.g. "ethos-u55-128", "ethos-u65-256", "ethos-u85-256")."""
    vela_version()
    try:
        from ethosu.vela.architecture_features import Accelerator
    except ImportError as exc:
        raise VelaNotInstalled(f"Vela cannot be imported ({exc}): {INSTALL_HINT}") from None
    return list(Accelerator.member_list())


def is_vela_compiled(model: str | Path | bytes) -> bool:
    """Whether a .tflite (a path or its bytes) already went through Vela: it has Vela's
    custom op. Any other file is not."""
    if isinstance(model, bytes):
        path, data = Path("<bytes>"), model
    else:
        path = Path(model)
        data = read_model_file(path)
    return data[4:8] == b"TFL3" and CUSTOM_CODE in custom_codes(path, data)


def read_report(path: str | Path) -> VelaReport | None:
    """The report `compile_model` embedded in a model it wrote; None for any other model."""
    path = Path(path)
    data = read_model_file(path)
    if data[4:8] != b"TFL3":
        return None
    from backends import tflite_edit

    raw = tflite_edit.metadata(data).get(METADATA_NAME)
    if raw is None:
        return None
    try:
        return VelaReport.from_dict(json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise ModelError(f"{path}: its {METADATA_NAME} report is unreadable ({exc})") from None


def compile_model(
    model: Path,
    accelerator: str,
    output: Path,
    *,
    system_config: str | None = None,
    memory_mode: str | None = None,
    config: str | Path | None = None,
    timeout_s: float = 600,
) -> VelaReport:
    """Compile a full-integer .tflite for `accelerator` and write the result to `output`
    (atomically, the report embedded); bad input is a ModelError naming the file and
    changes nothing."""
    model, output = Path(model), Path(output)
    version = vela_version()
    known = accelerators()
    accelerator = accelerator.strip().lower()
    if accelerator not in known:
        raise ModelError(
            f"{model}: unknown Ethos-U accelerator {accelerator!r}; Vela {version} "
            f"compiles for: {', '.join(known)}"
        )
    info = _check_input(model, accelerator)
    if output.resolve() == model.resolve():
        raise ModelError(f"{output}: is the input model; write the Vela model elsewhere")
    with tempfile.TemporaryDirectory(prefix="edged-vela-") as tmp:
        out = Path(tmp)
        command = [
            sys.executable,
            "-m",
            "ethosu.vela",
            str(model.resolve()),
            "--output-dir",
            str(out),
            "--accelerator-config",
            accelerator,
        ]
        if config is not None:
            # Vela reads "Folder/name.ini" inside its own config_files folder; a file that
            # exists here is passed by its absolute path so it is read as given.
            given = Path(config).expanduser()
            command += ["--config", str(given.resolve()) if given.is_file() else str(config)]
        if system_config:
            command += ["--system-config", system_config]
        if memory_mode:
            command += ["--memory-mode", memory_mode]
        stdout = _run_vela(model, command, out, timeout_s, version)
        compiled = _single(out, "*_vela.tflite", model, stdout)
        summary = _single(out, "*_summary_*.csv", model, stdout)
        vela_data = compiled.read_bytes()
        with summary.open(newline="") as f:
            rows = list(csv.DictReader(f))
    if not rows:
        raise BackendError(f"{model}: Vela's summary CSV is empty")
    report = _report(
        model, info.sha256, accelerator, version, output, config, stdout, vela_data, rows[0]
    )
    data = _with_report(model, vela_data, report)
    write_model_file(output, data)
    return report


def _check_input(model: Path, accelerator: str):
    info = inspect_model(model)  # ModelError for a missing, empty or corrupt file
    if info.format != "tflite":
        raise ModelError(f"{model}: not a TFLite model ({info.format}); Vela compiles .tflite")
    if is_vela_compiled(model):
        raise ModelError(
            f"{model}: already compiled by Vela (it has the {CUSTOM_CODE!r} op); compile "
            "the full-integer model it was made from"
        )
    if not info.is_int8:
        kind = PRECISION_NAMES.get(info.precision, f"a {info.precision} model")
        raise ModelError(
            f"{model}: {kind}: Vela compiles full-integer (int8) TFLite models only; make "
            f"one with `edgectl quantize {model} --target {accelerator}`"
        )
    return info


def _run_vela(model: Path, command: list[str], cwd: Path, timeout_s: float, version: str) -> str:
    """Vela's stdout (where it prints its summary and warnings); its failures as errors:
    ModelError for what it says is bad input, BackendError for the rest."""
    try:
        proc = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise BackendError(f"{model}: Vela did not finish within {timeout_s:g} s") from None
    if proc.returncode == 0:
        return proc.stdout
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    if lines and (match := _VELA_ERROR.match(lines[-1])) and match.group(1) in INPUT_ERRORS:
        try:
            message = str(ast.literal_eval(match.group(2)))
        except (ValueError, SyntaxError):
            message = match.group(2)
        raise ModelError(f"{model}: Vela: {message.removeprefix('Error: ')}")
    tail = "\n  ".join(lines[-6:]) or "(no output)"
    raise BackendError(f"{model}: Vela {version} failed (exit {proc.returncode}):\n  {tail}")


def _single(folder: Path, pattern: str, model: Path, stdout: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        tail = "\n  ".join(stdout.strip().splitlines()[-6:])
        raise BackendError(f"{model}: Vela wrote no {pattern} (found {len(found)}):\n  {tail}")
    return found[0]


def parse_fallbacks(stdout: str) -> dict[tuple[str, str], str]:
    """Vela's per-operator CPU fallback warnings, (op type, ofm name) -> reason. Each is
    `Warning (supported operators) operator: OP, ofm: 'NAME'`, then `Reason: ...` and
    more lines of it up to a blank line."""
    found: dict[tuple[str, str], str] = {}
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        match = _FALLBACK.match(line.strip())
        if not match:
            continue
        reason = []
        for more in lines[i + 1 :]:
            if not more.strip() or _FALLBACK.match(more.strip()):
                break
            reason.append(more.strip().removeprefix("Reason:").strip())
        found[(match.group(1), match.group(2))] = "; ".join(r for r in reason if r) or CPU_REASON
    return found


def _report(
    model: Path,
    sha256: str,
    accelerator: str,
    version: str,
    output: Path,
    config: str | Path | None,
    stdout: str,
    vela_data: bytes,
    row: dict[str, str],
) -> VelaReport:
    from backends import tflite_edit

    fallbacks = parse_fallbacks(stdout)
    ops = tflite_edit.op_types(vela_data)
    # The output model is the truth: every op Vela did not fold into its custom op runs on
    # the CPU, whether or not a warning said why.
    by_name = {name: reason for (_, name), reason in fallbacks.items()}
    cpu_ops = [
        CpuOp(op, name, fallbacks.get((op, name)) or by_name.get(name) or CPU_REASON)
        for op, name in ops
        if op != CUSTOM_CODE
    ]
    named = {(op.op, op.name) for op in cpu_ops}
    warnings = [
        f"Vela warned about {op} {name!r} ({reason}), which is not in its output"
        for (op, name), reason in fallbacks.items()
        if (op, name) not in named
    ]
    defaults, counts, default_config = [], {}, ""
    for line in stdout.splitlines():
        line = line.strip()
        if match := _DEFAULT.match(line):
            what = {"configuration file": "config", "system configuration": "system_config"}
            defaults.append(what.get(match.group(1), "memory_mode"))
            if match.group(1) == "configuration file":  # "['/.../config_files/Arm/vela.ini']"
                default_config = match.group(2).strip("[]'\"").rpartition("config_files/")[2]
        elif match := _OP_COUNT.match(line):
            counts[match.group(1)] = int(match.group(2))
        elif line.startswith("Warning") and not _FALLBACK.match(line):
            warnings.append(line)
    if version != TESTED_VELA:
        warnings.append(f"Vela {version} is not the tested {TESTED_VELA}")
    partitions = sum(op == CUSTOM_CODE for op, _ in ops)
    npu_ops = counts.get("NPU", partitions)
    return VelaReport(
        accelerator=accelerator,
        system_config=row.get("system_config", ""),
        memory_mode=row.get("memory_mode", ""),
        vela_version=version,
        npu_ops=npu_ops,
        cpu_ops=cpu_ops,
        estimate=_estimate(model, row),
        output=str(output),
        source=str(model),
        source_sha256=sha256,
        config=str(config) if config is not None else default_config,
        defaults=defaults,
        npu_partitions=partitions,
        warnings=warnings,
    )


def _estimate(model: Path, row: dict[str, str]) -> dict[str, Any]:
    """The figures of Vela's summary CSV, in the units people quote them in."""

    def number(key: str, required: bool = True) -> float | None:
        text = row.get(key)
        if text in (None, ""):
            if required:
                raise BackendError(f"{model}: Vela's summary CSV has no {key!r} column")
            return None
        return float(text)

    def whole(key: str) -> int | None:
        value = number(key, required=False)
        return None if value is None else int(value)

    seconds = number("inference_time")
    clock_hz = number("core_clock")
    assert seconds is not None and clock_hz is not None  # required above
    batch = whole("batch_size") or 1
    return {
        "inference_ms": seconds * 1e3,
        "inferences_per_second": number("inferences_per_second", required=False),
        "cycles_npu": whole("cycles_npu"),
        "cycles_total": whole("cycles_total"),
        "cycles_sram_access": whole("cycles_sram_access"),
        "cycles_dram_access": whole("cycles_dram_access"),
        "clock_mhz": clock_hz / 1e6,
        "macs": whole("nn_macs"),
        "batch_size": batch,
        "sram_used_kib": number("sram_memory_used", required=False),
        "dram_used_kib": number("dram_memory_used", required=False),
        "on_chip_flash_used_kib": number("on_chip_flash_memory_used", required=False),
        "off_chip_flash_used_kib": number("off_chip_flash_memory_used", required=False),
        "weights_area": row.get("weights_storage_area"),
        "feature_map_area": row.get("feature_map_storage_area"),
        "weights_original_bytes": whole("total_original_weights"),
        "weights_encoded_bytes": whole("total_npu_encoded_weights"),
        **{
            f"{area}_bytes_per_inference": (
                None if (n := whole(f"{area}_total_bytes")) is None else n // batch
            )
            for area in ("sram", "dram", "on_chip_flash", "off_chip_flash")
        },
    }


def _with_report(model: Path, vela_data: bytes, report: VelaReport) -> bytes:
    """Vela's model with the report as metadata entry METADATA_NAME; the graph, tensors
    and buffers are Vela's own, each buffer still BUFFER_ALIGNMENT-aligned. Checked: the
    ops and tensors are unchanged and LiteRT parses the result."""
    import numpy as np

    from backends import tflite_edit

    schema = tflite_edit.generated()
    buffer_type: Any = schema.BufferT  # made when LiteRT's schema is imported

    class AlignedBuffer(buffer_type):
        """A buffer packed as the schema's `force_align: 16` asks (the generated Python
        code ignores it)."""

        def Pack(self, builder):  # the generated classes' name
            data = None
            if self.data is not None:
                raw = np.asarray(self.data, dtype=np.uint8).tobytes()
                builder.StartVector(1, len(raw), BUFFER_ALIGNMENT)
                builder.head -= len(raw)
                builder.Bytes[builder.head : builder.head + len(raw)] = raw
                data = builder.EndVector()
            schema.BufferStart(builder)
            if data is not None:
                schema.BufferAddData(builder, data)
            schema.BufferAddOffset(builder, self.offset)
            schema.BufferAddSize(builder, self.size)
            return schema.BufferEnd(builder)

    parsed = tflite_edit.load(vela_data)
    if any(b.offset > 1 for b in parsed.buffers):  # data outside the flatbuffer
        raise BackendError(f"{model}: Vela's output keeps buffers outside the flatbuffer")
    buffers = []
    for buffer in parsed.buffers:
        aligned = AlignedBuffer()
        aligned.__dict__.update(vars(buffer))
        buffers.append(aligned)
    value = AlignedBuffer()
    value.data = np.frombuffer(json.dumps(report.to_dict()).encode(), dtype=np.uint8)
    buffers.append(value)
    parsed.buffers = buffers
    entry = schema.MetadataT()
    entry.name = METADATA_NAME
    entry.buffer = len(buffers) - 1
    kept = [m for m in parsed.metadata or () if tflite_edit.tensor_name(m) != METADATA_NAME]
    parsed.metadata = [*kept, entry]
    data = tflite_edit.dump(parsed)
    _check_written(model, vela_data, data)
    return data


def _check_written(model: Path, vela_data: bytes, data: bytes) -> None:
    from backends import tflite_edit

    def tensors(raw: bytes) -> list[int]:
        return [len(g.tensors) for g in tflite_edit.load(raw).subgraphs]

    same_ops = tflite_edit.op_types(data) == tflite_edit.op_types(vela_data)
    if not same_ops or tensors(data) != tensors(vela_data):
        raise BackendError(f"{model}: embedding the report changed Vela's graph")
    schema = tflite_edit.generated()
    root = schema.Model.GetRootAs(data, 0)
    for i in range(root.BuffersLength()):
        table = root.Buffers(i)._tab
        offset = table.Offset(4)  # Buffer field 0: data
        if offset and table.VectorLen(offset) and table.Vector(offset) % BUFFER_ALIGNMENT:
            raise BackendError(f"{model}: buffer {i} lost its {BUFFER_ALIGNMENT}-byte alignment")
    try:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
    except ImportError:  # tflite_edit.load above has parsed it already
        return
    try:  # the flatbuffer verifier and graph build, no tensors allocated ("ethos-u" is
        # a custom op only an Ethos-U delegate or TFLite Micro resolves)
        Interpreter(
            model_content=data,
            experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
    except (ValueError, RuntimeError) as exc:
        raise BackendError(f"{model}: LiteRT cannot parse the Vela model ({exc})") from None
