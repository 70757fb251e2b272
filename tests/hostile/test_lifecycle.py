"""The daemon's life when its inputs are crafted: a model file whose reader fails in a way
of its own is exit 2 at start (no traceback, no restart loop) and a failed reload that still
says READY=1; a client's load table is held to the operator's rules with serving going on;
a SIGHUP while the model set is busy is not lost. Against the real daemon process."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from tests.support import REPO
from tests.support.crafted import unknown_element_type
from tests.support.daemon_harness import OUT, Daemon, cls_input, cls_table, write_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("check_only", [True, False])
def test_a_crafted_model_file_is_exit_2_naming_it(tmp_path: Path, check_only: bool) -> None:
    bad = unknown_element_type(tmp_path / "bad.onnx")
    config = write_config(tmp_path, f'[[models]]\nname = "m"\npath = "{bad}"\n')
    argv = [sys.executable, "-m", "edged.daemon", "--config", str(config)]
    done = subprocess.run(
        argv + (["--check-config"] if check_only else []),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert "models[0].path" in done.stderr and str(bad) in done.stderr
    assert "Traceback" not in done.stderr


def test_a_reload_with_a_crafted_file_keeps_serving_and_says_ready(
    models_dir: Path, tmp_path: Path
) -> None:
    good = cls_table(models_dir)
    config = write_config(tmp_path, good)
    daemon = Daemon(config).wait_ready()
    try:
        bad = unknown_element_type(tmp_path / "bad.onnx")
        config.write_text(config.read_text() + f'\n[[models]]\nname = "m"\npath = "{bad}"\n')
        seen = len(daemon.notify.messages)
        daemon.signal(signal.SIGHUP)
        daemon.notify.wait_for("RELOADING=1", 60, after=seen)
        ready = daemon.notify.wait_for("READY=1", 60, after=seen)
        assert "reload failed" in ready
        assert daemon.proc.poll() is None
        with tg.InferenceServerClient(f"unix://{tmp_path / 'grpc.sock'}") as client:
            x = cls_input(1)
            inp = tg.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            assert client.infer("cls", [inp]).as_numpy(OUT).shape == (1, 2)
        assert "Traceback" not in daemon.log_text()
    finally:
        assert daemon.stop() == 0, daemon.log_text()


@pytest.fixture(scope="module")
def loading(models_dir: Path, tmp_path_factory) -> Daemon:
    """A daemon with model control, one model, at most two."""
    folder = tmp_path_factory.mktemp("loads")
    shutil.copy(models_dir / "ppocr_cls.onnx", folder / "cls.onnx")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copy(models_dir / "ppocr_cls.onnx", outside / "cls.onnx")
    models = f'[[models]]\nname = "cls"\npath = "{folder / "cls.onnx"}"\nbackend = "onnxruntime"\n'
    server = 'model_control = "explicit"\nmax_models = 2'
    d = Daemon(write_config(folder, models, server)).wait_ready()
    d.outside = outside  # type: ignore[attr-defined]
    yield d
    assert d.stop() == 0, d.log_text()


def client_of(daemon: Daemon) -> tg.InferenceServerClient:
    return tg.InferenceServerClient(f"unix://{daemon.config.parent / 'grpc.sock'}")


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"path": "cls.onnx", "rt_priority": 99}, "parameters.config.rt_priority"),
        ({"path": "cls.onnx", "cpus": "0"}, "parameters.config.cpus"),
        ({"path": "cls.onnx", "threads": 256}, "parameters.config.threads"),
        ({"path": "$HOME/x.onnx"}, "loads0/$HOME/x.onnx"),  # literal: no expansion
        ({"path": "/etc/shadow"}, "outside the folders"),
    ],
)
def test_a_client_table_is_held_to_the_operators_rules(
    loading: Daemon, table: dict, says: str
) -> None:
    with client_of(loading) as client, pytest.raises(InferenceServerException) as err:
        client.load_model("extra", config=json.dumps(table))
    assert "INVALID_ARGUMENT" in str(err.value.status()) and says in err.value.message()
    if "outside" in says:  # says nothing of what exists outside the allowed folders
        assert "no such file" not in err.value.message()
    assert str(Path.home()) not in err.value.message()  # no $VAR from the daemon's environment


def test_max_models_is_enforced_while_serving_goes_on(loading: Daemon) -> None:
    outside = loading.outside  # type: ignore[attr-defined]
    with client_of(loading) as client:
        answers: list[bool] = []

        def serve() -> None:
            x = cls_input(2)
            inp = tg.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(20):
                answers.append(client.infer("cls", [inp]).as_numpy(OUT).shape == (1, 2))

        server = threading.Thread(target=serve)
        server.start()
        client.load_model("second", config=json.dumps({"path": "cls.onnx"}))
        server.join(120)
        assert answers and all(answers)
        with pytest.raises(InferenceServerException) as err:
            client.load_model("third", config=json.dumps({"path": "cls.onnx"}))
        assert "max_models" in err.value.message()
        assert "RESOURCE_EXHAUSTED" in str(err.value.status())
        assert outside.is_dir()
        client.unload_model("second")


def test_a_sighup_during_a_load_is_not_lost(loading: Daemon) -> None:
    """The HUP comes while a repository load holds the model set: it runs after it (it was
    dropped: remembered as 'pending' by a reload that was not running)."""
    seen = len(loading.notify.messages)
    with client_of(loading) as client:
        load = threading.Thread(
            target=client.load_model,
            args=("late",),
            kwargs={"config": '{"path": "cls.onnx", "threads": 1}'},  # measured anew: slow
        )
        load.start()
        loading.notify.wait_for("STATUS=loading model late", 60, after=seen)
        loading.signal(signal.SIGHUP)
        load.join(120)
        loading.notify.wait_for("RELOADING=1", 60, after=seen)
        loading.notify.wait_for("READY=1", 120, after=seen)  # a loaded machine: measured anew
        client.unload_model("late")
