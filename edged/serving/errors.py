"""The error every front end answers with its status: a request refused or failed. In a module
of its own, below the infer path (`inference`) and the shared-memory registry, which both
raise it."""

from __future__ import annotations


class RequestError(Exception):
    """A request refused or failed, with its HTTP status; gRPC maps the status to its code
    (`edged.serving.grpc_server.STATUS_CODES`). `retry_after`: seconds a refused client is
    told to wait (HTTP's Retry-After), when the refusal is for a while (a cooling device)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
