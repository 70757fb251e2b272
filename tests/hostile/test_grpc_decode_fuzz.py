"""Property-based fuzzing of the gRPC inference request decoder, in process: whatever a client
puts in a ModelInferRequest (datatypes known and not, shapes negative, empty or of 2^40
elements, typed contents of the wrong field or count, raw contents of any length, shared
memory parameters of any type, timeouts of any sign), decoding either gives a request whose
tensors match what it declared, or raises the errors the service answers INVALID_ARGUMENT
(ProtocolError, InputError) or with their status (RequestError): never another exception,
and never memory in proportion to a declared shape rather than to the bytes sent.

Bytes that are no ModelInferRequest at all are tests/serving/test_grpc.py's; the HTTP decoders are
fuzzed in tests/serving/test_protocol.py."""

from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.errors import InputError
from edged.serving.grpc_codec import decode_infer_request, parse_message
from edged.serving.grpc_messages import ModelInferRequest
from edged.serving.inference import RequestError
from edged.serving.protocol import ProtocolError

pytestmark = [pytest.mark.slow]

DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT64", "FP16", "FP32"]
DATATYPES += ["FP64", "BYTES", "BF16", "fp32", "", "FP8", "INT128", "\x00"]
TYPED_FIELDS = [
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
]
SHM_KEYS = ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"]

dims = st.one_of(st.integers(-3, 8), st.sampled_from([2**31, 2**40, 2**62, -(2**63), 2**63 - 1]))
shapes = st.lists(dims, max_size=5)
parameter = st.one_of(
    st.tuples(st.just("int64_param"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("uint64_param"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(st.just("string_param"), st.text(max_size=20)),
    st.tuples(st.just("double_param"), st.floats(allow_nan=True)),
    st.just(None),  # present, no value chosen
)
parameters = st.dictionaries(
    st.sampled_from([*SHM_KEYS, "timeout", "priority", "x"]), parameter, max_size=3
)
typed_values = st.one_of(
    st.tuples(st.just("bool_contents"), st.lists(st.booleans(), max_size=20)),
    st.tuples(
        st.sampled_from(["int_contents", "uint_contents"]),
        st.lists(st.integers(0, 2**31 - 1), max_size=20),
    ),
    st.tuples(
        st.sampled_from(["int64_contents", "uint64_contents"]),
        st.lists(st.integers(0, 2**63 - 1), max_size=20),
    ),
    st.tuples(
        st.sampled_from(["fp32_contents", "fp64_contents"]),
        st.lists(st.floats(allow_nan=True, width=32), max_size=20),
    ),
    st.tuples(st.just("bytes_contents"), st.lists(st.binary(max_size=8), max_size=20)),
)
tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["x", "y", "", "x\x00", "é" * 3]),
        "datatype": st.sampled_from(DATATYPES),
        "shape": shapes,
        "parameters": parameters,
        "typed": st.lists(typed_values, max_size=2),
    }
)
requests = st.fixed_dictionaries(
    {
        "inputs": st.lists(tensors, max_size=3),
        "raw": st.one_of(st.none(), st.lists(st.binary(max_size=64), max_size=4)),
        "outputs": st.lists(st.tuples(st.sampled_from(["y", "", "z"]), parameters), max_size=3),
        "parameters": parameters,
        "id": st.text(max_size=10),
    }
)


def _set(params, values: dict) -> None:
    for key, value in values.items():
        entry = params[key]  # the map makes the entry even when no value is chosen
        if value is not None:
            setattr(entry, value[0], value[1])


def build(spec: dict) -> ModelInferRequest:
    request = ModelInferRequest(model_name="m", id=spec["id"])
    for t in spec["inputs"]:
        tensor = request.inputs.add(name=t["name"], datatype=t["datatype"])
        tensor.shape.extend(d for d in t["shape"] if -(2**63) <= d < 2**63)
        _set(tensor.parameters, t["parameters"])
        for field, values in t["typed"]:
            getattr(tensor.contents, field).extend(values)
    if spec["raw"] is not None:
        request.raw_input_contents.extend(spec["raw"])
    for name, params in spec["outputs"]:
        _set(request.outputs.add(name=name).parameters, params)
    _set(request.parameters, spec["parameters"])
    return request


@settings(
    max_examples=600,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=requests, remaining=st.one_of(st.none(), st.floats(-1, 100)))
def test_any_infer_request_decodes_or_is_refused_in_the_protocols_terms(spec, remaining):
    request = build(spec)
    wire = request.SerializeToString()
    parsed = parse_message(ModelInferRequest, wire)  # as the service gets it: from the wire
    tracemalloc.start()
    try:
        decoded = decode_infer_request(parsed, remaining)
    except (ProtocolError, InputError) as exc:
        assert str(exc), "an error with no message"
        return
    except RequestError as exc:
        assert 400 <= exc.status < 600 and str(exc)
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # Decoded: the memory is the bytes sent, give or take, never a declared shape's.
    assert peak < 1_000_000 + 64 * len(wire), f"peak {peak} bytes from a {len(wire)}-byte request"
    by_name = {t.name: t for t in parsed.inputs}
    for name, array in decoded.inputs.items():
        assert isinstance(array, np.ndarray)
        assert list(array.shape) == list(by_name[name].shape)
    for name, (_dtype, shape, _ref) in decoded.shm_inputs.items():
        assert list(shape) == list(by_name[name].shape)
    assert decoded.timeout_ms is None or decoded.timeout_ms > 0


@settings(max_examples=400, deadline=None)
@given(wire=st.binary(max_size=512))
def test_any_bytes_parse_or_are_a_400(wire):
    try:
        parsed = parse_message(ModelInferRequest, wire)
    except RequestError as exc:
        assert exc.status == 400 and "malformed ModelInferRequest" in str(exc)
        return
    with contextlib.suppress(ProtocolError, InputError, RequestError):
        decode_infer_request(parsed, None)
