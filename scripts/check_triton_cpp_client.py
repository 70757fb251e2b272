"""Run Triton's own C++ client examples, unmodified, against edged.

Triton's C++ client library (what C++ apps on devices link) parses responses more strictly
than the Python tritonclient the tests use. Its sources are not on any package registry, so
CI cannot build it; this script is how a developer checks edged against it from a checkout
of triton-inference-server/client and /common (any recent commit):

    apt-get install g++ pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev \\
        protobuf-compiler rapidjson-dev libcurl4-openssl-dev zlib1g-dev
    .venv/bin/python scripts/check_triton_cpp_client.py --client ~/src/client \\
        --common ~/src/common

It builds the library (HTTP and gRPC) and the examples below with g++ against Debian's
gRPC/protobuf/curl/rapidjson (about a minute on 2 cores, cached in --build), writes Triton's
"simple" model (INT32 [-1,16] INPUT0/INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference) as
ONNX, starts edged serving it with shared memory on, and runs each example. Exit codes:
0 every example passed, 1 one failed, 2 could not build or start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.broker import free_port, wait_port  # noqa: E402

# The examples that run against the "simple" model; each prints PASS on success.
EXAMPLES = [
    "simple_http_infer_client",
    "simple_grpc_infer_client",
    "simple_http_async_infer_client",
    "simple_grpc_async_infer_client",
    "simple_http_shm_client",
    "simple_grpc_shm_client",
    "simple_grpc_custom_args_client",
    "simple_grpc_keepalive_client",
    "reuse_infer_objects_client",
]
LIBRARY = ["common.cc", "cencode.cc", "shm_utils.cc", "json_utils.cc"]
LIBRARY += ["grpc_client.cc", "http_client.cc"]
PROTOS = ["grpc_service", "model_config", "health"]


def build(client: Path, common: Path, out: Path) -> dict[str, Path]:
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    plugin = shutil.which("grpc_cpp_plugin")
    if plugin is None or shutil.which("protoc") is None or shutil.which("g++") is None:
        raise SystemExit("check_triton_cpp_client: needs g++, protoc and grpc_cpp_plugin")
    protos = [str(common / "protobuf" / f"{p}.proto") for p in PROTOS]
    subprocess.run(
        [
            "protoc",
            "-I",
            str(common / "protobuf"),
            f"--cpp_out={gen}",
            f"--grpc_out={gen}",
            f"--plugin=protoc-gen-grpc={plugin}",
            *protos,
        ],
        check=True,
    )
    library = client / "src" / "c++" / "library"
    flags = ["-O1", "-std=c++17", "-pthread", "-DTRITON_ENABLE_ZLIB=1"]
    flags += [f"-I{gen}", f"-I{library}", f"-I{common / 'include'}"]
    sources = [gen / f"{p}.pb.cc" for p in PROTOS] + [
        gen / f"{p}.grpc.pb.cc" for p in ("grpc_service", "health")
    ]
    sources += [library / name for name in LIBRARY]
    objects, jobs = [], []
    for source in sources:
        obj = out / (source.name + ".o")
        objects.append(str(obj))
        if not obj.exists():
            jobs.append(subprocess.Popen(["g++", *flags, "-c", str(source), "-o", str(obj)]))
    if any(job.wait() for job in jobs):
        raise SystemExit("check_triton_cpp_client: the library did not compile (see above)")
    libs = [
        *subprocess.run(
            ["pkg-config", "--libs", "grpc++", "protobuf"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split(),
        "-lcurl",
        "-lz",
        "-lrt",
    ]
    programs = {}
    for name in EXAMPLES:
        program = out / name
        if not program.exists():
            source = client / "src" / "c++" / "examples" / f"{name}.cc"
            subprocess.run(
                ["g++", *flags, str(source), *objects, *libs, "-o", str(program)], check=True
            )
        programs[name] = program
    return programs


def simple_model(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    def tensor(name: str):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [tensor("INPUT0"), tensor("INPUT1")],
        [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", type=Path, required=True, help="triton client checkout")
    parser.add_argument("--common", type=Path, required=True, help="triton common checkout")
    parser.add_argument("--build", type=Path, default=Path.home() / ".cache/edged/triton-cpp")
    args = parser.parse_args()
    programs = build(args.client, args.common, args.build)
    folder = Path(tempfile.mkdtemp(prefix="edged-cpp-"))
    simple_model(folder / "simple.onnx")
    http, grpc_port = free_port(), free_port()
    (folder / "edged.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{http}"\ngrpc_listen = "127.0.0.1:{grpc_port}"\n'
        f'socket = "edged.sock"\nstate_dir = "state"\nallow_shared_memory = true\n'
        f'tcp_control = true\n\n[[models]]\nname = "simple"\npath = "simple.onnx"\n'
        f'backend = "onnxruntime"\nmax_batch_size = 8\n'
    )
    log = (folder / "edged.log").open("wb")
    edged = ROOT / ".venv" / "bin" / "edged"
    daemon = subprocess.Popen(
        [str(edged), "--config", str(folder / "edged.toml")], stdout=log, stderr=log
    )
    failed = 0
    try:
        try:
            wait_port(http, 60)
            wait_port(grpc_port, 60)
        except TimeoutError:
            print((folder / "edged.log").read_text(), file=sys.stderr)
            return 2
        time.sleep(0.5)
        for name, program in programs.items():
            port = http if "http" in name or name.startswith("reuse") else grpc_port
            run = subprocess.run(
                [str(program), "-u", f"localhost:{port}"],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "LC_ALL": "C"},
            )
            ok = run.returncode == 0
            failed += not ok
            last = (run.stdout.strip().splitlines() or [""])[-1]
            print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {run.returncode} {last}")
            if not ok:
                print(run.stderr[-2000:], file=sys.stderr)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
