"""The HTTP routes other than infer, as a hostile local client uses them: who may is decided
before any of the body is read, a control route's body is small and bounded before it is
allocated, deep JSON is a 400. In process, on the ASGI app (the daemon's use of the same app
is in tests/serving/test_hostile_http.py and tests/serving/test_shared_memory.py)."""

from __future__ import annotations

import asyncio

import pytest

from edged.serving.api import Api
from edged.serving.http_control import CONTROL_BODY_BYTES
from edged.serving.http_limits import PEER
from edged.serving.inference import Inference, ModelControl
from edged.serving.metrics import ServingMetrics
from edged.serving.peers import Peer
from edged.serving.shared_memory import SharedMemory

LOOPBACK = Peer("tcp", None, True, "127.0.0.1:5000", (("127.0.0.1", 5000), ("127.0.0.1", 8000)))
UNIX = Peer("unix", 0, True, "unix")


class Client:
    """One request to the app: records whether the app read the body, and the answer."""

    def __init__(self, body: bytes = b"{}", declared: int | None = None) -> None:
        self.body = body
        self.declared = len(body) if declared is None else declared
        self.reads = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.reads += 1
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def run(self, api: Api, method: str, path: str, peer: Peer) -> tuple[int, bytes]:
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(b"content-length", str(self.declared).encode())],
            "server": ("127.0.0.1", 8000) if peer.transport == "tcp" else ("/s", None),
            "client": ("127.0.0.1", 5000) if peer.transport == "tcp" else None,
            PEER: peer,
        }
        asyncio.run(api(scope, self.receive, self.send))
        return self.sent[0]["status"], self.sent[1]["body"]


async def _never(*args) -> None:
    raise AssertionError("the model set was not to be touched")


def api(control: bool = True, shm: bool = True) -> Api:
    return Api(
        Inference(
            dict,
            ServingMetrics(),
            shared_memory=SharedMemory(enabled=shm),
            control=ModelControl(_never, _never, set) if control else None,
        ),
        64 * 2**20,
    )


@pytest.mark.parametrize(
    ("path", "app", "says"),
    [
        ("/v2/repository/models/m/load", api(control=False), b'model_control = \\"none\\"'),
        ("/v2/repository/models/m/load", api(), b"tcp_control = false"),
        ("/v2/systemsharedmemory/region/r/register", api(shm=False), b"allow_shared_memory"),
        ("/v2/systemsharedmemory/region/r/register", api(), b"tcp_control = false"),
    ],
)
def test_refused_before_the_body_is_read(path: str, app: Api, says: bytes) -> None:
    client = Client(b'{"key": "/x", "byte_size": 4}', declared=2**30)
    status, body = client.run(app, "POST", path, LOOPBACK)
    assert status == 403 and says in body
    assert client.reads == 0


@pytest.mark.parametrize(
    "path",
    [
        "/v2/repository/models/m/load",
        "/v2/repository/index",
        "/v2/systemsharedmemory/region/r/register",
    ],
)
def test_a_control_body_over_its_bound_is_413_unread(path: str) -> None:
    """A declared 1 GiB body (under max_body_bytes it would have been allocated whole)."""
    client = Client(declared=2**30)
    status, body = client.run(api(), "POST", path, UNIX)
    assert status == 413 and str(CONTROL_BODY_BYTES).encode() in body
    assert client.reads == 0


def test_a_control_body_longer_than_declared_is_413() -> None:
    client = Client(b"x" * (CONTROL_BODY_BYTES + 1), declared=10)
    status, _ = client.run(api(), "POST", "/v2/repository/index", UNIX)
    assert status == 413


def test_deeply_nested_json_is_a_400() -> None:
    body = b"[" * 30_000 + b"]" * 30_000  # under the route's 64 KiB
    status, text = Client(body).run(api(), "POST", "/v2/repository/index", UNIX)
    assert status == 400 and b"nested" in text


def test_the_unix_socket_may_load() -> None:
    loaded: list[str] = []

    async def load(name: str, table) -> None:
        loaded.append(name)

    app = Api(Inference(dict, ServingMetrics(), control=ModelControl(load, _never, set)), 2**20)
    status, _ = Client(b"{}").run(app, "POST", "/v2/repository/models/m/load", UNIX)
    assert status == 200 and loaded == ["m"]
