"""Frigate's ZMQ detector protocol ([frigate]), for Frigate's `type: zmq` detectors and any app
that speaks it. Written from the protocol's description (docs/FRIGATE.md), not from Frigate.

A peer is a REQ socket; edged binds one ROUTER socket (IPC path, and loopback TCP if asked),
so any number of peers are served at once, each with its own model, their frames batched
together by the model's engine like any other request. Each peer message is answered once:

- a handshake, one JSON frame `{"model_request": true, "model_name": NAME}`: NAME (the
  file name of the peer's model path) maps to a served model only through [[models]]
  `serves_as` (or the model's own name), never to a path. Answer: `{"model_available",
  "model_loaded"}`. The peer is remembered (at most [frigate] max_peers, oldest forgotten).
- an upload, `[{"model_data": true, "model_name": NAME}, <file>]`: refused (`model_saved`
  false); models reach edged through its config and repository extension only.
- a frame, `[{"shape", "dtype", "model_type"}, <raw C-order bytes>]`: a picture (uint8
  (1, H, W, 3) RGB, Frigate's default) at the model's size, or exactly the model's input
  tensor. Answer: float32 (20, 6) rows [class, score, ymin, xmin, ymax, xmax], normalised,
  best first, as `[{"shape": [20, 6], "dtype": "float32"}, <480 bytes>]`. A frame from a
  peer that has not shaken hands (edged restarted, or it was forgotten) gets no answer: the
  peer's timeout makes it re-create its socket and shake hands again, as Frigate does.
- anything else, or a request that fails: `{"error": "..."}` (Frigate reads no detections
  from it; other clients read why).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import stat
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.config.schema import FrigateConfig
from edged.serving.errors import RequestError
from edged.serving.inference import Inference
from edged.serving.models import ServedModel
from edged.serving.peers import Peer
from edged.serving.pictures import Pictures
from edged.serving.protocol import InferRequest, ProtocolError
from edged.vision.boxes import frigate_rows
from edged.vision.images import ImageInput, tensor

log = logging.getLogger("edged.serving.frigate")

MAX_FRAME_BYTES = 64 * 2**20  # a frame's data at most (a 4K RGB picture is 25 MB)
MAX_HEADER_BYTES = 4096  # a JSON frame at most
MAX_IN_FLIGHT = 256  # messages handled at once; more wait in the socket (its HWM bounds them)
DTYPES = ("uint8", "int8", "float32", "float16")
REPLY_HEADER = json.dumps({"shape": [20, 6], "dtype": "float32"}).encode()


def frame_tensor(header: Mapping[str, Any], data: bytes, target: ImageInput) -> np.ndarray:
    """The model's input from a frame: exactly its input tensor (shape and dtype), or a
    uint8 picture (1, H, W, 3) or (1, 3, H, W) at its size, preprocessed as configured."""
    shape, dtype = header.get("shape"), header.get("dtype")
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= 4
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= 65536 for d in shape)
    ):
        raise ProtocolError(f"frame header: shape must be 1 to 4 positive integers, got {shape!r}")
    if dtype not in DTYPES:
        raise ProtocolError(
            f"frame header: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
        )
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if len(data) != size:
        raise ProtocolError(
            f"frame: {len(data)} bytes, but shape {shape} of {dtype} is {size} bytes"
        )
    array = np.frombuffer(data, dtype).reshape(shape)
    h, w = target.size
    model_shape = [1, 3, h, w] if target.layout == "nchw" else [1, h, w, 3]
    if shape == model_shape and dtype == target.dtype:
        return array  # the peer prepared the input (Frigate's input_tensor/input_dtype)
    if dtype == "uint8" and shape == [1, h, w, 3]:
        return tensor(array[0], target)
    if dtype == "uint8" and shape == [1, 3, h, w]:
        return tensor(np.ascontiguousarray(array[0].transpose(1, 2, 0)), target)
    raise ProtocolError(
        f"frame: {shape} of {dtype}; model input {target.name!r} takes a uint8 picture "
        f"[1, {h}, {w}, 3] or {model_shape} of {target.dtype}"
    )


class FrigateZmq:
    """The ROUTER socket and the peers that shook hands with it."""

    def __init__(self, inference: Inference, config: FrigateConfig, socket_mode: int) -> None:
        self.inference = inference
        self.config = config
        self.socket_mode = socket_mode
        self.peers: OrderedDict[bytes, str] = OrderedDict()  # identity -> served model name
        self.where: list[str] = []
        self._sock: Any = None
        self._ctx: Any = None
        self._task: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()
        self._room = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._socket_id: tuple[int, int] | None = None

    # -- names -----------------------------------------------------------------------------
    def model_for(self, requested: Any) -> str | None:
        """The served model a peer's model name maps to (config `serves_as`, or the name of a
        served picture model), else None. Only names: a path never matches."""
        if not isinstance(requested, str) or "/" in requested or not requested:
            return None
        for name, served in self.inference.models().items():
            if requested in served.serves_as or (requested == name and served.pictures):
                return name
        return None

    def names(self) -> dict[str, list[str]]:
        """Each served picture model and the names a peer may ask for it by (for status)."""
        return {
            name: [*served.serves_as, name]
            for name, served in self.inference.models().items()
            if served.pictures is not None and served.pictures.detector is not None
        }

    # -- the socket --------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind the endpoints now (so a bind error stops the start, like the other listeners)."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + MAX_HEADER_BYTES)
        try:
            if self.config.socket is not None:
                path = self.config.socket
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        path.unlink()  # a stale socket from a previous run
                sock.bind(f"ipc://{path}")
                os.chmod(path, self.socket_mode)
                st = path.lstat()
                self._socket_id = (st.st_dev, st.st_ino)
                self.where.append(f"ipc://{path}")
            if self.config.listen_host is not None:
                host = self.config.listen_host
                host = f"[{host}]" if ":" in host else host
                if self.config.listen_port:
                    sock.bind(f"tcp://{host}:{self.config.listen_port}")
                    self.where.append(f"tcp://{host}:{self.config.listen_port}")
                else:
                    port = sock.bind_to_random_port(f"tcp://{host}")
                    self.where.append(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            raise OSError(exc.errno, f"[frigate]: cannot bind: {exc}") from None
        self._sock = sock

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._handlers):
            task.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
            self._sock = None
        path = self.config.socket
        if path is not None and self._socket_id is not None:
            with contextlib.suppress(OSError):
                st = path.lstat()
                if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._socket_id:
                    path.unlink()

    async def _serve(self) -> None:
        while True:
            message = await self._sock.recv_multipart(copy=True)
            await self._room.acquire()
            task = asyncio.ensure_future(self._answer(message))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _answer(self, message: list[bytes]) -> None:
        try:
            # A REQ peer's message: [identity, b"", frames...]
            if len(message) < 3 or message[1] != b"":
                return  # not a REQ peer: nothing it could read an answer from
            identity, frames = message[0], message[2:]
            try:
                reply, on_sent = await self._handle(identity, frames)
            except RequestError as exc:
                reply, on_sent = [_json({"error": str(exc)})], None
            if reply is None:
                return
            await self._sock.send_multipart([identity, b"", *reply])
            if on_sent is not None:
                on_sent()
        except asyncio.CancelledError:
            raise
        except Exception:  # one peer's message never ends the front end
            log.exception("frigate: a message failed")
        finally:
            self._room.release()

    async def _handle(self, identity: bytes, frames: list[bytes]):
        head = _header(frames[0])
        if len(frames) == 1 and head.get("model_request") is True:
            return [_json(self._handshake(identity, head.get("model_name")))], None
        if len(frames) == 2 and head.get("model_data") is True:
            log.warning(
                "frigate: refused a model upload for %r: models come from the config",
                str(head.get("model_name"))[:100],
            )
            return [_json({"model_saved": False, "model_loaded": False})], None
        if len(frames) == 2 and "shape" in head:
            return await self._detect(identity, head, frames[1])
        raise RequestError(
            400,
            "expected a handshake {model_request, model_name}, an upload [{model_data}, file] "
            "or a frame [{shape, dtype, model_type}, bytes]",
        )

    def _handshake(self, identity: bytes, requested: Any) -> dict[str, bool]:
        name = self.model_for(requested)
        if name is None:
            log.info("frigate: a peer asked for %r: not served", str(requested)[:100])
            return {"model_available": False, "model_loaded": False}
        self.peers[identity] = name
        self.peers.move_to_end(identity)
        while len(self.peers) > self.config.max_peers:
            self.peers.popitem(last=False)
        return {"model_available": True, "model_loaded": name in self.inference.models()}

    async def _detect(self, identity: bytes, head: dict, data: bytes):
        name = self.peers.get(identity)
        if name is None:
            return None, None  # no handshake: its timeout makes it shake hands again
        self.peers.move_to_end(identity)
        inference = self.inference
        used: list[Pictures] = []  # the served model's, as decoded: a reload may swap it

        def model() -> ServedModel:
            served = inference.model(name)
            pictures = served.pictures
            if pictures is None or pictures.detector is None:
                raise RequestError(400, f"model {name!r} has no [models.detector]")
            return served

        async def receive(served: ServedModel) -> bytes:
            return data

        async def decode(received: bytes, served: ServedModel) -> InferRequest:
            assert served.pictures is not None
            used.append(served.pictures)
            contract = served.pictures.input
            array = await asyncio.to_thread(frame_tensor, head, received, contract)
            return InferRequest(None, {contract.name: array})

        async def encode(request: InferRequest, outputs: Mapping[str, np.ndarray]) -> bytes:
            dets = await asyncio.to_thread(used[0].detections, outputs)
            return frigate_rows(dets).tobytes()

        peer = Peer("zmq", None, True, "frigate")
        answer = await inference.infer(name, model, receive, decode, encode, peer, "ZMQ")
        if answer is None:
            return None, None
        return [REPLY_HEADER, answer.payload], answer.sent


def _header(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise RequestError(400, f"a JSON frame of {len(frame)} bytes; at most {MAX_HEADER_BYTES}")
    try:
        head = json.loads(frame)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(400, "the first frame is not JSON") from None
    if not isinstance(head, dict):
        raise RequestError(400, "the first frame is not a JSON object")
    return head


def _json(value: dict) -> bytes:
    return json.dumps(value).encode()
