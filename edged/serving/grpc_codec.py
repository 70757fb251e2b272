"""The gRPC front end's messages to and from edged's requests: a ModelInferRequest decoded to
an InferRequest (tensors from typed contents, raw contents or shared memory, the parameters
Triton's clients send), an answer encoded as a ModelInferResponse with the tensors written
once into raw_output_contents, and a served model's ModelConfigResponse. Pure functions of
the messages; the RPCs are edged.serving.grpc_server's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from edged.serving import bytes_tensors
from edged.serving.grpc_messages import (
    ModelConfigResponse,
    ModelInferResponse,
)
from edged.serving.inference import (
    VERSION,
    RequestError,
)
from edged.serving.models import ServedModel
from edged.serving.protocol import (
    DATATYPES,
    SHM_PARAMETERS,
    TYPED_FIELDS,
    InferRequest,
    ProtocolError,
    datatype_of,
    dtype_and_shape,
    image_format,
    postprocess_of,
    shm_ref,
    tensor_from_bytes,
    tensor_from_values,
)
from edged.serving.responses import datatype_of_dtype, little_endian

# -- requests and responses -----------------------------------------------------------------------
# Typed contents of this many values are decoded in a thread (Inference.offload), as large
# JSON is on HTTP: numpy reads a protobuf value list one value at a time.
OFFLOAD_VALUES = 128 * 1024


def decode_infer_request(request: Message, remaining_s: float | None) -> InferRequest:
    """A ModelInferRequest as the engine's request: tensors from raw_input_contents (one
    entry per input, in input order) or from typed contents; the requested outputs; the
    deadline from the `timeout` parameter (µs) and the call's own deadline, whichever is
    sooner."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise ProtocolError("request has no inputs")
    refs = [shm_ref(_values(t.parameters), f"inputs[{i}]") for i, t in enumerate(request.inputs)]
    in_request = sum(ref is None for ref in refs)  # the rest are in shared memory
    if raw and len(raw) != in_request:
        raise ProtocolError(
            f"raw_input_contents has {len(raw)} entries for {in_request} inputs "
            f"(one per input not in shared memory, in input order)"
        )
    inputs: dict[str, np.ndarray] = {}
    shm_inputs = {}
    frames: dict[str, str] = {}
    entry = 0
    for index, (tensor, ref) in enumerate(zip(request.inputs, refs, strict=True)):
        where, name = f"inputs[{index}]", tensor.name
        if name in inputs or name in shm_inputs:
            raise ProtocolError(f"{where}: input {name!r} given twice")
        if ref is not None:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input {name!r} is in shared memory and has contents too")
            dtype, dims = dtype_and_shape(tensor.datatype, tensor.shape, where)
            shm_inputs[name] = (dtype, dims, ref)
            continue
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(
                    f"input {name!r} has contents and raw_input_contents: give one of them"
                )
            if tensor.datatype == bytes_tensors.BYTES:
                array = _bytes_tensor(tensor, raw[entry], where)
            else:
                array = tensor_from_bytes(name, tensor.datatype, tensor.shape, raw[entry], where)
            entry += 1
        elif tensor.datatype == bytes_tensors.BYTES:
            array = _bytes_tensor(tensor, None, where)
        else:
            array = _typed_tensor(tensor, where)
        inputs[name] = array
        if tensor.parameters and "image_format" in tensor.parameters:
            layout = _string(tensor.parameters, "image_format")
            frames[name] = image_format(layout, array.dtype, f"{where}.parameters")
    outputs = {}
    shm_outputs = {}
    for index, out in enumerate(request.outputs):
        ref = shm_ref(_values(out.parameters), f"outputs[{index}]")
        if ref is not None:
            shm_outputs[out.name] = ref
        else:
            outputs[out.name] = True  # always raw_output_contents, as Triton sends them
    timeout_ms = _timeout_ms(request.parameters)
    if remaining_s is not None:
        if remaining_s <= 0:
            raise RequestError(504, "the call's deadline passed before the request was queued")
        timeout_ms = min(timeout_ms or math.inf, remaining_s * 1000.0)
    return InferRequest(
        id=request.id or None,
        inputs=inputs,
        binary_outputs=outputs,
        binary_default=True,
        timeout_ms=timeout_ms,
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
        frames=frames,
        postprocess=postprocess_of(
            _string(request.parameters, "postprocess"), "parameters.postprocess"
        ),
    )


def _values(parameters: Mapping[str, Message]) -> dict[str, Any]:
    """The shared-memory parameters as plain values (whichever oneof field holds each;
    tritonclient sends int64_param)."""
    values: dict[str, Any] = {}
    if not parameters:  # the common case, and a map lookup per key costs
        return values
    for key in SHM_PARAMETERS:
        if key in parameters:
            param = parameters[key]
            choice = param.WhichOneof("parameter_choice")
            values[key] = getattr(param, choice) if choice is not None else None
    return values


def _bytes_tensor(tensor: Message, raw: bytes | None, where: str) -> np.ndarray:
    """A BYTES input (pictures): its raw entry (4-byte length-prefixed elements, as
    tritonclient sends them), else contents.bytes_contents."""
    name = tensor.name
    _, dims = dtype_and_shape("UINT8", tensor.shape, where)  # the shape's own checks
    try:
        if raw is not None:
            return bytes_tensors.from_length_prefixed(raw, dims, name)
        given = [f.name for f, _ in tensor.contents.ListFields()]
        if any(g != "bytes_contents" for g in given):
            raise ProtocolError(f"input {name!r}: BYTES values go in contents.bytes_contents")
        elements = list(tensor.contents.bytes_contents)
        if len(elements) != math.prod(dims):
            raise ProtocolError(
                f"input {name!r}: {len(elements)} BYTES element(s), its shape {list(dims)} "
                f"needs {math.prod(dims)}"
            )
        return bytes_tensors.from_elements(elements, dims)
    except bytes_tensors.BytesError as exc:
        raise ProtocolError(str(exc)) from None


def _typed_tensor(tensor: Message, where: str) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = TYPED_FIELDS.get(datatype, ("",))[0]
    given = [f.name for f, _ in tensor.contents.ListFields()]
    other = next((g for g in given if g != field), None)
    if other is not None and datatype in DATATYPES:  # (an unknown datatype: its own error)
        expected = f"contents.{field}" if field else "raw_input_contents"
        raise ProtocolError(f"input {name!r}: {datatype} values go in {expected}, not {other}")
    values = getattr(tensor.contents, field) if field else ()
    return tensor_from_values(name, datatype, tensor.shape, values, where)


def typed_value_count(request: Message) -> int:
    return sum(len(values) for t in request.inputs for _, values in t.contents.ListFields())


def _string(parameters: Mapping[str, Message], key: str) -> Any:
    """A request parameter's value, whichever field holds it; None when absent."""
    if key not in parameters:
        return None
    param = parameters[key]
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice is not None else None


def _timeout_ms(parameters: Mapping[str, Message]) -> float | None:
    if "timeout" not in parameters:
        return None
    param = parameters["timeout"]
    choice = param.WhichOneof("parameter_choice")
    value = getattr(param, choice) if choice in ("int64_param", "uint64_param") else None
    if value is None or value <= 0:
        raise ProtocolError("parameters.timeout must be a positive int64_param (microseconds)")
    return value / 1000.0  # the protocol's timeout is in microseconds; edged's in ms


def encode_infer_response(
    model_name: str, request: InferRequest, outputs: Mapping[str, np.ndarray]
) -> bytes:
    """A serialized ModelInferResponse: the requested outputs (all when none is named) in
    raw_output_contents."""
    named = request.binary_outputs or request.shm_outputs
    wanted = list(request.binary_outputs) if named else list(outputs)
    unknown = [name for name in wanted if name not in outputs]
    if unknown:
        raise ProtocolError(f"unknown output {unknown[0]!r}; outputs are {sorted(outputs)}")
    response = ModelInferResponse(model_name=model_name, model_version=VERSION)
    if request.id is not None:
        response.id = request.id
    data = []
    for name in wanted:
        array = np.asarray(outputs[name])
        response.outputs.add(name=name, datatype=datatype_of_dtype(array.dtype), shape=array.shape)
        data.append(little_endian(array).reshape(-1).view(np.uint8))
    # Outputs written to shared memory: name, datatype and shape, and an empty entry in
    # raw_output_contents, as Triton's gRPC server answers. Triton's C++ client reads
    # raw_output_contents[i] for the i-th output with no bounds check, so an output with
    # no entry crashes it; every client finds an output's data by that index.
    for entry in request.shm_results.values():
        out = response.outputs.add(name=entry["name"], datatype=entry["datatype"])
        out.shape.extend(entry["shape"])
        data.append(_NO_DATA)
    return response.SerializeToString() + _raw_outputs(data)


_NO_DATA = np.empty(0, np.uint8)


def _raw_outputs(arrays: list[np.ndarray]) -> bytes:
    """raw_output_contents (field 6) written after the rest of the message: the wire format
    of a repeated bytes field is each value as key, length, bytes, and a message's fields may
    come in any order. So each tensor is copied once, into the response, instead of into a
    protobuf bytes field and again into the serialized message."""
    parts: list[Any] = []
    for array in arrays:
        parts += [key_and_length(6, array.nbytes), array.data]  # the array's buffer, not a copy
    return b"".join(parts)


def key_and_length(number: int, length: int) -> bytes:
    out = bytearray([number << 3 | 2])  # wire type 2: length-delimited
    while True:
        byte, length = length & 0x7F, length >> 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def model_config(served: ServedModel) -> Message:
    """Triton's ModelConfig of a served model. Triton's convention for the dims: a model that
    batches (max_batch_size > 0) leaves the batch dim out of them."""
    worker = served.worker
    batch = worker.batching.max_batch_size if worker.batchable else 0

    def tensors(specs) -> list[dict[str, Any]]:
        return [
            {
                "name": s.name,
                "data_type": f"TYPE_{datatype_of(s.dtype)}",
                "dims": [-1 if d is None else d for d in s.shape][1 if batch else 0 :],
            }
            for s in specs
        ]

    config: dict[str, Any] = {
        "name": served.name,
        "platform": served.platform,
        "backend": worker.session.candidate.backend,
        "max_batch_size": batch,
        "input": tensors(served.session.inputs),
        "output": tensors(served.session.outputs),
    }
    if batch:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(worker.batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": worker.batching.max_queue_delay_us,
        }
    return json_format.ParseDict({"config": config}, ModelConfigResponse())


def parse_message(cls: type[Message], raw: bytes) -> Message:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise RequestError(400, f"malformed {cls.DESCRIPTOR.name}: {exc}") from None
