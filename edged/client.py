"""A small client for local applications: numpy in, numpy out, over TCP or the Unix socket.

Binary tensors both ways (the protocol's binary extension) on one keep-alive connection;
standard library only, so an application does not need tritonclient and its dependencies.

    from edged.client import Client
    with Client("unix:/run/edged/edged.sock") as edged:
        outputs = edged.infer("ocr-det", {"x": image})
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.serving.protocol import DATATYPES, datatype_of

DEFAULT_ADDRESS = "unix:/run/edged/edged.sock"


class EdgedError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"[{status}] {message}")
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Client:
    """`address` is "unix:/path/to.sock", "http://host:port" or "host:port"."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 30.0) -> None:
        self.address = address
        if address.startswith("unix:"):
            self._conn: http.client.HTTPConnection = _UnixConnection(address[5:], timeout)
        else:
            host = address.removeprefix("http://").rstrip("/")
            self._conn = http.client.HTTPConnection(host, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):  # one retry: the server may have closed an idle keep-alive
            try:
                self._conn.request(method, path, body=body, headers=dict(headers or {}))
                response = self._conn.getresponse()
                return response.status, dict(response.getheaders()), response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_json(self, path: str) -> Any:
        status, _, body = self._request("GET", path)
        doc = json.loads(body) if body else {}
        if status >= 400:
            raise EdgedError(status, doc.get("error", body.decode(errors="replace")))
        return doc

    def get_text(self, path: str) -> str:
        status, _, body = self._request("GET", path)
        if status >= 400:
            raise EdgedError(status, body.decode(errors="replace"))
        return body.decode()

    def reload(self) -> None:
        status, _, body = self._request("POST", "/edged/reload")
        if status != 202:
            raise EdgedError(status, json.loads(body).get("error", "") if body else "")

    def ready(self) -> bool:
        status, _, _ = self._request("GET", "/v2/health/ready")
        return status == 200

    def status(self) -> dict[str, Any]:
        return self.get_json("/edged/status")

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], timeout_ms: float | None = None
    ) -> dict[str, np.ndarray]:
        header: dict[str, Any] = {"inputs": [], "parameters": {"binary_data_output": True}}
        if timeout_ms is not None:
            header["parameters"]["timeout"] = int(timeout_ms * 1000)  # protocol: microseconds
        chunks = []
        for name, array in inputs.items():
            array = np.ascontiguousarray(array)
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            header["inputs"].append(
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": datatype_of(array.dtype.name),
                    "parameters": {"binary_data_size": len(data)},
                }
            )
            chunks.append(data)
        head = json.dumps(header, separators=(",", ":")).encode()
        status, headers, body = self._request(
            "POST",
            f"/v2/models/{model}/infer",
            head + b"".join(chunks),
            {"Inference-Header-Content-Length": str(len(head))},
        )
        if status != 200:
            try:
                message = json.loads(body).get("error", "")
            except ValueError:
                message = body.decode(errors="replace")
            raise EdgedError(status, message)
        return decode_response(body, headers)


def decode_response(body: bytes, headers: Mapping[str, str]) -> dict[str, np.ndarray]:
    lowered = {k.lower(): v for k, v in headers.items()}
    length = int(lowered.get("inference-header-content-length", len(body)))
    doc = json.loads(body[:length])
    offset = length
    outputs = {}
    for out in doc["outputs"]:
        dtype = DATATYPES[out["datatype"]]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outputs[out["name"]] = np.frombuffer(
                body, dtype=dtype, count=size // dtype.itemsize, offset=offset
            ).reshape(out["shape"])
            offset += size
        else:
            outputs[out["name"]] = np.asarray(out["data"], dtype=dtype).reshape(out["shape"])
    return outputs
