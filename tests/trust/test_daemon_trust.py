"""[security] models = "enforce" on a real daemon with no network at all (`unshare --net`:
key mode needs none): a model signed with `edgectl sign` loads and its verdict shows in the
status; one flipped byte makes a reload and a repository load refuse it, naming the file and
why, while the version already loaded keeps serving; a fresh start refuses it too."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from edged.cli.main import main
from edged.client import Client, EdgedError
from tests.support.daemon_harness import Daemon
from tests.support.model_keys import flip_one_byte, make_key
from tests.support.schema import check

pytestmark = pytest.mark.integration
NO_NETWORK = ("unshare", "--net")


def config(folder: Path, model: Path, public: Path) -> Path:
    path = folder / "edged.toml"
    path.write_text(f"""
[server]
listen = ""
grpc_listen = ""
socket = "{folder / "edged.sock"}"
state_dir = "{folder / "state"}"
model_control = "explicit"

[selection]
runs = 5
warmup = 1
time_budget_s = 1.0

[telemetry]
interval_s = 60

[security]
models = "enforce"
trusted_keys = ["{public}"]

[[models]]
name = "cls"
path = "{model}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}
""")
    return path


def infer(client: Client) -> dict:
    return client.infer("cls", {"x": np.zeros((1, 3, 48, 192), np.float32)})


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --net needs root")
def test_enforce_loads_signed_refuses_changed_and_keeps_serving(
    models_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "cls.onnx"
    shutil.copyfile(models_dir / "ppocr_cls.onnx", model)
    private, public = make_key(tmp_path, "ci")
    assert main(["sign", str(model), "--key", str(private)]) == 0
    address = f"unix:{tmp_path / 'edged.sock'}"
    d = Daemon(config(tmp_path, model, public), prefix=NO_NETWORK).wait_ready()
    try:
        assert os.readlink(f"/proc/{d.proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        with Client(address) as client:
            infer(client)
            (served,) = client.status()["models"]
        (verdict,) = served["trust"]
        assert verdict["state"] == "verified" and verdict["signer"] == "ci.pub"
        assert verdict["path"] == str(model) and len(verdict["sha256"]) == 64
        with Client(address) as client:
            _, _, metrics = client._request("GET", "/metrics")
        line = f'edged_model_file_trust{{file="{model}",model="cls",state="verified"}} 1.0'
        assert line in metrics.decode().splitlines()
        # The fleet's view: the state (birth) the publisher sends, logged here (no broker).
        births = [
            json.loads(line[line.index("{") :])
            for line in d.log_text().splitlines()
            if '"topic":"state"' in line
        ]
        assert births and births[-1]["models"]["cls"]["trust"] == [verdict]
        check("state", births[-1])

        flip_one_byte(model)
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", after=mark)
        with Client(address) as client:
            status = client.status()
            infer(client)  # the version loaded before keeps serving
            code, _, body = client._request("POST", "/v2/repository/models/cls/load")
            infer(client)
        reason = status["failed"]["cls"]
        assert "refused by [security] models = enforce" in reason and str(model) in reason
        assert "not the one that was signed" in reason
        assert status["models"][0]["trust"] == [verdict]  # still the verified version
        assert code == 400, body
        error = json.loads(body)["error"]
        assert str(model) in error and "refused by [security]" in error
        log = d.log_text()
        assert "model cls: not loaded: refused by [security] models = enforce" in log
    finally:
        d.stop()
    # A fresh start refuses it as well: nothing of it is read by a runtime.
    d = Daemon(config(tmp_path, model, public), prefix=NO_NETWORK).wait_ready()
    try:
        with Client(address) as client:
            status = client.status()
            with pytest.raises(EdgedError):
                infer(client)
        assert status["models"] == [] and "refused by [security]" in status["failed"]["cls"]
    finally:
        d.stop()
