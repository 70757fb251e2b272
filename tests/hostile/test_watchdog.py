"""A slow but valid request does not move a model: an input much larger than any before it
(a dynamic size, served without `shapes`) runs longer than watchdog_ms and is answered on
the pick, not taken for a hung device. Against the real daemon, with onnxruntime and
OpenVINO both able to serve the model (so a fail-over has somewhere to go)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from onnx import TensorProto, helper

from tests.support.daemon_harness import Daemon, get, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAIN = 60  # Sin nodes: the run's cost grows with the input's length


def slow_in_size(path: Path) -> Path:
    nodes, name = [], "x"
    for i in range(CHAIN):
        nodes.append(helper.make_node("Sin", [name], [f"s{i}"]))
        name = f"s{i}"
    nodes.append(helper.make_node("Identity", [name], ["y"]))
    graph = helper.make_graph(
        nodes,
        "slow_in_size",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_a_large_valid_input_is_answered_on_the_pick(tmp_path: Path) -> None:
    model = slow_in_size(tmp_path / "slow.onnx")
    table = (
        f'[[models]]\nname = "slow"\npath = "{model}"\nwatchdog_ms = 200\n'
        "timeout_ms = 120000\nstandby = true\n"
    )
    daemon = Daemon(write_config(tmp_path, table)).wait_ready()
    try:
        with tg.InferenceServerClient(f"unix://{tmp_path / 'grpc.sock'}") as client:

            def infer(n: int) -> np.ndarray:
                x = np.linspace(0, 1, n, dtype=np.float32)[None]
                inp = tg.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                return client.infer("slow", [inp], client_timeout=120).as_numpy("y")

            assert infer(1000).shape == (1, 1000)  # the usual size, well within 200 ms
            big = infer(4_000_000)  # 16 MB: several times watchdog_ms on any CPU here
            assert big.shape == (1, 4_000_000)
        status, body = get(daemon, "/edged/status")
        assert status == 200
        models = json.loads(body)["models"]
        slow = models["slow"] if isinstance(models, dict) else models[0]
        assert not slow.get("degraded"), slow
        assert "stalled" not in daemon.log_text()
    finally:
        assert daemon.stop() == 0, daemon.log_text()


@pytest.mark.parametrize("backend", ["openvino:CPU", "onnxruntime"])
def test_a_dynamic_size_is_served_at_any_size_whichever_backend_won(
    tmp_path: Path, backend: str
) -> None:
    """Without `shapes` a dynamic dim stays dynamic on every CPU backend: the selection
    measures at a stand-in size (224), and OpenVINO compiled at it once served only 1x224
    (onnxruntime took any size), so what a model accepted hung on which backend won."""
    model = slow_in_size(tmp_path / "slow.onnx")
    table = f'[[models]]\nname = "slow"\npath = "{model}"\nbackend = "{backend}"\n'
    daemon = Daemon(write_config(tmp_path, table)).wait_ready()
    try:
        with tg.InferenceServerClient(f"unix://{tmp_path / 'grpc.sock'}") as client:
            for n in (1000, 224, 7):
                x = np.linspace(0, 1, n, dtype=np.float32)[None]
                inp = tg.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                y = client.infer("slow", [inp], client_timeout=60).as_numpy("y")
                assert y.shape == (1, n)
    finally:
        assert daemon.stop() == 0, daemon.log_text()
