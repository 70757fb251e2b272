"""Frigate's ZMQ detector protocol against the real daemon, with a conformance client written
here from the protocol (edged/serving/frigate_zmq.py, docs/FRIGATE.md), not from Frigate:
REQ sockets, the handshake, frames, timeouts, re-handshaking after a restart, several peers
on several models without cross-talk, and names that are paths refused."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from edged.vision.boxes import Detections
from edged.vision.decoders import decode
from tests.support import daemon_harness as harness
from tests.support.detector import SIZE, make_detector
from tests.support.frigate_peer import Peer
from tests.support.roots import tree_state

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def picture(value: int) -> np.ndarray:
    return np.full((1, SIZE, SIZE, 3), value, np.uint8)


def models_toml(folder: Path) -> str:
    tables = []
    for name, cls in (("people", 0), ("cars", 2)):
        path = make_detector(folder / f"{name}.onnx", cls)
        tables.append(f"""
[[models]]
name = "{name}"
path = "{path}"
backend = "onnxruntime"
threads = 1
serves_as = ["{name}-320.onnx"]
[models.detector]
type = "yologeneric"
min_score = 0.05
""")
    return "".join(tables) + f'\n[frigate]\nenabled = true\nsocket = "{folder / "frigate.sock"}"\n'


@pytest.fixture
def daemon(tmp_path: Path):
    config = harness.write_config(tmp_path, models_toml(tmp_path))
    d = harness.Daemon(config).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def test_handshake_frames_and_names(daemon: harness.Daemon, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'frigate.sock'}"
    peer = Peer(endpoint, "people-320.onnx")
    before = tree_state(tmp_path / "state")
    try:
        assert peer.handshake("yolov9-t-320.onnx") == {
            "model_available": False,
            "model_loaded": False,
        }
        assert peer.handshake("../people.onnx") == {"model_available": False, "model_loaded": False}
        assert peer.handshake(str(tmp_path / "people.onnx")) == {
            "model_available": False,
            "model_loaded": False,
        }
        # An upload is refused and nothing is written.
        reply = peer.ask(
            [json.dumps({"model_data": True, "model_name": "../x"}).encode(), b"x" * 100]
        )
        assert reply is not None and json.loads(reply[0]) == {
            "model_saved": False,
            "model_loaded": False,
        }
        assert tree_state(tmp_path / "state") == before
        assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()

        assert peer.handshake() == {"model_available": True, "model_loaded": True}
        rows = peer.detect(picture(128))
        assert isinstance(rows, np.ndarray)
        assert rows[0].tolist() == pytest.approx([0, 128 / 255, 0.25, 0.25, 0.75, 0.75], abs=1e-4)
        assert not rows[1:].any()

        # A wrong frame is an error the peer can read; the peer still works after it.
        error = peer.detect(np.zeros((1, 32, 32, 3), np.uint8))
        assert (
            isinstance(error, dict)
            and "model input 'images' takes a uint8 picture" in error["error"]
        )
        error = peer.ask([b'{"shape": [1, 64, 64, 3], "dtype": "uint8"}', b"short"])
        assert error is not None and "5 bytes, but shape" in json.loads(error[0])["error"]
        assert isinstance(peer.detect(picture(10)), np.ndarray)

        # The model's own input tensor is taken as it is.
        tensor = np.full((1, 3, SIZE, SIZE), 0.5, np.float32)
        rows = peer.detect(tensor)
        assert isinstance(rows, np.ndarray) and rows[0][1] == pytest.approx(0.5)
    finally:
        peer.close()
    status = json.loads(harness.get(daemon, "/edged/status")[1])
    assert status["listening"]["frigate"] == [endpoint]
    assert status["frigate"] == {
        "people": ["people-320.onnx", "people"],
        "cars": ["cars-320.onnx", "cars"],
    }


def test_a_peer_without_handshake_gets_no_answer_and_shakes_hands_again(
    daemon: harness.Daemon, tmp_path: Path
) -> None:
    config = daemon.config
    endpoint = f"ipc://{tmp_path / 'frigate.sock'}"
    peer = Peer(endpoint, "cars-320.onnx")
    try:
        assert peer.detect(picture(50)) is None  # never shook hands: no answer
        assert peer.handshake()["model_available"]
        assert isinstance(peer.detect(picture(50)), np.ndarray)
        # edged restarts: the peer is unknown to it, its frame times out; it shakes hands again
        assert daemon.stop() == 0
        restarted = harness.Daemon(config).wait_ready()
        try:
            assert peer.detect(picture(50)) is None
            assert peer.handshake()["model_loaded"]
            rows = peer.detect(picture(50))
            assert isinstance(rows, np.ndarray) and rows[0][0] == 2
        finally:
            assert restarted.stop() == 0
        daemon.proc = restarted.proc  # the fixture's stop() finds it stopped
    finally:
        peer.close()


def test_two_peers_on_two_models_interleave_without_cross_talk(
    daemon: harness.Daemon, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path / 'frigate.sock'}"
    wrong: list[str] = []

    def run(model: str, cls: int, value: int) -> None:
        peer = Peer(endpoint, model)
        try:
            assert peer.handshake()["model_loaded"]
            for i in range(1000):
                v = 20 + (value + i) % 200  # above min_score (0.05 = 13/255)
                rows = peer.detect(picture(v))
                if not isinstance(rows, np.ndarray):
                    wrong.append(f"{model} #{i}: {rows}")
                elif rows[0][0] != cls or abs(rows[0][1] - v / 255) > 1e-4:
                    wrong.append(f"{model} #{i}: sent {v}, got {rows[0].tolist()}")
        finally:
            peer.close()

    threads = [
        threading.Thread(target=run, args=("people-320.onnx", 0, 1)),
        threading.Thread(target=run, args=("cars-320.onnx", 2, 101)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:5]


def test_same_detections_as_the_kserve_path(daemon: harness.Daemon, tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    x = picture(77)
    peer = Peer(f"ipc://{tmp_path / 'frigate.sock'}", "people-320.onnx")
    try:
        assert peer.handshake()["model_loaded"]
        rows = peer.detect(x)
    finally:
        peer.close()
    client = httpclient.InferenceServerClient(daemon.address)
    tensor = (x.astype(np.float32) / 255).transpose(0, 3, 1, 2)
    inp = httpclient.InferInput("images", list(tensor.shape), "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(tensor), binary_data=True)
    out = client.infer("people", [inp]).as_numpy("output0")
    dets: Detections = decode("yologeneric", [out], (SIZE, SIZE), 0.05)
    assert isinstance(rows, np.ndarray)
    assert rows[0].tolist() == pytest.approx(
        [dets.classes[0], dets.scores[0], *dets.boxes[0].tolist()], abs=1e-4
    )  # the same picture scaled by 1/255 here, by the configured scale there: float rounding


def test_a_reload_that_changes_frigate_waits_for_a_restart(
    daemon: harness.Daemon, tmp_path: Path
) -> None:
    import signal

    daemon.config.write_text(daemon.config.read_text() + "max_peers = 3\n")
    mark = len(daemon.notify.messages)
    daemon.signal(signal.SIGHUP)
    daemon.notify.wait_for("READY=1", after=mark)
    status = json.loads(harness.get(daemon, "/edged/status")[1])
    assert status["restart_needed"] == ["frigate"] and status["last_reload_error"] is None
    peer = Peer(f"ipc://{tmp_path / 'frigate.sock'}", "people-320.onnx")
    try:  # still served with the running settings
        assert peer.handshake()["model_loaded"]
        assert isinstance(peer.detect(picture(90)), np.ndarray)
    finally:
        peer.close()
