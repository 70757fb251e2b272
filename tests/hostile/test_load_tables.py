"""A client's load table (the repository extension's parameters.config) is held to what the
operator allowed, and every model file, the config file's own included, to the load bounds:
regular files only, none of the kernel's, at most [server] max_model_bytes. Without a daemon:
the checks themselves (the daemon's use of them is in tests/serving/test_repository.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from edged.config.checks import ConfigError
from edged.config.client_table import allowed_dirs, client_model
from edged.config.load import parse_config
from edged.config.schema import ServerConfig

CPUS = [0, 1]


@pytest.fixture
def folders(models_dir: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(config folder with cls.onnx in models/, an outside folder with a copy, the config)."""
    allowed = tmp_path / "models"
    allowed.mkdir()
    shutil.copy(models_dir / "ppocr_cls.onnx", allowed / "cls.onnx")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(models_dir / "ppocr_cls.onnx", outside / "cls.onnx")
    config = tmp_path / "edged.toml"
    return allowed, outside, config


def load(table: dict, config: Path, allowed: Path, **server) -> object:
    srv = ServerConfig(**server)
    return client_model(table, "m", config, srv, (allowed.resolve(),), CPUS)


def test_a_file_inside_the_allowed_folder_loads(folders) -> None:
    allowed, _, config = folders
    mc = load({"path": "models/cls.onnx", "max_batch_size": 4}, config, allowed)
    assert mc.path == allowed / "cls.onnx" and mc.max_batch_size == 4


@pytest.mark.parametrize(
    "path",
    ["elsewhere/cls.onnx", "models/../elsewhere/cls.onnx", "/etc/passwd", "/no/such/file"],
)
def test_a_path_outside_the_allowed_folders_is_refused_before_it_is_looked_at(
    folders, path: str
) -> None:
    allowed, _, config = folders
    with pytest.raises(ConfigError) as err:
        load({"path": path}, config, allowed)
    assert err.value.key == "parameters.config.path"
    assert "outside the folders loads may name" in err.value.problem
    assert "no such file" not in str(err.value)  # says nothing of what exists elsewhere


def test_a_link_out_of_the_allowed_folder_is_refused(folders) -> None:
    allowed, outside, config = folders
    (allowed / "link.onnx").symlink_to(outside / "cls.onnx")
    with pytest.raises(ConfigError, match="outside the folders"):
        load({"path": "models/link.onnx"}, config, allowed)


def test_variables_are_not_expanded_from_the_daemons_environment(folders, monkeypatch) -> None:
    allowed, _, config = folders
    monkeypatch.setenv("EDGED_SECRET_PROBE", "s3cr3t-value")
    with pytest.raises(ConfigError) as err:
        load({"path": "models/$EDGED_SECRET_PROBE.onnx"}, config, allowed)
    assert "s3cr3t-value" not in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("rt_priority", 99, "SCHED_FIFO"),
        ("cpus", "0", "CPU plan"),
        ("calibration", "models", "quantization job"),
        ("threads", 256, "at most this machine's 2 CPUs"),
        ("no_such_key", 1, "unknown key"),
        ("name", "other", "not 'm'"),
    ],
)
def test_operator_only_and_unknown_keys_are_refused(folders, key, value, says) -> None:
    allowed, _, config = folders
    with pytest.raises(ConfigError) as err:
        load({"path": "models/cls.onnx", key: value}, config, allowed)
    assert says in str(err.value)
    assert err.value.key is not None and err.value.key.startswith("parameters.config")


def test_allowed_dirs_default_to_the_folders_of_the_files_models(folders) -> None:
    allowed, outside, config = folders
    config.write_text(f'[[models]]\nname = "a"\npath = "{allowed / "cls.onnx"}"\n')
    cfg = parse_config(config.read_text(), config, CPUS)
    assert allowed_dirs(cfg.server, cfg.models) == (allowed.resolve(),)
    srv = ServerConfig(load_dirs=(outside,))
    assert allowed_dirs(srv, cfg.models) == (outside.resolve(),)


# -- every model file, the config file's included -------------------------------------------


def test_a_kernel_file_is_not_read_as_a_model(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    text = '[[models]]\nname = "a"\npath = "/proc/self/pagemap"\n'
    with pytest.raises(ConfigError, match="kernel file"):
        parse_config(text, config, CPUS)


def test_a_sparse_file_over_max_model_bytes_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "huge.onnx"
    with open(big, "wb") as f:
        f.truncate(100 * 2**30)  # 100 GiB, sparse: nothing on disk
    config = tmp_path / "edged.toml"
    text = f'[[models]]\nname = "a"\npath = "{big}"\n'
    with pytest.raises(ConfigError) as err:
        parse_config(text, config, CPUS)
    assert err.value.key == "models[0].path"
    assert "max_model_bytes" in err.value.problem
    small = f'[server]\nmax_model_bytes = 2048\n[[models]]\nname = "a"\npath = "{big}"\n'
    os.truncate(big, 4096)
    with pytest.raises(ConfigError, match=r"4096 bytes, more than \[server\] max_model_bytes"):
        parse_config(small, config, CPUS)
