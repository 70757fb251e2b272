"""edged.config: the shipped example loads, defaults hold, and every broken config is refused
with one line naming the file and the exact key."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest

from edged.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    ModelConfig,
    ServerConfig,
    load_config,
    parse_config,
)
from edged.selection.policy import Policy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "edged.toml"


@pytest.fixture
def folder(tmp_path: Path, models_dir: Path) -> Path:
    """A config folder with a model file (a real one: the config reads it)."""
    (tmp_path / "m.onnx").symlink_to(models_dir / "ppocr_cls.onnx")
    return tmp_path


def parse(folder: Path, text: str) -> Config:
    # As on an 8-CPU device: a `cpus` list must name CPUs among these.
    return parse_config(textwrap.dedent(text), folder / "edged.toml", online_cpus=range(8))


def error(folder: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(folder, text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{folder / 'edged.toml'}: "), message
    return info.value


MODEL = '[[models]]\nname = "m"\npath = "m.onnx"\n'


def test_example_config_loads(test_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGED_TEST_DATA", str(test_data))
    config = load_config(EXAMPLE)
    assert config.source == EXAMPLE
    assert config.server == ServerConfig(
        listen_host="127.0.0.1",
        listen_port=8000,
        socket=REPO / "state" / "edged.sock",
        socket_mode=0o660,
        state_dir=REPO / "state",
        max_body_bytes=64 * 1024 * 1024,
        log_level="info",
        grpc_socket=REPO / "state" / "grpc.sock",  # beside `socket`
    )
    assert config.selection == Policy(runs=50, warmup=5, max_drop=0.01, max_abs=None)
    det, face, detector = config.models
    assert det == ModelConfig(
        name="ocr-det",
        path=test_data / "models" / "ppocrv4_det.onnx",
        backend="auto",
        variants=(test_data / "models" / "ppocrv4_det_int8.onnx",),
        threads=2,
        cpus=None,
        shapes={"x": (1, 3, 640, 640)},
        max_batch_size=4,
        preferred_batch_sizes=(),
        max_queue_delay_us=500,
        max_queue_size=64,
        timeout_ms=2000,
    )
    assert face.path == test_data / "models" / "face_detection_short_range.tflite"
    assert face.backend == "auto" and face.max_batch_size == 1
    assert config.model("face") is face and config.model("nope") is None
    # The real detector on Frigate's endpoint and the DeepStack route, its names from the file.
    assert config.frigate.enabled and detector.serves_as == ("nudenet_320n.onnx",)
    assert detector.detector is not None and detector.detector.type == "yologeneric"
    assert dict(detector.detector.labels)[1] == "FACE_FEMALE"
    assert detector.image is not None and detector.image.resize == "letterbox"


def test_variants_must_fit_their_original(models_dir: Path, tmp_path: Path) -> None:
    """A variant that takes or gives something else than the original is a config error
    naming the key and both files; so is one that is not a model."""
    models = models_dir
    good = parse(
        tmp_path,
        f"""
        [[models]]
        name = "cls"
        path = "{models / "ppocr_cls.onnx"}"
        variants = ["{models / "ppocr_cls_int8.onnx"}"]
        precision = "int8"
        """,
    )
    assert good.models[0].variants == (models / "ppocr_cls_int8.onnx",)
    assert good.models[0].policy(good.selection).precision == "int8"
    with pytest.raises(ConfigError) as err:
        parse(
            tmp_path,
            f"""
            [[models]]
            name = "cls"
            path = "{models / "ppocr_cls.onnx"}"
            variants = ["{models / "ppocr_cls_int8.onnx"}", "{models / "ppocrv4_det_int8.onnx"}"]
            """,
        )
    assert err.value.key == "models[0].variants[1]"
    assert (
        f"{models / 'ppocrv4_det_int8.onnx'} does not match its original "
        f"{models / 'ppocr_cls.onnx'}: outputs are ['sigmoid_0.tmp_0']" in str(err.value)
    )
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07junk")
    with pytest.raises(
        ConfigError,
        match=r"models\[0\]\.variants\[0\]: .*junk\.onnx: not a "
        r"valid ONNX model",
    ):
        parse(
            tmp_path,
            f"""
            [[models]]
            name = "cls"
            path = "{models / "ppocr_cls.onnx"}"
            variants = ["junk.onnx"]
            """,
        )
    for bad, key, message in (
        ('variants = "x.onnx"', "models[0].variants", "array of model"),
        ('variants = ["nope.onnx"]', "models[0].variants[0]", "no such file"),
        ('precision = "fp8"', "models[0].precision", 'must be "auto" or "int8"'),
    ):
        with pytest.raises(ConfigError) as err:
            parse(
                tmp_path,
                f"""
                [[models]]
                name = "cls"
                path = "{models / "ppocr_cls.onnx"}"
                {bad}
                """,
            )
        assert err.value.key == key and message in str(err.value)


@pytest.mark.parametrize("value", [None, ""])
def test_example_falls_back_to_the_default_test_data_folder(
    value: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models_dir: Path
) -> None:
    if value is None:
        monkeypatch.delenv("EDGED_TEST_DATA", raising=False)
    else:
        monkeypatch.setenv("EDGED_TEST_DATA", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    models = tmp_path / ".cache" / "edged" / "test-data" / "models"
    models.mkdir(parents=True)
    for name in (
        "ppocrv4_det.onnx",
        "ppocrv4_det_int8.onnx",
        "face_detection_short_range.tflite",
        "nudenet_320n.onnx",
    ):
        (models / name).symlink_to(models_dir / name)  # variants are read: real models
    config = load_config(EXAMPLE)
    assert config.model("ocr-det").path == models / "ppocrv4_det.onnx"
    assert config.model("ocr-det").variants == (models / "ppocrv4_det_int8.onnx",)


def test_defaults(folder: Path) -> None:
    config = parse(folder, "")
    assert config == Config(source=folder / "edged.toml")
    assert config.server == ServerConfig(
        listen_host="127.0.0.1",
        listen_port=8000,
        socket=Path("/run/edged/edged.sock"),
        socket_mode=0o660,
        state_dir=Path("/var/lib/edged"),
        max_body_bytes=67108864,
        log_level="info",
    )
    assert config.selection == Policy()
    assert config.models == ()
    (model,) = parse(folder, MODEL).models
    assert model == ModelConfig(name="m", path=folder / "m.onnx")
    assert (model.backend, model.threads, model.cpus, model.shapes) == ("auto", None, None, None)
    assert (
        model.max_batch_size,
        model.preferred_batch_sizes,
        model.max_queue_delay_us,
        model.max_queue_size,
        model.timeout_ms,
    ) == (1, (), 0, 64, 1000)
    assert Path("/etc/edged/edged.toml") == DEFAULT_CONFIG_PATH
    assert parse(folder, "models = []").models == ()


def test_every_key_set(folder: Path) -> None:
    config = parse(
        folder,
        """
        [server]
        listen = "[::1]:0"
        socket = ""
        socket_mode = "0600"
        state_dir = "/srv/edged"
        max_body_bytes = 1024
        log_level = "DEBUG"
        grpc_listen = "127.0.0.2:7001"
        grpc_socket = "/srv/edged/grpc.sock"
        metrics_names = "triton"
        allow_shared_memory = true
        model_control = "explicit"

        [selection]
        runs = 10
        warmup = 0
        time_budget_s = 2
        min_cosine = 1
        max_abs = 0.5

        [[models]]
        name = "m.v2_a-b"
        path = "m.onnx"
        backend = "ov:CPU:bf16"
        threads = 3
        cpus = [3, 1, 2, 3]
        shapes = { x = [1, 3, 32, 32], "mask" = [1, 32] }
        max_batch_size = 8
        preferred_batch_sizes = [8, 4]
        max_queue_delay_us = 0
        max_queue_size = 1
        timeout_ms = 1
        """,
    )
    assert config.server == ServerConfig(
        "::1",
        0,
        None,
        0o600,
        Path("/srv/edged"),
        1024,
        "debug",
        grpc_listen_host="127.0.0.2",
        grpc_listen_port=7001,
        grpc_socket=Path("/srv/edged/grpc.sock"),
        metrics_names="triton",
        allow_shared_memory=True,
        model_control="explicit",
    )
    # min_cosine, the older spelling, is 1 - max_drop.
    assert config.selection == Policy(
        runs=10, warmup=0, time_budget_s=2.0, max_drop=0.0, max_abs=0.5
    )
    (model,) = config.models
    assert model.backend == "openvino:CPU:bf16"  # canonical name: one cache entry per backend
    assert model.cpus == (1, 2, 3)
    assert model.shapes == {"x": (1, 3, 32, 32), "mask": (1, 32)}
    assert model.preferred_batch_sizes == (4, 8)
    assert (model.threads, model.max_queue_delay_us, model.max_queue_size, model.timeout_ms) == (
        3,
        0,
        1,
        1,
    )
    assert hash(config)  # frozen and hashable (shapes is left out of the hash)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.threads = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:8000", "127.0.0.1", 8000),
        ("localhost:0", "localhost", 0),
        ("0.0.0.0:65535", "0.0.0.0", 65535),
        ("[::1]:8001", "::1", 8001),
        ("", None, None),
    ],
)
def test_listen(folder: Path, listen: str, host: str | None, port: int | None) -> None:
    server = parse(folder, f'[server]\nlisten = "{listen}"').server
    assert (server.listen_host, server.listen_port) == (host, port)


def test_cpus_kernel_list(folder: Path) -> None:
    (model,) = parse(folder, MODEL + 'cpus = "0-1,3"').models
    assert model.cpus == (0, 1, 3)


def test_policy_mapping(folder: Path) -> None:
    config = parse(
        folder,
        """
        [selection]
        runs = 7
        warmup = 1
        min_cosine = 0.95
        max_abs = 0.1
        [[models]]
        name = "m"
        path = "m.onnx"
        backend = "onnxruntime"
        threads = 2
        cpus = "2-3"
        shapes = { x = [1, 3, 8, 8] }
        """,
    )
    policy = config.models[0].policy(config.selection)
    assert policy == Policy(
        runs=7,
        warmup=1,
        time_budget_s=Policy().time_budget_s,
        max_drop=0.05,
        max_abs=0.1,
        threads=2,
        cpus=(2, 3),
        shapes={"x": (1, 3, 8, 8)},
        backend="onnxruntime",
    )
    assert policy.key_parts()["shapes"] == {"x": [1, 3, 8, 8]}
    # A model without settings leaves the base's model fields at their unpinned defaults.
    (plain,) = parse(folder, MODEL).models
    base = Policy(runs=3, threads=9, cpus=(0,), backend="litert")
    assert plain.policy(base) == Policy(runs=3)


def test_relative_paths_resolve_against_the_config_folder(
    folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sub = folder / "etc"
    sub.mkdir()
    (sub / "edged.toml").write_text(
        textwrap.dedent("""
        [server]
        socket = "../run/edged.sock"
        state_dir = "state"
        [[models]]
        name = "a"
        path = "../m.onnx"
        [[models]]
        name = "b"
        path = "${MODELS}/m.onnx"
        [[models]]
        name = "c"
        path = "~/m.onnx"
        """)
    )
    monkeypatch.setenv("MODELS", str(folder))
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.chdir(sub)  # a relative config path names the file as given, resolves fully
    config = load_config("edged.toml")
    assert config.source == sub / "edged.toml"
    assert config.server.socket == folder / "run" / "edged.sock"
    assert config.server.state_dir == sub / "state"
    assert [m.path for m in config.models] == [folder / "m.onnx"] * 3
    monkeypatch.chdir("/")  # the working directory does not matter
    assert load_config(sub / "edged.toml") == config


def test_model_symlink_keeps_its_name(folder: Path) -> None:
    (folder / "link.onnx").symlink_to(folder / "m.onnx")
    (model,) = parse(folder, '[[models]]\nname = "m"\npath = "link.onnx"').models
    assert model.path == folder / "link.onnx"


# (config text, the key the error must name, a piece of the problem it must state)
ERRORS = [
    # TOML structure and types
    ("[server\n", None, "line 1, column 8: "),
    ("a = 1\n\nb = = 2\n", None, "line 3, column 5: "),
    ("colour = 1", "colour", "unknown key; allowed: server, selection, models"),
    ("sever = {}", "sever", "did you mean 'server'?"),
    ('listen = "x:1"', "listen", "it belongs in [server]"),
    ('name = "m"', "name", "it belongs in [[models]]"),
    ("server = 1", "server", "expected a table ([server]), got 1"),
    ('[models]\nname = "m"', "models", "expected an array of tables ([[models]])"),
    ('models = "m"', "models", "expected an array of tables"),
    ("models = [1]", "models[0]", "expected a table, got 1"),
    ("[[models]]", "models[0]", "empty [[models]] table; name and path are required"),
    # [server]
    ("[server]\nlistne = ''", "server.listne", "did you mean 'listen'?"),
    ('[server]\nlisten = "localhost"', "server.listen", "expected HOST:PORT, got 'localhost'"),
    ('[server]\nlisten = ":8000"', "server.listen", "expected HOST:PORT"),
    ('[server]\nlisten = "h:65536"', "server.listen", "port must be 0..65535"),
    ('[server]\nlisten = "h:-1"', "server.listen", "port must be 0..65535"),
    ('[server]\nlisten = "h:http"', "server.listen", "port must be 0..65535"),
    ('[server]\nlisten = "::1:80"', "server.listen", "needs brackets"),
    ('[server]\nlisten = "[nope]:80"', "server.listen", "not an IPv6 address"),
    ("[server]\nlisten = 8000", "server.listen", "must be a string, got 8000"),
    ('[server]\nlisten = ""\nsocket = ""', "server.listen", "nothing could reach the daemon"),
    ("[server]\nsocket_mode = 660", "server.socket_mode", 'octal string such as "0660"'),
    ('[server]\nsocket_mode = "0869"', "server.socket_mode", "got '0869'"),
    ('[server]\nsocket_mode = "01777"', "server.socket_mode", "got '01777'"),
    (f'[server]\nsocket = "/{"x" * 120}"', "server.socket", "at most 107"),
    (
        '[server]\nsocket = "$EDGED_UNSET_VAR/s"',
        "server.socket",
        "environment variable EDGED_UNSET_VAR is not set",
    ),
    ('[server]\nstate_dir = ""', "server.state_dir", "must not be empty"),
    ("[server]\nmax_body_bytes = 0", "server.max_body_bytes", "must be an integer >= 1, got 0"),
    ('[server]\nmax_body_bytes = "64M"', "server.max_body_bytes", "got '64M'"),
    (
        '[server]\nlog_level = "verbose"',
        "server.log_level",
        "must be one of debug, info, warning, error, got 'verbose'",
    ),
    # [selection]
    ("[selection]\nthreads = 2", "selection.threads", "unknown key"),
    ("[selection]\nruns = 0", "selection.runs", "must be an integer from 1 to 1000000, got 0"),
    ("[selection]\nruns = 10000000", "selection.runs", "from 1 to 1000000, got 10000000"),
    ("[selection]\nruns = 1.5", "selection.runs", "got 1.5"),
    ("[selection]\nwarmup = -1", "selection.warmup", "must be an integer from 0 to"),
    ("[selection]\nwarmup = true", "selection.warmup", "got true"),
    ("[selection]\nmin_cosine = 1.5", "selection.min_cosine", "a number above 0, at most 1"),
    ("[selection]\nmax_drop = 1", "selection.max_drop", "a number from 0 to below 1, got 1"),
    ("[selection]\nmax_drop = -0.1", "selection.max_drop", "got -0.1"),
    (
        "[selection]\nmax_drop = 0.1\nmin_cosine = 0.9",
        "selection.min_cosine",
        "give max_drop or min_cosine",
    ),
    ("[selection]\nmin_cosine = nan", "selection.min_cosine", "got nan"),
    ('[selection]\nmin_cosine = "0.9"', "selection.min_cosine", "got '0.9'"),
    ("[selection]\nmax_abs = -0.1", "selection.max_abs", "a number >= 0"),
    ("[selection]\ntime_budget_s = 0", "selection.time_budget_s", "seconds above 0"),
    ("[selection]\ntime_budget_s = inf", "selection.time_budget_s", "at most 3600, got inf"),
    # [[models]]
    ('[[models]]\npath = "m.onnx"', "models[0].name", "required"),
    ('[[models]]\nname = "m"', "models[0].path", "required"),
    ('[[models]]\nname = "m"\npath = 1', "models[0].path", "must be a string, got 1"),
    ('[[models]]\nname = "a b"\npath = "m.onnx"', "models[0].name", "got 'a b'"),
    ('[[models]]\nname = ".."\npath = "m.onnx"', "models[0].name", "not only dots"),
    ('[[models]]\nname = 5\npath = "m.onnx"', "models[0].name", "must be a string"),
    (MODEL + MODEL, "models[1].name", "duplicate model name 'm' (also models[0])"),
    (MODEL + "nmae = 'x'", "models[0].nmae", "did you mean 'name'?"),
    (MODEL + "max_batch_szie = 4", "models[0].max_batch_szie", "did you mean 'max_batch_size'?"),
    (MODEL + "threads = 0", "models[0].threads", "must be an integer from 1 to 256, got 0"),
    (MODEL + "threads = 1000000", "models[0].threads", "from 1 to 256, got 1000000"),
    (MODEL + 'threads = "2"', "models[0].threads", "got '2'"),
    (MODEL + 'backend = "tensorrt"', "models[0].backend", "got 'tensorrt'"),
    (MODEL + 'backend = "openvino:"', "models[0].backend", "got 'openvino:'"),
    (MODEL + 'backend = "all"', "models[0].backend", "BACKEND one of onnxruntime"),
    (MODEL + "backend = 1", "models[0].backend", "must be a string"),
    (MODEL + 'cpus = "0-x"', "models[0].cpus", "bad CPU list '0-x'"),
    (MODEL + 'cpus = "3-1"', "models[0].cpus", "runs backwards"),
    (MODEL + 'cpus = ""', "models[0].cpus", "leave the key out"),
    (MODEL + "cpus = []", "models[0].cpus", "leave the key out"),
    (MODEL + "cpus = [0, -1]", "models[0].cpus[1]", "must be an integer >= 0"),
    (MODEL + 'cpus = ["0"]', "models[0].cpus[0]", "got '0'"),
    (MODEL + "cpus = 1", "models[0].cpus", 'CPU list string such as "0-1,3"'),
    (MODEL + "shapes = [1, 3]", "models[0].shapes", "must be a table"),
    (MODEL + "shapes = { x = [1, 0] }", "models[0].shapes.x[1]", "must be an integer >= 1"),
    (MODEL + 'shapes = { x = "1x3" }', "models[0].shapes.x", "must be an array of integers"),
    (MODEL + "shapes = { x = [] }", "models[0].shapes.x", "at least one dimension"),
    (MODEL + "max_batch_size = 0", "models[0].max_batch_size", "must be an integer from 1"),
    (
        MODEL + "preferred_batch_sizes = [2]",
        "models[0].preferred_batch_sizes[0]",
        "must be an integer >= 1 and <= 1, got 2",
    ),
    (
        MODEL + "max_batch_size = 8\npreferred_batch_sizes = [4, 4]",
        "models[0].preferred_batch_sizes",
        "lists a size twice",
    ),
    (
        MODEL + "preferred_batch_sizes = 4",
        "models[0].preferred_batch_sizes",
        "must be an array of integers",
    ),
    (MODEL + "max_queue_delay_us = -1", "models[0].max_queue_delay_us", "0 to 10000000"),
    (
        MODEL + "max_queue_delay_us = 99999999999",
        "models[0].max_queue_delay_us",
        "from 0 to 10000000, got 99999999999",
    ),
    (MODEL + "max_queue_size = 0", "models[0].max_queue_size", "from 1 to 65536, got 0"),
    (MODEL + "timeout_ms = 0", "models[0].timeout_ms", "from 1 to 3600000, got 0"),
    (MODEL + "watchdog_ms = 86400000", "models[0].watchdog_ms", "to 3600000, got 86400000"),
    (MODEL + "period_ms = 0", "models[0].period_ms", "milliseconds above 0, at most 3600000"),
    (MODEL + "period_ms = 1e308", "models[0].period_ms", "got 1e+308"),
    (MODEL + "cpus = [4095]", "models[0].cpus", "CPU 4095 is not online on this machine"),
    (MODEL + "period_ms = -5.0", "models[0].period_ms", "got -5.0"),
    (MODEL + 'period_ms = "5"', "models[0].period_ms", "got '5'"),
    (MODEL + "period_ms = inf", "models[0].period_ms", "got inf"),
    ("[server]\nmax_connections = 0", "server.max_connections", "integer >= 1, got 0"),
    ("[server]\nmax_connections = 1.5", "server.max_connections", "got 1.5"),
    ("[server]\nmax_connections = true", "server.max_connections", "got true"),
    ("[server]\nhang_s = 0", "server.hang_s", "seconds > 0, got 0"),
    ('[server]\nhang_s = "30s"', "server.hang_s", "got '30s'"),
    (
        "[server]\nhang_s = 5\n" + MODEL + "watchdog_ms = 5000",
        "server.hang_s",
        "5 s is not longer than models[0].watchdog_ms (5000 ms)",
    ),
    (
        MODEL + "[models.shapes]\nx = [1]\n[[models]]\nname = 'm2'\npath = 'm.onnx'\nthreads = 0",
        "models[1].threads",
        "got 0",
    ),
]


@pytest.mark.parametrize(("text", "key", "problem"), ERRORS)
def test_errors_name_file_and_key(
    folder: Path, monkeypatch: pytest.MonkeyPatch, text: str, key: str | None, problem: str
) -> None:
    monkeypatch.delenv("EDGED_UNSET_VAR", raising=False)
    err = error(folder, text)
    assert err.key == key
    assert problem in err.problem
    expected = f"{folder / 'edged.toml'}: {key}: " if key else f"{folder / 'edged.toml'}: "
    assert str(err).startswith(expected)


def test_missing_model_file_names_the_absolute_path(folder: Path) -> None:
    err = error(folder, '[[models]]\nname = "m"\npath = "models/gone.onnx"')
    assert str(err) == (
        f"{folder / 'edged.toml'}: models[0].path: no such file: {folder / 'models' / 'gone.onnx'}"
    )
    err = error(folder, f'[[models]]\nname = "m"\npath = "{folder}"')
    assert err.key == "models[0].path" and err.problem == f"not a file: {folder}"


def test_typo_is_an_error_not_a_default(folder: Path) -> None:
    err = error(folder, "[server]\nmax_body_byte = 10")
    assert str(err) == (
        f"{folder / 'edged.toml'}: server.max_body_byte: unknown key; did you mean "
        f"'max_body_bytes'?; allowed: listen, socket, socket_mode, state_dir, max_body_bytes, "
        f"log_level, housekeeping_cpus, mlockall, max_connections, hang_s, "
        f"socket_max_connections, header_timeout_s, body_timeout_s, idle_timeout_s, "
        f"max_header_bytes, max_decode_bytes, grpc_listen, grpc_socket, allow_shared_memory, "
        f"model_control, metrics_names, tcp_control, max_shm_regions, "
        f"max_shm_regions_per_client, grpc_idle_timeout_s, max_models, max_model_bytes, "
        f"load_dirs"
    )


def test_isolation_keys(folder: Path) -> None:
    config = parse(
        folder,
        '[server]\nhousekeeping_cpus = "0"\nmlockall = true\n'
        + MODEL
        + 'cpus = "1"\nrt_priority = 50\n',
    )
    assert config.server.housekeeping_cpus == (0,) and config.server.mlockall is True
    assert config.models[0].rt_priority == 50
    assert "models[0].rt_priority: SCHED_FIFO priorities are 1-99" in str(
        error(folder, MODEL + "rt_priority = 120\n")
    )
    assert "server.mlockall: must be true or false" in str(
        error(folder, '[server]\nmlockall = "yes"\n')
    )
    assert "tuning.auto: expected one of off, propose, apply, got 'yes'" in str(
        error(folder, '[tuning]\nauto = "yes"\n')
    )
    assert "tuning.windows: must be an integer" in str(error(folder, "[tuning]\nwindows = 2\n"))
    assert "tuning.root: no such folder" in str(error(folder, '[tuning]\nroot = "nowhere"\n'))
    assert "tuning.movable: must be a list of process-name patterns" in str(
        error(folder, '[tuning]\nmovable = "ffmpeg"\n')
    )
    assert "tuning.state_dir: must be an absolute path" in str(
        error(folder, '[tuning]\nstate_dir = "rel"\n')
    )


def test_example_documents_every_key() -> None:
    """examples/edged.toml is the reference: every key the validator accepts appears in it,
    set or commented out."""
    import re

    from edged.config.schema import MQTT_KEYS, TOP_KEYS, DetectorConfig, toml_keys
    from edged.vision.settings import Preprocessing

    text = EXAMPLE.read_text()
    subtables = [
        ("telemetry.mqtt", MQTT_KEYS),
        ("models.image", toml_keys(Preprocessing)),
        ("models.detector", toml_keys(DetectorConfig)),
    ]
    missing = [
        f"{section}.{key}"
        for section, keys in [*TOP_KEYS.items(), *subtables]
        for key in keys
        if key != "mqtt"
        and not re.search(rf"^#?\s*{key}\s*=", text, re.MULTILINE)
        and f"[{section}.{key}]" not in text
        and f"[{section}.{key}." not in text  # a table of tables: by its sub-tables
    ]
    assert not missing
    assert "[telemetry.mqtt]" in text and "[audit]" in text


def test_connection_limit_and_hang_bound(folder: Path) -> None:
    server = parse(folder, "").server
    assert (server.max_connections, server.hang_s) == (64, 30.0)
    server = parse(folder, "[server]\nmax_connections = 2\nhang_s = 1.5\n").server
    assert (server.max_connections, server.hang_s) == (2, 1.5)
    # Unset, the hang bound leaves room for the slowest model's fail-over.
    slow = parse(folder, MODEL + "watchdog_ms = 40000\n").server
    assert slow.hang_s == 80.0
    assert parse(folder, MODEL + "watchdog_ms = 200\n").server.hang_s == 30.0
    assert (
        parse(folder, "[server]\nhang_s = 0.5\n" + MODEL + "watchdog_ms = 200\n").server.hang_s
        == 0.5
    )


def test_period_ms(folder: Path) -> None:
    (model,) = parse(folder, MODEL + "period_ms = 5\n").models
    assert (model.period_ms, model.period_s) == (5.0, 0.005)
    (model,) = parse(folder, MODEL + "period_ms = 2.5\n").models
    assert model.period_ms == 2.5
    (model,) = parse(folder, MODEL).models
    assert (model.period_ms, model.period_s) == (None, None)


def test_the_file_is_named_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("edged.toml").write_text('[server]\nlisten = "localhost"\n')
    with pytest.raises(ConfigError) as info:
        load_config("edged.toml")
    assert str(info.value) == "edged.toml: server.listen: expected HOST:PORT, got 'localhost'"


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    with pytest.raises(ConfigError, match=f"^{missing}: no such file$"):
        load_config(missing)
    with pytest.raises(ConfigError, match=f"^{tmp_path}: is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"a = '\xff'\n")
    with pytest.raises(ConfigError, match=f"^{binary}: not UTF-8 text"):
        load_config(binary)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[server]\nlog_level = 'error'\n")
    assert load_config(bom).server.log_level == "error"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked.toml"
    locked.write_text("")
    locked.chmod(0)
    with pytest.raises(ConfigError, match=f"^{locked}: permission denied$"):
        load_config(locked)


def test_telemetry_keys(folder: Path) -> None:
    (folder / "ca.pem").write_text("x")
    (folder / "pw").write_text("secret\n")
    config = parse(
        folder,
        """
        [telemetry]
        interval_s = 1
        [telemetry.mqtt]
        url = "mqtts://broker.local:8883"
        group = "line-3"
        ca_file = "ca.pem"
        username = "edged"
        password_file = "pw"
        spool_max_mb = 5
    """,
    )
    mqtt = config.telemetry.mqtt
    assert config.telemetry.interval_s == 1.0
    assert (mqtt.url, mqtt.group, mqtt.device_id) == ("mqtts://broker.local:8883", "line-3", None)
    assert mqtt.ca_file == folder / "ca.pem" and mqtt.password_file == folder / "pw"
    assert mqtt.spool_max_mb == 5 and mqtt.spool_max_age_days == 7
    assert parse(folder, "").telemetry.mqtt is None  # no broker: telemetry to the log


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[telemetry.mqtt]\nurl = "http://x:1"\n', "telemetry.mqtt.url: expected mqtt://HOST:PORT"),
        ('[telemetry.mqtt]\nurl = "mqtt://x:99999"\n', "telemetry.mqtt.url"),
        (
            '[telemetry.mqtt]\nurl = "mqtt://x:1"\ngroup = "a/b"\n',
            "telemetry.mqtt.group: must be one",
        ),
        ('[telemetry.mqtt]\nurl = "mqtt://x:1"\nca_file = "nope.pem"\n', "ca_file: no such file"),
        ('[telemetry.mqtt]\nurl = "mqtt://x:1"\nprotocol = "4"\n', 'protocol: must be "5"'),
        ("[telemetry]\ninterval_s = 0\n", "telemetry.interval_s: must be a number of seconds"),
        ("[telemetry]\ninterval_s = inf\n", "telemetry.interval_s: must be a number of seconds"),
        ("[telemetry]\ninterval_s = 1e308\n", "from 0.1 to 86400, got 1e+308"),
        (
            '[telemetry.mqtt]\nurl = "mqtt://x:1"\nspool_max_mb = inf\n',
            "telemetry.mqtt.spool_max_mb: must be a number of MiB above 0, at most 1048576, "
            "got inf",
        ),
        ('[telemetry.mqtt]\nurl = "mqtt://x:1"\nspool_max_mb = 1e308\n', "got 1e+308"),
        ('[telemetry.mqtt]\nurl = "mqtt://x:1"\nspool_max_age_days = nan\n', "got nan"),
        (
            '[telemetry.mqtt]\nurl = "mqtt://x:1"\nkeepalive_s = 100000\n',
            "keepalive_s: must be an integer from 1 to 65535",
        ),
        ("[telemetry]\nintervall_s = 1\n", "telemetry.intervall_s: unknown key"),
    ],
)
def test_telemetry_errors(folder: Path, text: str, message: str) -> None:
    assert message in str(error(folder, text))


def test_mqtt_settings_are_checked_at_load_once(folder: Path) -> None:
    """What the publisher needs is checked here too (test_telemetry_errors has the rest),
    naming the key, so a bad broker setting fails --check-config and the publisher trusts
    its settings."""
    (folder / "ca.pem").write_text("x")
    (folder / "pw").write_text("secret\n")
    bad = [
        (
            'url = "mqtt://user:secret@h:1"',
            "url",
            "must not carry user:password@; use username and password_file",
        ),
        ('url = "mqtt://"', "url", "expected mqtt://HOST:PORT or mqtts://HOST:PORT, got 'mqtt://'"),
        ('url = "mqtt://h:0"', "url", "expected mqtt[s]://HOST[:PORT], got 'mqtt://h:0'"),
        (
            'url = "mqtt://h:1/path"',
            "url",
            "expected mqtt[s]://HOST[:PORT] and nothing after it, got 'mqtt://h:1/path'",
        ),
        ('url = "mqtt://h:1"\ndevice_id = "+"', "device_id", "must be one MQTT topic level"),
        ('url = "mqtt://h:1"\ndevice_id = ""', "device_id", "must be one MQTT topic level"),
        (
            'url = "mqtt://h:1"\nca_file = "ca.pem"',
            "url",
            "ca_file/cert_file/key_file need an mqtts:// url",
        ),
        (
            'url = "mqtts://h:1"\ncert_file = "ca.pem"',
            "cert_file",
            "cert_file and key_file go together",
        ),
        ('url = "mqtt://h:1"\npassword_file = "pw"', "username", "required with password_file"),
        (
            'url = "mqtt://h:1"\nkeepalive_s = 0',
            "keepalive_s",
            "must be an integer from 1 to 65535, got 0",
        ),
    ]
    for text, key, problem in bad:
        err = error(folder, f"[telemetry.mqtt]\n{text}\n")
        assert err.key == f"telemetry.mqtt.{key}", text
        assert err.problem.startswith(problem), (text, err.problem)
        assert "secret" not in str(err)
    mqtt = parse(
        folder,
        '[telemetry.mqtt]\nurl = "mqtts://[::1]:9999"\nusername = "u"\npassword_file = "pw"\n',
    ).telemetry.mqtt
    assert (mqtt.host, mqtt.port, mqtt.tls, mqtt.keepalive_s) == ("::1", 9999, True, 30)
    assert str(folder / "pw") not in repr(mqtt)  # the password file stays out of logs
    mqtt = parse(folder, '[telemetry.mqtt]\nurl = "mqtt://broker.local"\n').telemetry.mqtt
    assert (mqtt.host, mqtt.port, mqtt.tls) == ("broker.local", 1883, False)
    assert (mqtt.spool_max_bytes, mqtt.spool_max_age_s) == (50 * 2**20, 7 * 86400)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "empty file"),
        (b"\x08\x07\x12\xff" * 100, "not a valid ONNX model"),
        (None, "not a valid ONNX model"),  # the real model, truncated
    ],
)
def test_model_file_is_read_at_load(folder: Path, models_dir: Path, content, problem) -> None:
    """A truncated, random or empty model file is an error naming the key, at load (and
    so at --check-config), not a crash at serving."""
    bad = folder / "bad.onnx"
    bad.write_bytes(
        content if content is not None else (models_dir / "ppocr_cls.onnx").read_bytes()[:3000]
    )
    err = error(folder, '[[models]]\nname = "m"\npath = "bad.onnx"\n')
    assert err.key == "models[0].path" and problem in err.problem
    assert str(bad) in err.problem


def test_cpus_are_checked_against_the_online_set(folder: Path) -> None:
    text = '[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "1-2"\n'
    source = folder / "edged.toml"
    assert parse_config(text, source, online_cpus={0, 1, 2}).models[0].cpus == (1, 2)
    with pytest.raises(
        ConfigError,
        match=r"models\[0\]\.cpus: CPU 2 is not online on this "
        r"machine \(online: 0-1\)",
    ):
        parse_config(text, source, online_cpus={0, 1})
    assert parse_config(text, source).models[0].cpus == (1, 2)  # not checked: an image's


def test_serving_extension_keys(folder: Path) -> None:
    """Shared memory and model control are off unless asked for; a wrong value names the key."""
    assert (ServerConfig().allow_shared_memory, ServerConfig().model_control) == (False, "none")
    err = error(folder, '[server]\nmodel_control = "poll"')
    assert err.key == "server.model_control" and "none, explicit" in err.problem
    err = error(folder, '[server]\nallow_shared_memory = "yes"')
    assert err.key == "server.allow_shared_memory"


# -- [models.backend_options.<backend>]: each backend reads its own keys ------------------------


def test_backend_options_are_read_by_their_backend(folder: Path) -> None:
    text = MODEL + "[models.backend_options.rockchip]\nnpu_cores = [2, 0]\n"
    text += "[models.backend_options.hailo]\nmulti_process_service = false\n"
    model = parse(folder, text).models[0]
    # By canonical name ("rockchip" is RKNN's alias), each value as its backend uses it.
    assert model.backend_options == {
        "rknn": {"npu_cores": (0, 2)},
        "hailo": {"multi_process_service": False},
    }
    assert model.policy(Policy()).backend_options == model.backend_options


def test_npu_cores_is_rknns_option_by_its_older_name(folder: Path) -> None:
    old = parse(folder, MODEL + "npu_cores = [1, 0]\n").models[0]
    new = parse(folder, MODEL + "backend_options.rknn.npu_cores = [0, 1]\n").models[0]
    assert old.backend_options == new.backend_options == {"rknn": {"npu_cores": (0, 1)}}
    assert old.policy(Policy()).key_parts() == new.policy(Policy()).key_parts()
    # No options: the selection's cache key is what it was before backend_options existed.
    assert "backend_options" not in parse(folder, MODEL).models[0].policy(Policy()).key_parts()


@pytest.mark.parametrize(
    ("extra", "key", "problem"),
    [
        ("npu_cores = [0, 0]", "models[0].npu_cores", "lists a core twice"),
        ("npu_cores = 1", "models[0].npu_cores", "expected a list of core numbers"),
        (
            "backend_options.rknn.npu_cores = [16]",
            "models[0].backend_options.rknn.npu_cores",
            "each core is a number 0-15",
        ),
        (
            "backend_options.rknn.cores = [0]",
            "models[0].backend_options.rknn.cores",
            "rknn has no option 'cores' (its options: npu_cores)",
        ),
        (
            "backend_options.openvino.threads = 2",
            "models[0].backend_options.openvino.threads",
            "openvino has no option 'threads' (its options: none)",
        ),
        (
            "backend_options.tensorrt.workspace = 1",
            "models[0].backend_options.tensorrt",
            "no backend is called 'tensorrt'",
        ),
        (
            'backend_options.hailo.multi_process_service = "yes"',
            "models[0].backend_options.hailo.multi_process_service",
            "expected true or false",
        ),
        ("backend_options = 3", "models[0].backend_options", "expected a table of backend"),
        ("backend_options.rknn = 3", "models[0].backend_options.rknn", "expected a table"),
        (
            "npu_cores = [0]\nbackend_options.rknn.npu_cores = [1]",
            "models[0].npu_cores",
            "given twice",
        ),
        (
            "backend_options.rknn.npu_cores = [0]\nbackend_options.rknpu.npu_cores = [1]",
            "models[0].backend_options.rknpu",
            "rknpu is rknn, given twice",
        ),
    ],
)
def test_backend_option_errors_name_the_key(
    folder: Path, extra: str, key: str, problem: str
) -> None:
    err = error(folder, MODEL + extra + "\n")
    assert err.key == key
    assert problem in err.problem, err.problem
