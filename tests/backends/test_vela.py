"""Arm Ethos-U models through the real Vela (ethos-u-vela 5.2.0) and `edgectl compile`, on
MediaPipe's face detector quantized here by edged's own quantizer: all-NPU for the
full-integer model, the float IO ops named as CPU fallbacks, float and already compiled
models refused with the file named, the report embedded in the model it describes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backends import tflite_edit
from backends.errors import ModelError
from backends.model_info import signature, signature_mismatch
from backends.vela import (
    CUSTOM_CODE,
    METADATA_NAME,
    TESTED_VELA,
    CpuOp,
    VelaReport,
    accelerators,
    compile_model,
    is_vela_compiled,
    parse_fallbacks,
    read_report,
)
from edged.cli.main import main

pytestmark = [pytest.mark.slow]

FACE = "face_detection_short_range.tflite"


@pytest.fixture(scope="module")
def face_int8(face_full_integer: dict[str, Path]) -> Path:
    """The face detector made full-integer by edged's quantizer, int8 IO (tests/conftest.py)."""
    return face_full_integer["int8"]


@pytest.fixture(scope="module")
def face_float_io(face_full_integer: dict[str, Path]) -> Path:
    """Full-integer inside, float at the edges: a float QUANTIZE in front and two
    DEQUANTIZEs behind, which Vela leaves on the CPU."""
    return face_full_integer["float"]


@pytest.fixture(scope="module")
def u65(face_int8: Path, tmp_path_factory) -> tuple[Path, VelaReport]:
    out = tmp_path_factory.mktemp("u65") / "face_u65.tflite"
    return out, compile_model(face_int8, "ethos-u65-256", out)


def test_vela_is_the_tested_one_and_lists_its_accelerators() -> None:
    from importlib.metadata import version

    assert version("ethos-u-vela") == TESTED_VELA
    known = accelerators()
    assert {"ethos-u55-128", "ethos-u65-256", "ethos-u85-256"} <= set(known)


def test_full_integer_face_runs_wholly_on_the_ethos_u65(face_int8, u65) -> None:
    out, report = u65
    assert report.accelerator == "ethos-u65-256" and report.vela_version == TESTED_VELA
    assert report.npu_ops > 50 and report.cpu_ops == [] and report.npu_partitions == 1
    est = report.estimate
    assert est["inference_ms"] > 0 and est["inferences_per_second"] > 0
    assert 0 < est["cycles_npu"] <= est["cycles_total"] and est["macs"] > 1_000_000
    assert est["clock_mhz"] > 0 and est["sram_used_kib"] > 0
    assert report.kind == "estimate" and "not a measurement" in report.to_dict()["note"]
    # Vela chose the system config and memory mode itself; the report says which.
    assert report.system_config and report.memory_mode
    assert {"system_config", "memory_mode"} <= set(report.defaults)

    data = out.read_bytes()
    assert [op for op, _ in tflite_edit.op_types(data)] == [CUSTOM_CODE]
    assert METADATA_NAME in tflite_edit.metadata(data)
    assert read_report(out) == report
    assert is_vela_compiled(out) and is_vela_compiled(data)
    assert not is_vela_compiled(face_int8) and read_report(face_int8) is None
    assert signature_mismatch(signature(face_int8), signature(out)) is None
    assert not out.with_name(out.name + ".part").exists()


def test_the_report_keeps_vela_buffers_16_byte_aligned(u65) -> None:
    """The Ethos-U driver takes the command stream and weights from the model's buffers
    in place; the metadata edit must not shift them off Vela's 16-byte alignment. LiteRT
    still parses the result (only an Ethos-U delegate resolves the op)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    data = u65[0].read_bytes()
    root = tflite_edit.generated().Model.GetRootAs(data, 0)
    starts = []
    for i in range(root.BuffersLength()):
        table = root.Buffers(i)._tab
        offset = table.Offset(4)
        if offset and table.VectorLen(offset):
            starts.append(table.Vector(offset))
    assert len(starts) >= 3 and all(start % 16 == 0 for start in starts)
    Interpreter(
        model_content=data,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )


def test_ethos_u55_128_compiles_too(face_int8, u65, tmp_path) -> None:
    report = compile_model(face_int8, "ethos-u55-128", tmp_path / "face_u55.tflite")
    assert report.accelerator == "ethos-u55-128" and report.cpu_ops == []
    assert report.system_config != u65[1].system_config
    # A quarter of the U65-256's MACs per cycle at half its clock: slower in Vela's model.
    assert report.estimate["inference_ms"] > u65[1].estimate["inference_ms"] > 0


def test_a_float_model_is_refused_and_nothing_is_written(models_dir, tmp_path, capsys) -> None:
    model = shutil.copy(models_dir / FACE, tmp_path / FACE)
    with pytest.raises(ModelError, match="full-integer") as caught:
        compile_model(Path(model), "ethos-u65-256", tmp_path / "out.tflite")
    assert str(model) in str(caught.value) and "edgectl quantize" in str(caught.value)

    assert main(["compile", str(model), "--target", "ethos-u65-256"]) == 2
    err = capsys.readouterr().err
    assert str(model) in err and "full-integer (int8)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [FACE]


def test_operators_left_on_the_cpu_are_named_with_reasons(face_float_io, capsys) -> None:
    assert main(["compile", str(face_float_io), "--target", "ethos-u65-256"]) == 1
    text = capsys.readouterr().out
    out = face_float_io.with_name(f"{face_float_io.stem}_vela.tflite")  # the default
    report = read_report(out)
    assert report is not None and report.npu_ops > 50
    ops = {(op.op, op.name): op.reason for op in report.cpu_ops}
    assert set(ops) == {
        ("QUANTIZE", "input_int8"),
        ("DEQUANTIZE", "classificators"),
        ("DEQUANTIZE", "regressors"),
    }
    assert "Float32" in ops["QUANTIZE", "input_int8"]
    assert ops["DEQUANTIZE", "regressors"] == "Unsupported opType"
    assert "3 on the CPU" in text and "CPU: DEQUANTIZE 'classificators': Unsupported" in text
    assert "not a measurement" in text and f"written: {out}" in text


def test_an_already_compiled_model_exits_2(u65, tmp_path, capsys) -> None:
    out = tmp_path / "again.tflite"
    assert main(["compile", str(u65[0]), "--target", "ethos-u65-256", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(u65[0]) in err and "already compiled by Vela" in err and not out.exists()


def test_an_unknown_accelerator_exits_2_listing_the_known(face_int8, tmp_path, capsys) -> None:
    out = tmp_path / "x.tflite"
    assert main(["compile", str(face_int8), "--target", "ethos-u77", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'ethos-u77'" in err and "ethos-u55-128" in err and "ethos-u85-256" in err
    assert not out.exists()


def test_an_unknown_system_config_exits_2_naming_it(face_int8, tmp_path, capsys) -> None:
    out = tmp_path / "x.tflite"
    argv = ["compile", str(face_int8), "--target", "ethos-u55-128", "--output", str(out)]
    assert main([*argv, "--system-config", "No_Such_Board"]) == 2
    assert "No_Such_Board" in capsys.readouterr().err and not out.exists()


def test_output_onto_the_input_is_refused(face_int8, capsys) -> None:
    argv = ["compile", str(face_int8), "--target", "ethos-u55-128", "--output", str(face_int8)]
    assert main(argv) == 2
    assert "is the input model" in capsys.readouterr().err


def test_json_report(face_int8, tmp_path, capsys) -> None:
    out = tmp_path / "face.tflite"
    argv = ["compile", str(face_int8), "--target", "ethos-u65-256", "--output", str(out)]
    assert main([*argv, "--system-config", "Ethos_U65_High_End", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["accelerator"] == "ethos-u65-256" and report["output"] == str(out)
    assert report["system_config"] == "Ethos_U65_High_End"
    assert "system_config" not in report["defaults"] and report["cpu_ops"] == []
    assert report["kind"] == "estimate" and report["vela_version"] == TESTED_VELA
    for key in ("inference_ms", "cycles_npu", "cycles_total", "sram_used_kib", "clock_mhz"):
        assert report["estimate"][key] > 0, key
    assert VelaReport.from_dict(report) == read_report(out)


def test_vela_missing_is_bad_input_with_how_to_install(face_int8, monkeypatch, capsys) -> None:
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "ethos-u-vela":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert main(["compile", str(face_int8), "--target", "ethos-u55-128"]) == 2
    assert f"pip install ethos-u-vela=={TESTED_VELA}" in capsys.readouterr().err


def test_fallback_warnings_parse_with_multi_line_reasons() -> None:
    """The shape Vela 5.2 prints them in (its Regor core), reasons running to a blank line."""
    stdout = (
        "Warning: No memory mode specified. Using a default of Shared_Sram. Compilation may\n"
        "\n"
        "Warning (supported operators) operator: QUANTIZE, ofm: 'input_int8'\n"
        "Reason: Operation has tensor with unsupported DataType Float32 (input)\n"
        'Feature-map dataTypes must be one of {"INT8", "UINT8"}\n'
        "\n"
        "Warning (supported operators) operator: DEQUANTIZE, ofm: 'a/b:0'\n"
        "Reason: Unsupported opType\n"
        "\n"
        "Network summary for m\n"
    )
    assert parse_fallbacks(stdout) == {
        ("QUANTIZE", "input_int8"): "Operation has tensor with unsupported DataType Float32 "
        '(input); Feature-map dataTypes must be one of {"INT8", "UINT8"}',
        ("DEQUANTIZE", "a/b:0"): "Unsupported opType",
    }
    assert CpuOp("A", "b", "c") == CpuOp(**{"op": "A", "name": "b", "reason": "c"})
