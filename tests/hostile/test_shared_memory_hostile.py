"""Shared memory as a hostile or careless local client uses it: an object shrunk after it was
registered (while its request waits), a full /dev/shm under a sparse region, a flood of
registrations, one user's regions named by another, another user's object. Each is a clear
error and a daemon that keeps serving; none is a signal.

Without the fixes these fail hard: the registry mapped client objects, so reading a shrunk
one was SIGBUS (this test process, or the daemon, dies), and nothing bounded the regions."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.serving.peers import GRPC_UNIX, Peer
from edged.serving.protocol import ShmRef
from edged.serving.shared_memory import (
    SHM_ROOT,
    SharedMemory,
    SharedMemoryError,
    TooManyRegions,
)
from tests.support.daemon_harness import OUT, Daemon, cls_input, cls_table, write_config

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm")

ROOT = Peer("unix", 0, True, "unix")
ALICE = Peer("unix", 1000, True, "unix")
BOB = Peer("unix", 1001, True, "unix")
F32 = np.dtype("float32")
# A second principal that may open root's objects: the gRPC socket's (the object is shared).
OTHER = GRPC_UNIX


@pytest.fixture
def objects():
    """Creates /dev/shm objects (size, mode, owner) and removes them after."""
    made: list[Path] = []

    def make(size: int, mode: int = 0o600, uid: int | None = None) -> str:
        key = f"/edged_hostile_{uuid.uuid4().hex[:10]}"
        path = SHM_ROOT / key[1:]
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        os.ftruncate(fd, size)
        os.close(fd)
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, -1)
        made.append(path)
        return key

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_an_object_shrunk_after_registering_is_a_400_not_sigbus(objects) -> None:
    key = objects(4096)
    registry = SharedMemory(enabled=True)
    registry.register(ROOT, "r", key, 0, 4096)
    os.truncate(SHM_ROOT / key[1:], 0)  # what a client may do while its request is queued
    with pytest.raises(SharedMemoryError, match="shrank") as err:
        registry.read_input(ROOT, "x", F32, (1024,), ShmRef("r", 0, 4096))
    assert err.value.status == 400
    with pytest.raises(SharedMemoryError, match="shrank"):
        registry.write_outputs(ROOT, {"y": ShmRef("r", 0, 4096)}, {"y": np.ones(8, F32)})
    assert os.stat(SHM_ROOT / key[1:]).st_size == 0  # the daemon did not grow it back


def test_a_full_tmpfs_under_a_sparse_region_is_a_400_not_sigbus(tmp_path: Path) -> None:
    """A region larger than the room left on its file system: writing outputs into it is
    ENOSPC, said as an error; with a mapping it was SIGBUS."""
    root = tmp_path / "shm"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with open(root / "big", "wb") as f:
            f.truncate(4 * 2**20)  # 4 MiB, sparse, on a 64 KiB file system
        registry = SharedMemory(enabled=True, root=root)
        registry.register(ROOT, "r", "/big", 0, 4 * 2**20)
        out = np.ones(2**20, F32)
        with pytest.raises(SharedMemoryError, match="No space left") as err:
            registry.write_outputs(ROOT, {"y": ShmRef("r", 0, out.nbytes)}, {"y": out})
        assert err.value.status == 400
        registry.close()
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_regions_are_capped_in_all_and_per_client(objects) -> None:
    key = objects(4096, mode=0o660)
    registry = SharedMemory(enabled=True, max_regions=5, max_per_client=3)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(3):
        registry.register(ROOT, f"a{i}", key, 0, 16)
    with pytest.raises(TooManyRegions, match="max_shm_regions_per_client") as err:
        registry.register(ROOT, "a3", key, 0, 16)
    assert err.value.status == 400 and err.value.grpc_code == "RESOURCE_EXHAUSTED"
    registry.register(OTHER, "b0", key, 0, 16)
    registry.register(OTHER, "b1", key, 0, 16)
    with pytest.raises(TooManyRegions, match="max_shm_regions allows"):
        registry.register(OTHER, "b2", key, 0, 16)
    assert registry.count() == 5 and len(os.listdir("/proc/self/fd")) == before + 5
    registry.unregister(ROOT)  # all of root's, none of the other's
    assert registry.count() == 2
    registry.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_one_clients_regions_are_invisible_to_another(objects) -> None:
    mine = objects(64, uid=1000)
    registry = SharedMemory(enabled=True)
    registry.register(ALICE, "r", mine, 0, 64)
    assert registry.status(BOB) == []
    with pytest.raises(SharedMemoryError, match="unable to find"):
        registry.read_input(BOB, "x", F32, (16,), ShmRef("r", 0, 64))
    with pytest.raises(SharedMemoryError, match="not registered"):
        registry.unregister(BOB, "r")
    registry.unregister(BOB)  # "all": all of Bob's, which is none
    assert [r["name"] for r in registry.status(ALICE)] == ["r"]
    theirs = objects(64, uid=1000)
    registry.register(BOB, "r", objects(64, uid=1001), 0, 64)  # the same name, Bob's own
    with pytest.raises(SharedMemoryError, match="belongs to uid 1000") as err:
        registry.register(BOB, "s", theirs, 0, 64)  # re-pointing at Alice's object
    assert err.value.status == 403
    registry.close()


def test_a_client_of_unknown_user_may_name_only_shared_objects(objects) -> None:
    private = objects(64, mode=0o600)
    shared = objects(64, mode=0o660)
    registry = SharedMemory(enabled=True)
    with pytest.raises(SharedMemoryError, match="private to its owner") as err:
        registry.register(GRPC_UNIX, "p", private, 0, 64)
    assert err.value.status == 403 and registry.count() == 0
    registry.register(GRPC_UNIX, "s", shared, 0, 64)
    assert registry.count() == 1
    registry.close()


@pytest.mark.integration
def test_the_daemon_survives_a_region_shrunk_under_a_queued_request(
    models_dir: Path, tmp_path: Path, objects
) -> None:
    """The race the issue saw: requests queue behind a busy model, the region of one of them
    is truncated to 0 before the worker reads it. Every request gets an answer or a 400, and
    the daemon serves on (before, it died of SIGBUS with no log line)."""
    import threading

    models = cls_table(models_dir, max_batch_size=1, max_queue_size=256)
    config = write_config(tmp_path, models, "allow_shared_memory = true")
    daemon = Daemon(config).wait_ready()
    try:
        x = cls_input(1)
        key = objects(x.nbytes, mode=0o660)
        path = SHM_ROOT / key[1:]
        with open(path, "r+b") as f:
            f.write(x.tobytes())
        client = tg.InferenceServerClient(f"unix://{tmp_path / 'grpc.sock'}")
        client.register_system_shared_memory("in", key, x.nbytes)
        results: list[str] = []

        def one() -> None:
            inp = tg.InferInput("x", list(x.shape), "FP32")
            inp.set_shared_memory("in", x.nbytes)
            try:
                client.infer("cls", [inp], outputs=[tg.InferRequestedOutput(OUT)])
                results.append("ok")
            except Exception as exc:
                results.append(str(exc))

        threads = [threading.Thread(target=one) for _ in range(64)]
        for i, t in enumerate(threads):
            t.start()
            if i == 8:
                os.truncate(path, 0)
        for t in threads:
            t.join(60)
        assert daemon.proc.poll() is None, daemon.log_text()
        assert len(results) == 64
        odd = [r for r in results if r != "ok" and "shrank" not in r]
        assert not odd, odd
        assert any("shrank" in r for r in results)
        inp = tg.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert client.infer("cls", [inp]).as_numpy(OUT).shape == (1, 2)
        client.close()
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["register", "unregister", "unregister_all", "read", "write"]),
            st.sampled_from([ROOT, ALICE, BOB, OTHER]),
            st.sampled_from(["a", "b", "c", "", "x" * 300]),
            st.sampled_from([0, 1, 2, 3]),  # which object (3: one that does not exist)
            st.one_of(st.integers(-1, 5000), st.just(2**63), st.none(), st.text(max_size=3)),
            st.one_of(st.integers(-1, 5000), st.just(2**40), st.just(True), st.text(max_size=3)),
        ),
        max_size=40,
    )
)
def test_any_sequence_of_registry_calls_is_answered_and_leaks_no_descriptor(steps) -> None:
    """Registers, unregisters, reads and writes in any order, by any of four principals, with
    any offset and size (wrong types, negative, past the object's end, past 2^63): every call
    answers or raises SharedMemoryError; the caps hold; after every region is unregistered the
    process holds exactly the descriptors it held before (none leaked by a failed register)."""
    keys = []
    paths = []
    for mode, size in ((0o666, 4096), (0o600, 64), (0o644, 0)):
        key = f"/edged_fuzz_{uuid.uuid4().hex[:10]}"
        path = SHM_ROOT / key[1:]
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        os.ftruncate(fd, size)
        os.close(fd)
        os.chmod(path, mode)
        keys.append(key)
        paths.append(path)
    keys.append(f"/edged_fuzz_missing_{uuid.uuid4().hex[:10]}")
    registry = SharedMemory(enabled=True, max_regions=6, max_per_client=3)
    before = _open_fds()
    try:
        for op, peer, name, which, offset, size in steps:
            try:
                if op == "register":
                    registry.register(peer, name, keys[which], offset, size)
                elif op == "unregister":
                    registry.unregister(peer, name)
                elif op == "unregister_all":
                    registry.unregister(peer)
                elif op == "read":
                    ref = ShmRef(name, offset if isinstance(offset, int) else 0, 16)
                    registry.read_input(peer, "x", F32, (4,), ref)
                else:
                    ref = ShmRef(name, offset if isinstance(offset, int) else 0, 16)
                    region = registry.region(peer, ref, "outputs[0]")
                    region.write_from(memoryview(bytes(16)), region.position(ref, "y"), "y")
            except SharedMemoryError as exc:
                assert str(exc) and 400 <= exc.status < 600
            assert registry.count() <= 6
            assert registry.count() == _open_fds() - before
            for who in (ROOT, ALICE, BOB, OTHER):
                assert len(registry.status(who)) <= 3
        for who in (ROOT, ALICE, BOB, OTHER):
            registry.unregister(who)
        assert registry.count() == 0
        assert _open_fds() == before
    finally:
        registry.close()
        for path in paths:
            path.unlink(missing_ok=True)
