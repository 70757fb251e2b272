"""Offline planning for a board: `edgectl backends --model M --root IMG --dtb BOARD.dtb`
says what that board's NPUs would do with the model, loading nothing (real board device
trees from the fetched Debian kernel; image roots made here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.vela import compile_model
from edged.cli.main import main

pytestmark = [pytest.mark.slow]

FACE = "face_detection_short_range.tflite"


@pytest.fixture(scope="module")
def face_vela(face_full_integer: dict[str, Path], tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vela") / "face_vela.tflite"
    compile_model(face_full_integer["int8"], "ethos-u65-256", out)
    return out


def image(tmp_path: Path, delegate: str | None) -> Path:
    """An image root with the board vendor's delegate library (never loaded: offline)."""
    root = tmp_path / "image"
    (root / "usr" / "lib").mkdir(parents=True)
    if delegate:
        (root / "usr" / "lib" / delegate).write_bytes(b"\x7fELF aarch64 (not loaded)")
    return root


def plan(capsys, *argv) -> tuple[int, dict]:
    code = main(["backends", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_imx93_runs_the_vela_model_and_shows_the_estimate(
    dtb_corpus: Path, face_vela: Path, tmp_path: Path, capsys
) -> None:
    dtb = dtb_corpus / "freescale" / "imx93-11x11-evk.dtb"
    root = image(tmp_path, "libethosu_delegate.so")
    code, report = plan(capsys, "--model", face_vela, "--root", root, "--dtb", dtb)
    assert code == 0 and report["offline"] and report["verdict"] == "runs on NPU-EthosU"
    [ethos] = report["npu"]
    assert ethos["device"] == "NPU-EthosU" and ethos["runs_model"]
    estimate = ethos["estimate"]
    assert estimate["kind"] == "estimate" and estimate["inference_ms"] > 0
    assert "not a measurement" in estimate["summary"] and "not a measurement" in ethos["note"]
    assert "fsl,imx93" in report["hardware"]["soc_compatible"]
    main(["backends", "--model", str(face_vela), "--root", str(root), "--dtb", str(dtb)])
    text = capsys.readouterr().out
    assert "yes  litert:NPU-EthosU" in text and "Vela estimate" in text


def test_imx93_says_what_is_missing(
    dtb_corpus: Path, models_dir: Path, face_full_integer: dict[str, Path], tmp_path, capsys
) -> None:
    """Each reason a board's NPU would not run the model, and exit 1 for a CI to act on."""
    dtb = dtb_corpus / "freescale" / "imx93-11x11-evk.dtb"
    bare = image(tmp_path, None)
    code, report = plan(capsys, "--model", face_full_integer["int8"], "--root", bare, "--dtb", dtb)
    assert code == 1
    reason = report["npu"][0]["reason"]
    assert "libethosu_delegate.so is not in the image" in reason
    assert "full-integer but not Vela-compiled: edgectl compile" in reason
    code, report = plan(capsys, "--model", models_dir / FACE, "--dtb", dtb)
    assert code == 1
    assert "not Vela-compiled and not full-integer (fp16)" in report["npu"][0]["reason"]
    assert "edgectl quantize MODEL --target ethos-u65-256" in report["npu"][0]["reason"]


def test_other_boards(dtb_corpus: Path, face_full_integer: dict[str, Path], capsys) -> None:
    """i.MX8M Plus: the VX NPU runs the full-integer model as it is; Raspberry Pi 4: no NPU,
    so nothing to refuse."""
    model = face_full_integer["int8"]
    code, report = plan(capsys, "--model", model, "--dtb", dtb_corpus / "freescale/imx8mp-evk.dtb")
    assert code == 0 and [r["device"] for r in report["npu"] if r["runs_model"]] == ["NPU-VX"]
    assert "not checked: no --root image" in report["npu"][0]["note"]
    rpi4 = dtb_corpus / "broadcom" / "bcm2711-rpi-4-b.dtb"
    code, report = plan(capsys, "--model", model, "--dtb", rpi4)
    assert code == 0 and report["npu"] == []


def test_a_bad_dtb_is_bad_input(face_full_integer: dict[str, Path], tmp_path: Path, capsys) -> None:
    bad = tmp_path / "board.dtb"
    bad.write_bytes(b"not a device tree")
    assert main(["backends", "--model", str(face_full_integer["int8"]), "--dtb", str(bad)]) == 2
    assert str(bad.name) in capsys.readouterr().err


def test_an_rk3566_image_plans_the_rknn_model_and_says_what_is_missing(
    dtb_corpus: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    """Every backend's NPUs are in the plan (`board_devices`), not only LiteRT's: an RK3566
    board's RKNPU2, for a real .rknn built for it, and one built for the RK3588."""
    from tests.support.rknn_standin import board_root

    dtb = dtb_corpus / "rockchip" / "rk3566-quartz64-a.dtb"
    root = board_root(tmp_path, driver=None, running=False)  # an image: librknnrt, no driver
    code, report = plan(
        capsys, "--model", models_dir / "ppocr_cls_rk3566_fp16.rknn", "--root", root, "--dtb", dtb
    )
    [npu] = report["npu"]
    assert (npu["backend"], npu["device"]) == ("rknn", "NPU")
    assert code == 0 and npu["runs_model"], npu
    code, report = plan(
        capsys, "--model", models_dir / "ppocr_cls_rk3588_fp16.rknn", "--root", root, "--dtb", dtb
    )
    [npu] = report["npu"]
    assert code == 1 and not npu["runs_model"]
    assert "built for rk3588" in npu["reason"] and "this board is rk3566" in npu["reason"]
