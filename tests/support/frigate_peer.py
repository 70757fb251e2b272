"""A Frigate-like ZMQ detector client, written from the protocol (docs/FRIGATE.md), not from
Frigate: one REQ socket, the handshake, frames, and a socket re-created after a timeout."""

from __future__ import annotations

import json

import numpy as np
import zmq

TIMEOUT_MS = 2000  # Frigate's is 200; a loaded CI machine gets more here


class Peer:
    """A Frigate-like detector client: one REQ socket, re-created after a timeout."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        self.endpoint, self.model_name = endpoint, model_name
        self.ctx = zmq.Context.instance()
        self.sock = None
        self.connect()

    def connect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
        self.sock.connect(self.endpoint)

    def ask(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply, or None on a timeout (the socket is then re-created, as Frigate does)."""
        self.sock.send_multipart(frames)
        try:
            return self.sock.recv_multipart()
        except zmq.Again:
            self.connect()
            return None

    def handshake(self, name: str | None = None) -> dict:
        request = {"model_request": True, "model_name": name or self.model_name}
        reply = self.ask([json.dumps(request).encode()])
        assert reply is not None and len(reply) == 1
        return json.loads(reply[0])

    def detect(self, picture: np.ndarray) -> np.ndarray | dict | None:
        """Rows (20, 6), or the error object, or None (no answer)."""
        header = {
            "shape": list(picture.shape),
            "dtype": str(picture.dtype),
            "model_type": "yologeneric",
        }
        reply = self.ask([json.dumps(header).encode(), picture.tobytes()])
        if reply is None:
            return None
        if len(reply) == 1:
            return json.loads(reply[0])
        head = json.loads(reply[0])
        assert head == {"shape": [20, 6], "dtype": "float32"}
        assert len(reply[1]) == 480
        return np.frombuffer(reply[1], np.float32).reshape(20, 6)

    def close(self) -> None:
        self.sock.close(0)
