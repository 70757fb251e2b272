"""The DeepStack detection API on the HTTP front end, as Frigate's `deepstack` detector, Home
Assistant's and Blue Iris's integrations (and CodeProject.AI) speak it:

- `POST /v1/vision/detection`: the first [[models]] with a [models.detector] (config order);
- `POST /v1/vision/custom/<name>`: the detector model named so (or by a `serves_as` name).

The body is multipart/form-data with the picture in `image` (JPEG, PNG, ...) and optionally
`min_confidence` (default 0.45, DeepStack's). The answer is `{"success": true,
"predictions": [{"label", "confidence", "x_min", "y_min", "x_max", "y_max"}], "duration"}`
with boxes in pixels of the picture sent, best first; a failure is `{"success": false,
"error": ...}` with its HTTP status. The picture is decoded and fitted to the model
([models.image] resize: stretch or letterbox) in a thread, off the event loop and the
inference core, through the shared infer path (admission, queue, batching, metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.serving.http_io import read_body, request_peer, send_json
from edged.serving.http_limits import BODY_TIMED_OUT
from edged.serving.inference import ClientGone, Inference, RequestError
from edged.serving.models import ServedModel
from edged.serving.pictures import Pictures
from edged.serving.protocol import InferRequest, ProtocolError
from edged.vision.boxes import deepstack_predictions
from edged.vision.images import Fit, ImageError

DEFAULT_MIN_CONFIDENCE = 0.45  # DeepStack's
MAX_FIELDS = 8  # form fields in one upload (image, min_confidence and a few unknown ones)


def form_fields(body: bytes | bytearray, content_type: bytes) -> dict[str, bytes]:
    """The fields of a multipart/form-data body, by name (python-multipart's parser)."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ProtocolError(
            "DeepStack: the body must be multipart/form-data with the picture in 'image'"
        )
    fields: dict[str, bytes] = {}
    part: dict[str, Any] = {}
    header = [b"", b""]

    def on_part_begin() -> None:
        part.clear()
        part["data"], part["headers"] = [], {}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        part["headers"][header[0].lower()] = header[1]
        header[0] = header[1] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part["data"].append(data[start:end])

    def on_part_end() -> None:
        if len(fields) >= MAX_FIELDS:
            raise ProtocolError(f"DeepStack: more than {MAX_FIELDS} form fields")
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        fields[name] = b"".join(part["data"])

    callbacks: Any = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(bytes(body))
        parser.finalize()
    except ProtocolError:
        raise
    except Exception as exc:  # the parser's own errors: a malformed body
        raise ProtocolError(f"DeepStack: a malformed multipart body ({exc})") from None
    return fields


def _min_confidence(fields: Mapping[str, bytes]) -> float:
    raw = fields.get("min_confidence")
    if raw is None:
        return DEFAULT_MIN_CONFIDENCE
    try:
        value = float(raw.decode("ascii", "replace").strip())
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ProtocolError(
            f"DeepStack: min_confidence must be a number from 0 to 1, got {raw[:20]!r}"
        )
    return value


class DeepStackRoutes:
    """A mixin of `edged.serving.api.Api`, which holds the state below."""

    inference: Inference
    max_body_bytes: int

    def _detector_named(self, name: str | None) -> str:
        """The served detector for the route: by name or `serves_as` name; None: the first."""
        for model_name, served in self.inference.models().items():
            detects = served.pictures is not None and served.pictures.detector is not None
            if detects and (name is None or name == model_name or name in served.serves_as):
                return model_name
        if name is None:
            raise RequestError(404, "DeepStack: no model is a detector ([models.detector])")
        raise RequestError(404, f"DeepStack: no detector model {name!r}")

    async def _deepstack(self, scope, receive, send, path: str) -> None:
        start = time.perf_counter()
        try:
            if path.rstrip("/") == "/v1/vision/detection":
                name = self._detector_named(None)
            elif path.startswith("/v1/vision/custom/") and path.count("/") == 4:
                name = self._detector_named(path.rsplit("/", 1)[1])
            else:
                raise RequestError(404, f"no route {path}")
            predictions = await self._detect(scope, receive, name)
        except RequestError as exc:
            body = {"success": False, "error": str(exc)}
            await send_json(send, exc.status, body, exc.retry_after)
            return
        if predictions is None:
            return  # the client went away
        body, answer = predictions
        body["duration"] = round((time.perf_counter() - start) * 1e3, 3)
        await send_json(send, 200, body)
        answer.sent()

    async def _detect(self, scope, receive, name: str):
        headers = dict(scope["headers"])
        inference = self.inference
        state: dict[str, Any] = {}

        def model() -> ServedModel:
            served = inference.model(name)
            if served.pictures is None or served.pictures.detector is None:
                raise RequestError(404, f"DeepStack: no detector model {name!r}")
            return served

        async def read(served: ServedModel) -> bytes | bytearray:
            body = await read_body(headers, receive, self.max_body_bytes)
            if body is None:
                raise ClientGone(408 if scope.get(BODY_TIMED_OUT) else 0)
            return body

        def prepare(body: bytes | bytearray, pictures: Pictures) -> np.ndarray:
            fields = form_fields(body, headers.get(b"content-type", b""))
            image = fields.get("image")
            if not image:
                raise ProtocolError("DeepStack: no 'image' field in the form")
            state["min_confidence"] = _min_confidence(fields)
            try:
                x, state["fit"], state["size"] = pictures.to_tensor(image, "DeepStack: image")
            except ImageError as exc:
                raise ProtocolError(str(exc)) from None
            return x

        async def decode(body: bytes | bytearray, served: ServedModel) -> InferRequest:
            pictures = served.pictures
            assert pictures is not None
            state["pictures"] = pictures
            x = await asyncio.to_thread(prepare, body, pictures)
            return InferRequest(None, {pictures.input.name: x})

        async def encode(request: InferRequest, outputs: Mapping[str, np.ndarray]) -> dict:
            pictures: Pictures = state["pictures"]
            fitted: Fit = state["fit"]
            dets = await asyncio.to_thread(
                pictures.detections, outputs, fitted, state["min_confidence"]
            )
            assert pictures.detector is not None
            height, width = state["size"]
            labels = pictures.detector.label_names
            return {
                "success": True,
                "predictions": deepstack_predictions(dets, labels, width, height),
            }

        traceparent = dict(scope["headers"]).get(b"traceparent")
        answer = await inference.infer(
            name, model, read, decode, encode, request_peer(scope), "HTTP", traceparent
        )
        if answer is None:
            return None
        return answer.payload, answer
