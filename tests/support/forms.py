"""multipart/form-data bodies, as a browser or DeepStack's clients send a picture."""

from __future__ import annotations

import uuid


def multipart(fields: dict[str, tuple[str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body (name -> (file name or None, content)) and its type."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, (filename, content) in fields.items():
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += (
            f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
            + content
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"
