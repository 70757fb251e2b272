"""edged.serving.protocol against the bytes an unmodified tritonclient sends and parses, every
malformed request, and fuzzing (raw bytes and near-valid documents)."""

from __future__ import annotations

import contextlib
import json
import math
import tracemalloc
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.http._utils import _get_inference_request

from backends.tensors import TensorSpec
from edged.serving.protocol import DATATYPES, InferRequest, ProtocolError, decode_request
from edged.serving.responses import encode_response

# Any numpy warning (overflow in a cast or a reduce, invalid value) is a failure here.
pytestmark = pytest.mark.filterwarnings("error")

SPECS = [TensorSpec("x", "float32", (1, 4))]
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ---------------------------------------------------------------------------------


def triton_body(
    inputs,
    outputs=None,
    request_id: str = "",
    timeout: int | None = None,
    parameters: dict | None = None,
) -> tuple[bytes, int | None]:
    """The exact body and Inference-Header-Content-Length tritonclient's infer() sends."""
    return _get_inference_request(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=timeout,
        custom_parameters=parameters,
    )


def triton_input(name: str, array: np.ndarray, binary: bool) -> httpclient.InferInput:
    datatype = httpclient.np_to_triton_dtype(array.dtype)
    return httpclient.InferInput(name, list(array.shape), datatype).set_data_from_numpy(
        array, binary_data=binary
    )


def parse_response(body: bytes, header_length: int | None) -> httpclient.InferResult:
    return httpclient.InferResult.from_response_body(body, header_length=header_length)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, shape and values; floats bit-for-bit except NaN payloads (JSON has one)."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("="), (got.dtype, want.dtype)
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        bits = np.dtype(f"u{want.dtype.itemsize}")
        np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))
    else:
        np.testing.assert_array_equal(got, want)


def sample(datatype: str, shape: tuple[int, ...] = (2, 3), seed: int = 0) -> np.ndarray:
    """Values spanning the datatype's range, extremes and float specials included."""
    dtype = DATATYPES[datatype]
    rng = np.random.default_rng(seed)
    count = math.prod(shape)
    if dtype.kind == "b":
        flat = rng.integers(0, 2, count).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        flat[:2] = [info.min, info.max][:count]
    else:
        info = np.finfo(dtype)
        flat = (rng.standard_normal(count) * 1000).astype(dtype)
        specials = np.array(
            [
                info.max,
                -info.max,
                info.tiny,
                info.smallest_subnormal,
                -0.0,
                np.inf,
                -np.inf,
                np.nan,
            ],
            dtype=dtype,
        )
        flat[: len(specials)] = specials[:count]
    return flat.reshape(shape)


def doc(*inputs: dict, **extra: Any) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def fp32(name: str = "a", shape: Any = (2, 2), data: Any = None, **extra: Any) -> dict:
    item = {
        "name": name,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "datatype": "FP32",
    }
    if data is None and isinstance(shape, tuple):
        data = list(range(math.prod(shape)))
    if data is not None:
        item["data"] = data
    return {**item, **extra}


def binary_doc(items: list[tuple[dict, bytes]], **extra: Any) -> tuple[bytes, int]:
    header = json.dumps({"inputs": [item for item, _ in items], **extra}).encode()
    return header + b"".join(data for _, data in items), len(header)


def check_valid(request: InferRequest) -> None:
    """What a successfully decoded request must look like, whatever went in."""
    assert isinstance(request, InferRequest)
    assert request.id is None or isinstance(request.id, str)
    assert request.inputs
    for name, array in request.inputs.items():
        assert isinstance(name, str)
        assert isinstance(array, np.ndarray)
        assert array.dtype in DATATYPES.values()
        assert array.size <= 2**31
    assert all(
        isinstance(k, str) and isinstance(v, bool) for k, v in request.binary_outputs.items()
    )
    assert isinstance(request.binary_default, bool)
    assert request.timeout_ms is None or 0 < request.timeout_ms < math.inf


# --- 1. round trips through tritonclient's own encoding ---------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_tritonclient_request_round_trip(datatype, binary):
    array = sample(datatype, (2, 5))
    body, header_length = triton_body([triton_input("in", array, binary)])
    assert (header_length is None) == (not binary)
    request = decode_request(body, header_length, SPECS)
    assert list(request.inputs) == ["in"]
    assert_same(request.inputs["in"], array)
    # No outputs named: tritonclient asks for every output in binary.
    assert request.binary_outputs == {} and request.binary_default is True


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 7)])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_scalar_and_empty_shapes(shape, binary):
    for datatype in DATATYPES:
        array = sample(datatype, shape)
        body, header_length = triton_body([triton_input("in", array, binary)])
        assert_same(decode_request(body, header_length, SPECS).inputs["in"], array)


def test_tritonclient_many_inputs_mixed_binary_and_json():
    arrays = {f"in_{dt.lower()}": sample(dt, (3, i + 1), seed=i) for i, dt in enumerate(DATATYPES)}
    inputs = [
        triton_input(name, array, binary=i % 3 != 1)
        for i, (name, array) in enumerate(arrays.items())
    ]
    body, header_length = triton_body(inputs, request_id="req-7", timeout=2_500_000)
    assert header_length is not None
    request = decode_request(body, header_length, SPECS)
    assert list(request.inputs) == list(arrays)  # input order kept
    for name, array in arrays.items():
        assert_same(request.inputs[name], array)
    assert request.id == "req-7"
    assert request.timeout_ms == 2500.0  # microseconds on the wire, milliseconds in edged


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_tritonclient_round_trip_property(data):
    arrays = []
    for _ in range(data.draw(st.integers(1, 4), label="inputs")):
        dtype = DATATYPES[data.draw(st.sampled_from(list(DATATYPES)))]
        shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        arrays.append(data.draw(hnp.arrays(dtype.newbyteorder("="), shape)))
    flags = [data.draw(st.booleans()) for _ in arrays]
    inputs = [
        triton_input(f"t{i}", a, b) for i, (a, b) in enumerate(zip(arrays, flags, strict=True))
    ]
    body, header_length = triton_body(inputs)
    request = decode_request(body, header_length, SPECS)
    for i, array in enumerate(arrays):
        assert_same(request.inputs[f"t{i}"], array)


def _response(request: InferRequest, outputs: dict[str, np.ndarray]):
    body, header_length = encode_response("m", request, outputs)
    return parse_response(body, header_length), body, header_length


OUTPUTS = {dt: sample(dt, (2, 3), seed=5) for dt in DATATYPES}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_response_round_trip_per_output_flags(binary):
    requested = [httpclient.InferRequestedOutput(dt, binary_data=binary) for dt in DATATYPES]
    body, header_length = triton_body(
        [triton_input("x", sample("FP32"), True)], requested, request_id="abc"
    )
    request = decode_request(body, header_length, SPECS)
    assert request.binary_outputs == dict.fromkeys(DATATYPES, binary)
    result, _, header_length = _response(request, OUTPUTS)
    assert (header_length is None) == (not binary)
    assert result.get_response()["id"] == "abc"
    assert result.get_response()["model_name"] == "m"
    for name, array in OUTPUTS.items():
        assert_same(result.as_numpy(name), array)
        entry = result.get_output(name)
        assert entry["datatype"] == name
        assert ("data" in entry) == (not binary)
        assert ("binary_data_size" in entry.get("parameters", {})) == binary


def test_response_mixed_flags_and_subset_of_outputs():
    wanted = {"FP16": True, "INT8": False, "BOOL": True, "UINT64": False, "FP64": True}
    requested = [httpclient.InferRequestedOutput(n, binary_data=b) for n, b in wanted.items()]
    body, header_length = triton_body([triton_input("x", sample("FP32"), False)], requested)
    request = decode_request(body, header_length, SPECS)
    result, _, header_length = _response(request, OUTPUTS)
    assert header_length is not None
    assert [o["name"] for o in result.get_response()["outputs"]] == list(wanted)
    for name, binary in wanted.items():
        assert_same(result.as_numpy(name), OUTPUTS[name])
        assert ("data" in result.get_output(name)) == (not binary)
    assert result.as_numpy("FP32") is None  # not asked for, not sent


def test_response_all_outputs_binary_when_none_named():
    body, header_length = triton_body([triton_input("x", sample("FP32"), True)])
    result, _, header_length = _response(decode_request(body, header_length, SPECS), OUTPUTS)
    assert header_length is not None
    for name, array in OUTPUTS.items():
        assert "data" not in result.get_output(name)
        assert_same(result.as_numpy(name), array)


@pytest.mark.parametrize("default", [True, False])
def test_response_request_wide_binary_data_output(default):
    # binary_data_output is reserved in tritonclient, so this request is written by hand: the
    # request-wide default applies to outputs without their own binary_data flag.
    body = doc(
        fp32("x", (1, 4)),
        parameters={"binary_data_output": default},
        outputs=[
            {"name": "FP32"},
            {"name": "INT16", "parameters": {"binary_data": False}},
            {"name": "UINT8", "parameters": {"binary_data": True}},
        ],
    )
    request = decode_request(body, None, SPECS)
    assert request.binary_default is default
    assert request.binary_outputs == {"FP32": default, "INT16": False, "UINT8": True}
    result, _, _ = _response(request, OUTPUTS)
    for name in request.binary_outputs:
        assert_same(result.as_numpy(name), OUTPUTS[name])
    assert ("data" in result.get_output("FP32")) == (not default)
    # No outputs named at all: every model output, in the default encoding.
    request = decode_request(
        doc(fp32("x", (1, 4)), parameters={"binary_data_output": default}), None, SPECS
    )
    result, _, header_length = _response(request, OUTPUTS)
    assert (header_length is not None) == default
    for name, array in OUTPUTS.items():
        assert_same(result.as_numpy(name), array)


def test_response_scalar_empty_and_big_endian_outputs():
    outputs = {
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.int32),
        "be": np.arange(6, dtype=">i4").reshape(2, 3),
        "strided": np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],
    }
    for binary in (True, False):
        request = InferRequest(None, {}, binary_default=binary)
        result, _, _ = _response(request, outputs)
        for name, array in outputs.items():
            assert_same(result.as_numpy(name), array.astype(array.dtype.newbyteorder("=")))


def test_response_unknown_output_is_protocol_error():
    request = InferRequest(None, {}, binary_outputs={"nope": True})
    with pytest.raises(ProtocolError, match=r"unknown output 'nope'.*\['FP32'\]"):
        encode_response("m", request, {"FP32": OUTPUTS["FP32"]})


# --- 2. raw binary single input (header length 0) --------------------------------------------


def test_raw_binary_single_static_input():
    array = np.arange(4, dtype=np.float32).reshape(1, 4)
    request = decode_request(array.tobytes(), 0, SPECS)
    assert_same(request.inputs["x"], array)
    assert request.binary_default is True and request.id is None


def test_raw_binary_bool_bytes_become_canonical():
    request = decode_request(bytes([0, 1, 2, 255]), 0, [TensorSpec("b", "bool", (4,))])
    assert request.inputs["b"].view(np.uint8).tolist() == [0, 1, 1, 1]


def test_raw_binary_needs_single_input():
    specs = [TensorSpec("a", "float32", (2,)), TensorSpec("b", "float32", (2,))]
    with pytest.raises(ProtocolError, match="single-input model; this one has 2 inputs"):
        decode_request(bytes(16), 0, specs)


def test_raw_binary_needs_static_shape():
    with pytest.raises(ProtocolError, match=r"input 'x' has dynamic dims \[None, 4\]"):
        decode_request(bytes(16), 0, [TensorSpec("x", "float32", (None, 4))])


@pytest.mark.parametrize("size", [0, 15, 17, 32])
def test_raw_binary_wrong_size(size):
    with pytest.raises(ProtocolError, match=rf"body is {size} bytes, input 'x' needs 16"):
        decode_request(bytes(size), 0, SPECS)


# --- 3. malformed requests -------------------------------------------------------------------


def bin_item(name="a", datatype="FP32", shape=(2,), size=8, **extra) -> dict:
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(shape),
        "parameters": {"binary_data_size": size},
        **extra,
    }


MALFORMED = [
    # (id, body, header length, message regex)
    ("not-json", b"{inputs:", None, r"not valid JSON: Expecting"),
    ("not-utf8", b'{"inputs": "\xff"}', None, r"not valid JSON: 'utf-8' codec"),
    ("empty", b"", None, r"not valid JSON"),
    ("nested-too-deep", b"[" * 100_000, None, r"nested too deeply"),
    ("5000-digit-int", b'{"inputs": [' + b"1" * 5000 + b"]}", None, r"not valid JSON.*digits"),
    ("json-array", b"[1, 2]", None, r"request must be a JSON object"),
    ("json-string", b'"inputs"', None, r"request must be a JSON object"),
    ("no-inputs", b"{}", None, r"no 'inputs' list"),
    ("empty-inputs", doc(), None, r"no 'inputs' list"),
    ("inputs-object", b'{"inputs": {"name": "a"}}', None, r"no 'inputs' list"),
    ("input-not-object", doc(fp32(), 3), None, r"inputs\[1\] must be a JSON object"),
    (
        "no-name",
        doc({"shape": [1], "datatype": "FP32", "data": [1]}),
        None,
        r"inputs\[0\]\.name must be a string",
    ),
    ("name-number", doc(fp32(), fp32(name=5)), None, r"inputs\[1\]\.name must be a string"),
    (
        "no-shape",
        doc(fp32(), fp32("b", shape=None, data=[1])),
        None,
        r"inputs\[1\]\.shape must be a list of non-negative integers",
    ),
    (
        "no-datatype",
        doc({"name": "a", "shape": [1], "data": [1]}),
        None,
        r"inputs\[0\]\.datatype None is not supported \(one of BOOL, .*FP64\)",
    ),
    (
        "bytes",
        doc({"name": "a", "shape": [1], "datatype": "BYTES", "data": [1]}),
        None,
        r"input 'a': element 0 must be a string or \{\"b64\": \"...\"\}",
    ),
    (
        "datatype-lowercase",
        doc({"name": "a", "shape": [1], "datatype": "fp32", "data": [1]}),
        None,
        r"inputs\[0\]\.datatype 'fp32' is not supported",
    ),
    (
        "datatype-list",
        doc({"name": "a", "shape": [1], "datatype": ["FP32"], "data": [1]}),
        None,
        r"inputs\[0\]\.datatype \['FP32'\] is not supported",
    ),
    (
        "negative-dim",
        doc(fp32(), fp32("b", shape=[2, -1], data=[1, 2])),
        None,
        r"inputs\[1\]\.shape must be a list of non-negative integers, not \[2, -1\]",
    ),
    (
        "float-dim",
        doc(fp32(shape=[2.0], data=[1, 2])),
        None,
        r"inputs\[0\]\.shape must be a list of non-negative integers",
    ),
    (
        "bool-dim",
        doc(fp32(shape=[True], data=[1])),
        None,
        r"inputs\[0\]\.shape must be a list of non-negative integers",
    ),
    ("shape-string", doc(fp32(shape="2", data=[1, 2])), None, r"inputs\[0\]\.shape must be a list"),
    ("17-dims", doc(fp32(shape=[1] * 17, data=[1])), None, r"inputs\[0\]\.shape has 17 dims"),
    (
        "huge-shape",
        doc(fp32(shape=[2**40], data=[1])),
        None,
        r"inputs\[0\]\.shape \[1099511627776\] is too large",
    ),
    ("huge-product", doc(fp32(shape=[2**16, 2**16, 2], data=[1])), None, r"too large"),
    ("float-overflowing-shape", doc(fp32(shape=[10**300, 10**300], data=[1])), None, r"too large"),
    ("int64-overflowing-shape", doc(fp32(shape=[0, 2**63], data=[])), None, r"too large"),
    ("empty-but-huge-shape", doc(fp32(shape=[0, 2**62], data=[])), None, r"too large"),
    (
        "no-data",
        doc(fp32(shape=[1], data=None)),
        None,
        r"input 'a' has neither 'data' nor binary_data_size",
    ),
    (
        "too-few-values",
        doc(fp32(shape=[2, 2], data=[1, 2, 3])),
        None,
        r"input 'a': 3 values for shape \[2, 2\] \(4 expected\)",
    ),
    (
        "too-many-values",
        doc(fp32(shape=[1], data=[[1, 2]])),
        None,
        r"input 'a': 2 values for shape \[1\] \(1 expected\)",
    ),
    (
        "ragged",
        doc(fp32(shape=[3], data=[[1, 2], [3]])),
        None,
        r"input 'a': data is not a FP32 tensor \(.*inhomogeneous",
    ),
    (
        "null-value",
        doc(fp32(shape=[2], data=[1, None])),
        None,
        r"input 'a': data is not a FP32 tensor \(ragged, mixed",
    ),
    ("data-object", doc(fp32(shape=[1], data={"v": 1})), None, r"not a FP32 tensor"),
    (
        "data-too-deep",
        doc(fp32(shape=[1], data=json.loads("[" * 70 + "1" + "]" * 70))),
        None,
        r"not a FP32 tensor \(.*dimension",
    ),
    (
        "floats-for-int",
        doc({"name": "i", "shape": [2], "datatype": "INT32", "data": [1, 2.5]}),
        None,
        r"input 'i': data is not a INT32 tensor \(floats given for an integer datatype\)",
    ),
    (
        "strings-for-int",
        doc({"name": "i", "shape": [2], "datatype": "INT32", "data": ["1", "2"]}),
        None,
        r"input 'i'.*must be numbers",
    ),
    ("string-for-float", doc(fp32(shape=[], data="nan")), None, r"input 'a'.*must be numbers"),
    (
        "uint8-overflow",
        doc({"name": "u", "shape": [2], "datatype": "UINT8", "data": [1, 256]}),
        None,
        r"input 'u': data is not a UINT8 tensor \(values outside \[0, 255\]\)",
    ),
    (
        "uint-negative",
        doc({"name": "u", "shape": [1], "datatype": "UINT32", "data": [-1]}),
        None,
        r"input 'u'.*values outside \[0, 4294967295\]",
    ),
    (
        "int64-overflow",
        doc({"name": "i", "shape": [1], "datatype": "INT64", "data": [2**63]}),
        None,
        r"input 'i'.*values outside",
    ),
    (
        "uint64-overflow",
        doc({"name": "i", "shape": [1], "datatype": "UINT64", "data": [2**64]}),
        None,
        r"input 'i'.*values outside \[0, 18446744073709551615\]",
    ),
    (
        "fp16-overflow",
        doc({"name": "h", "shape": [1], "datatype": "FP16", "data": [70000.0]}),
        None,
        r"input 'h'.*too large for FP16",
    ),
    ("fp32-overflow", doc(fp32(shape=[1], data=[1e300])), None, r"input 'a'.*too large"),
    (
        "numbers-for-bool",
        doc({"name": "b", "shape": [2], "datatype": "BOOL", "data": [0, 2]}),
        None,
        r"input 'b'.*BOOL values must be true or false",
    ),
    (
        "bools-for-int",
        doc({"name": "i", "shape": [2], "datatype": "INT8", "data": [True, False]}),
        None,
        r"input 'i'.*true/false given",
    ),
    (
        "duplicate-name",
        doc(fp32("a"), fp32("b"), fp32("a")),
        None,
        r"inputs\[2\]: input 'a' given twice",
    ),
    (
        "input-parameters-list",
        doc(fp32(parameters=[])),
        None,
        r"inputs\[0\]\.parameters must be a JSON object",
    ),
    (
        "request-parameters-list",
        doc(fp32(), parameters=[1]),
        None,
        r"^parameters must be a JSON object",
    ),
    ("outputs-number", doc(fp32(), outputs=5), None, r"'outputs' must be a list"),
    ("outputs-object", doc(fp32(), outputs={"name": "y"}), None, r"'outputs' must be a list"),
    (
        "output-not-object",
        doc(fp32(), outputs=[{"name": "y"}, "z"]),
        None,
        r"outputs\[1\] must be a JSON object",
    ),
    (
        "output-no-name",
        doc(fp32(), outputs=[{"parameters": {}}]),
        None,
        r"outputs\[0\]\.name must be a string",
    ),
    (
        "output-parameters",
        doc(fp32(), outputs=[{"name": "y", "parameters": 1}]),
        None,
        r"outputs\[0\]\.parameters must be a JSON object",
    ),
    (
        "output-binary-data-string",
        doc(fp32(), outputs=[{"name": "y", "parameters": {"binary_data": "false"}}]),
        None,
        r"outputs\[0\]\.parameters\.binary_data must be true or false, not 'false'",
    ),
    (
        "binary-data-output-number",
        doc(fp32(), parameters={"binary_data_output": 1}),
        None,
        r"parameters\.binary_data_output must be true or false",
    ),
    ("timeout-zero", doc(fp32(), parameters={"timeout": 0}), None, r"parameters\.timeout"),
    (
        "timeout-negative",
        doc(fp32(), parameters={"timeout": -5.5}),
        None,
        r"parameters\.timeout must be a positive number \(microseconds\)",
    ),
    ("timeout-string", doc(fp32(), parameters={"timeout": "100"}), None, r"parameters\.timeout"),
    ("timeout-bool", doc(fp32(), parameters={"timeout": True}), None, r"parameters\.timeout"),
    (
        "timeout-nan",
        b'{"inputs": [' + json.dumps(fp32()).encode() + b'], "parameters": {"timeout": NaN}}',
        None,
        r"parameters\.timeout",
    ),
    (
        "timeout-infinity",
        doc(fp32(), parameters={"timeout": math.inf}),
        None,
        r"parameters\.timeout",
    ),
    (
        "timeout-past-float",
        doc(fp32(), parameters={"timeout": 10**400}),
        None,
        r"parameters\.timeout",
    ),
    # binary extension
    (
        "size-not-shape",
        *binary_doc([(bin_item(shape=(2, 2), size=12), bytes(12))]),
        r"input 'a': binary_data_size 12 does not match shape \[2, 2\] of FP32 \(16 bytes\)",
    ),
    (
        "size-not-itemsize",
        *binary_doc([(bin_item(datatype="FP64", size=8), bytes(8))]),
        r"input 'a': binary_data_size 8 does not match .* FP64 \(16 bytes\)",
    ),
    (
        "size-past-end",
        *binary_doc([(bin_item("a"), bytes(8)), (bin_item("b"), bytes(4))]),
        r"input 'b': binary_data_size 8 runs past the end of the body \(4 bytes left\)",
    ),
    (
        "huge-size-past-end",
        *binary_doc([(bin_item(shape=(2**40,), size=2**42), b"")]),
        r"too large",
    ),
    (
        "size-negative",
        *binary_doc([(bin_item(size=-8), b"")]),
        r"inputs\[0\]\.parameters\.binary_data_size must be a non-negative integer",
    ),
    (
        "size-float",
        *binary_doc([(bin_item(size=8.0), bytes(8))]),
        r"inputs\[0\]\.parameters\.binary_data_size must be a non-negative integer",
    ),
    (
        "size-bool",
        *binary_doc([(bin_item(shape=(1,), datatype="BOOL", size=True), b"\1")]),
        r"binary_data_size must be a non-negative integer",
    ),
    (
        "leftover-bytes",
        *binary_doc([(bin_item(), bytes(8)), (fp32("b"), bytes(3))]),
        r"3 bytes of binary data after the last input",
    ),
    (
        "binary-in-json-only-body",
        doc(bin_item()),
        None,
        r"input 'a': binary_data_size 8 runs past the end of the body \(0 bytes left\)",
    ),
    (
        "header-past-body",
        b'{"inputs": []}',
        15,
        r"Inference-Header-Content-Length 15 is "
        r"outside the 14-byte body",
    ),
    (
        "header-negative",
        b'{"inputs": []}',
        -1,
        r"Inference-Header-Content-Length -1 is "
        r"outside",
    ),
    (
        "header-cuts-json",
        *(lambda b, n: (b, n - 1))(*binary_doc([(bin_item(), bytes(8))])),
        r"not valid JSON",
    ),
]


@pytest.mark.parametrize(
    ("body", "header_length", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in MALFORMED],
)
def test_malformed_request(body, header_length, message):
    with pytest.raises(ProtocolError, match=message):
        decode_request(body, header_length, SPECS)


def test_binary_body_without_header_length_gets_a_hint():
    body, header_length = triton_body([triton_input("x", sample("FP32", (1, 4)), True)])
    assert header_length is not None
    with pytest.raises(ProtocolError, match=r"not valid JSON.*Inference-Header-Content-Length"):
        decode_request(body, None, SPECS)
    with pytest.raises(ProtocolError, match=r"not valid JSON.*Inference-Header-Content-Length"):
        decode_request(b"\x00\x00\x80?" * 4, None, SPECS)
    with pytest.raises(ProtocolError) as err:  # plain bad JSON: no misleading hint
        decode_request(b'{"inputs": [1,]}', None, SPECS)
    assert "Inference-Header-Content-Length" not in str(err.value)


@pytest.mark.parametrize(("timeout", "ms"), [(1, 0.001), (2_500_000, 2500.0), (1500.5, 1.5005)])
def test_timeout_microseconds_to_milliseconds(timeout, ms):
    request = decode_request(doc(fp32(), parameters={"timeout": timeout}), None, SPECS)
    assert request.timeout_ms == pytest.approx(ms)
    assert decode_request(doc(fp32()), None, SPECS).timeout_ms is None


def test_json_data_nested_or_flat_and_scalar():
    flat = decode_request(doc(fp32(shape=(2, 2), data=[1, 2, 3, 4])), None, SPECS)
    nested = decode_request(doc(fp32(shape=(2, 2), data=[[1, 2], [3, 4]])), None, SPECS)
    assert_same(flat.inputs["a"], np.array([[1, 2], [3, 4]], np.float32))
    assert_same(nested.inputs["a"], flat.inputs["a"])
    scalar = decode_request(doc(fp32(shape=(), data=1.5)), None, SPECS)
    assert_same(scalar.inputs["a"], np.array(1.5, np.float32))
    empty = decode_request(
        doc({"name": "e", "shape": [0, 3], "datatype": "INT8", "data": []}), None, SPECS
    )
    assert_same(empty.inputs["e"], np.zeros((0, 3), np.int8))


def test_binary_bool_bytes_become_canonical():
    body, header_length = binary_doc(
        [(bin_item(datatype="BOOL", shape=(4,), size=4), bytes([0, 1, 2, 255]))]
    )
    array = decode_request(body, header_length, SPECS).inputs["a"]
    assert array.view(np.uint8).tolist() == [0, 1, 1, 1]


def test_huge_declared_shape_is_rejected_without_allocating():
    cases = [
        (doc(fp32(shape=[2**40], data=[1.0])), None),
        (doc(fp32(shape=[2**31 + 1], data=[1.0])), None),
        binary_doc([(bin_item(shape=(2**40,), size=2**42), bytes(16))]),
        binary_doc([(bin_item(datatype="FP64", shape=(2**31,), size=2**34), bytes(16))]),
    ]
    tracemalloc.start()
    try:
        for body, header_length in cases:
            with pytest.raises(ProtocolError):
                decode_request(body, header_length, SPECS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- 4. fuzzing ------------------------------------------------------------------------------

SPEC_LISTS = [
    SPECS,
    [TensorSpec("u", "uint8", (2, 2))],
    [TensorSpec("b", "bool", (3,))],
    [TensorSpec("d", "float32", (None, 4))],
    [TensorSpec("a", "float32", (2,)), TensorSpec("b", "int64", (1,))],
]


def decode_or_protocol_error(
    body: bytes, header_length: int | None, specs=SPECS
) -> InferRequest | None:
    try:
        request = decode_request(body, header_length, specs)
    except ProtocolError as exc:
        assert str(exc)
        event("rejected")
        return None
    check_valid(request)
    event("decoded")
    return request


json_prefix = st.sampled_from(
    [
        b"",
        b"{",
        b"[" * 3000,
        b'{"inputs": [',
        b'{"inputs": [{"name": "a", ',
        b'{"inputs": [{"name": "a", "shape": [2], "datatype": ',
        b'{"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": ',
        b'{"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", '
        b'"parameters": {"binary_data_size": 8}}]}',
    ]
)


@FUZZ
@given(
    prefix=json_prefix,
    tail=st.binary(max_size=200),
    specs=st.sampled_from(SPEC_LISTS),
    data=st.data(),
)
def test_fuzz_arbitrary_bytes(prefix, tail, specs, data):
    header_length = data.draw(
        st.none() | st.integers(-3, 260) | st.sampled_from([len(prefix), 0, 2**63, -(2**63)]),
        label="header_length",
    )
    decode_or_protocol_error(prefix + tail, header_length, specs)


huge_ints = st.sampled_from(
    [2**31, 2**31 + 1, 2**32, 2**40, 2**53 + 1, 2**62, 2**63, 2**64, 10**30, 10**400, -1, -(2**63)]
)
junk = (
    st.none()
    | st.booleans()
    | st.text(max_size=3)
    | st.floats()
    | huge_ints
    | st.lists(st.integers(-2, 2), max_size=2)
    | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)
)
bad_datatypes = st.sampled_from(["BYTES", "BF16", "fp32", "", "FP8", "INT4"]) | junk
bad_shapes = (
    st.lists(
        st.integers(0, 4) | huge_ints | st.floats(0, 4) | st.booleans(), min_size=1, max_size=20
    )
    | junk
)
scalars = (
    st.integers(-5, 300)
    | st.integers()
    | huge_ints
    | st.floats()
    | st.booleans()
    | st.none()
    | st.text(max_size=2)
)


class Fuzzer:
    """Draws a near-valid request. `chaos` (drawn once per request) is the chance that any one
    field is broken: absent, junk, or off by a little; 0 gives valid requests."""

    def __init__(self, draw, chaos: int):
        self.draw, self.chaos = draw, chaos

    def broken(self) -> bool:
        return bool(self.chaos) and self.draw(st.integers(0, 100)) < self.chaos

    def field(self, target: dict, key: str, value: Any, bad: st.SearchStrategy = junk) -> None:
        if not self.broken():
            target[key] = value
        elif self.draw(st.booleans()):
            target[key] = self.draw(bad)  # else: absent

    def pick(self, good: Any, *bad: Any) -> Any:
        return self.draw(st.sampled_from(bad)) if bad and self.broken() else good

    def input(self, index: int) -> tuple[dict, bytes]:
        """One input and its binary bytes (empty when sent as JSON data)."""
        draw = self.draw
        datatype = draw(st.sampled_from(list(DATATYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        count = math.prod(shape)
        item: dict[str, Any] = {}
        self.field(item, "name", self.pick(f"in{index}", "in0", "", "x"))
        self.field(item, "shape", shape, bad_shapes)
        self.field(item, "datatype", datatype, bad_datatypes)
        dtype = DATATYPES[datatype]
        if draw(st.booleans()):  # binary
            size = count * dtype.itemsize
            item["parameters"] = {}
            self.field(
                item["parameters"],
                "binary_data_size",
                self.pick(size, size + 1, max(size - 1, 0), 0, 2**40),
            )
            length = self.pick(size, size + 3, max(size - 2, 0), 0)
            return item, draw(st.binary(min_size=length, max_size=length))
        if self.broken():
            values = draw(st.recursive(scalars, lambda c: st.lists(c, max_size=4), max_leaves=12))
        else:
            values = draw(hnp.arrays(dtype.newbyteorder("="), count)).tolist()
            values = self.pick(
                values, values[:-1], [*values, *values[:1]], [*values[:-1], draw(scalars)]
            )
            if len(shape) > 1 and len(values) == count and draw(st.booleans()):
                values = np.array(values, dtype=object).reshape(shape).tolist()  # nested
        self.field(item, "data", values)
        if self.broken():
            item["parameters"] = self.pick({}, {"binary_data_size": draw(junk)}, [], None)
        return item, b""

    def request(self) -> tuple[bytes, int | None]:
        draw = self.draw
        items = [self.input(i) for i in range(draw(st.integers(1, 3)))]
        document: dict[str, Any] = {}
        self.field(document, "inputs", [item for item, _ in items])
        if draw(st.booleans()):
            self.field(document, "id", draw(st.text(max_size=5)))
        parameters: dict[str, Any] = {}
        if draw(st.booleans()):
            self.field(parameters, "binary_data_output", draw(st.booleans()))
        if draw(st.booleans()):
            self.field(parameters, "timeout", draw(st.integers(1, 10**7) | st.floats(0.5, 1e9)))
        self.field(document, "parameters", parameters)
        outputs = []
        for _ in range(draw(st.integers(0, 3))):
            out: dict[str, Any] = {"parameters": {}}
            self.field(out, "name", draw(st.sampled_from(["in0", "in1", "in2", "y"])))
            self.field(out["parameters"], "binary_data", draw(st.booleans()))
            outputs.append(out)
        if outputs or self.broken():
            self.field(document, "outputs", outputs)
        header = json.dumps(document).encode()
        body = header + b"".join(data for _, data in items)
        if self.broken():
            body += draw(st.binary(min_size=1, max_size=8))
        binary = any(data for _, data in items) or draw(st.booleans())
        header_length = len(header) if binary else None
        header_length = self.pick(
            header_length, None, len(header) - 1, len(header) + 1, len(body), len(body) + 1, 0
        )
        return body, header_length


@st.composite
def fuzz_request(draw) -> tuple[bytes, int | None]:
    chaos = draw(st.sampled_from([0, 3, 10, 30]))
    return Fuzzer(draw, chaos).request()


@FUZZ
@given(fuzz_request())
def test_fuzz_near_valid_requests(case):
    body, header_length = case
    request = decode_or_protocol_error(body, header_length)
    if request is None:
        return
    # Whatever decoded must also encode (echoing the inputs as outputs) and parse back.
    outputs = request.inputs
    try:
        response, response_length = encode_response("echo", request, outputs)
    except ProtocolError as exc:
        assert "unknown output" in str(exc)
        return
    result = parse_response(response, response_length)
    for name in request.binary_outputs or outputs:
        assert_same(result.as_numpy(name), outputs[name])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_fuzz_valid_json_requests_decode(data):
    """The near-valid generator's valid corner: correct requests always decode exactly."""
    arrays = {}
    items = []
    for i in range(data.draw(st.integers(1, 3))):
        datatype = data.draw(st.sampled_from(list(DATATYPES)))
        shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
        array = data.draw(hnp.arrays(DATATYPES[datatype].newbyteorder("="), shape))
        arrays[f"in{i}"] = array
        items.append(
            {
                "name": f"in{i}",
                "shape": list(shape),
                "datatype": datatype,
                "data": array.ravel().tolist(),
            }
        )
    request = decode_request(doc(*items), None, SPECS)
    for name, array in arrays.items():
        assert_same(request.inputs[name], array)


def test_large_json_tensors_take_the_fast_parser_and_keep_nan() -> None:
    """Over FAST_JSON_BYTES the header goes through orjson; NaN (which orjson refuses and
    Python's json, hence tritonclient, writes) falls back to the standard library."""
    from edged.serving.protocol import FAST_JSON_BYTES

    values = np.linspace(-1, 1, 20000, dtype=np.float32)
    values[7] = np.nan
    doc = {"inputs": [{"name": "x", "shape": [20000], "datatype": "FP32", "data": values.tolist()}]}
    body = json.dumps(doc).encode()
    assert len(body) > FAST_JSON_BYTES and b"NaN" in body
    spec = [TensorSpec("x", "float32", (20000,))]
    decoded = decode_request(body, None, spec).inputs["x"]
    assert np.array_equal(decoded, values, equal_nan=True)
    values[7] = 0.5
    doc["inputs"][0]["data"] = values.tolist()
    body = json.dumps(doc).encode()
    assert np.array_equal(decode_request(body, None, spec).inputs["x"], values)


def _binary(x: np.ndarray, name: str = "x", pad: int = 0, **params: Any) -> tuple[bytes, int]:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": params,
            "id": "p" * pad,
        }
    ).encode()
    return head + x.tobytes(), len(head)


def test_a_remembered_header_decodes_each_bodys_own_data() -> None:
    """The header cache: the same header bytes with other tensor bytes give those bytes."""
    for value in (1.0, 2.0, 3.0):
        body, length = _binary(np.full((1, 4), value, np.float32))
        request = decode_request(body, length, SPECS)
        np.testing.assert_array_equal(request.inputs["x"], np.full((1, 4), value))


def test_a_remembered_header_with_the_wrong_binary_size_gets_the_full_check() -> None:
    body, length = _binary(np.zeros((1, 4), np.float32))
    decode_request(body, length, SPECS)  # remembered
    with pytest.raises(ProtocolError, match="bytes of binary data after the last"):
        decode_request(body + bytes(4), length, SPECS)
    with pytest.raises(ProtocolError):
        decode_request(body[:-4], length, SPECS)


def test_the_header_cache_is_bounded_and_long_headers_decode() -> None:
    from edged.serving import protocol

    for timeout in range(1, protocol.CACHED_HEADERS + 40):
        body, length = _binary(np.zeros((1, 4), np.float32), timeout=timeout)
        assert decode_request(body, length, SPECS).timeout_ms == timeout / 1000.0
    assert len(protocol._LAYOUTS) <= protocol.CACHED_HEADERS
    # A header longer than what is remembered takes the full path every time.
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    body, length = _binary(x, pad=protocol.CACHED_HEADER_BYTES)
    assert length > protocol.CACHED_HEADER_BYTES
    for _ in range(2):
        request = decode_request(body, length, SPECS)
        np.testing.assert_array_equal(request.inputs["x"], x)
        assert request.id == "p" * protocol.CACHED_HEADER_BYTES


# --- large JSON: the paths a document can take decode alike (issue 16) -----------------------


@contextlib.contextmanager
def thresholds(**values: int):
    """Set the size thresholds of edged.serving.protocol (requests) or .responses for a block
    (hypothesis runs many examples in one test call, so not the function-scoped monkeypatch)."""
    import edged.serving.protocol as protocol
    import edged.serving.responses as responses

    home = {name: protocol if hasattr(protocol, name) else responses for name in values}
    old = {name: getattr(home[name], name) for name in values}
    for name, value in values.items():
        setattr(home[name], name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(home[name], name, value)


# orjson; the standard library's C scanner; its GIL-yielding form (number callbacks).
PARSERS = {
    "orjson": dict(FAST_JSON_BYTES=0, ORJSON_MAX_BYTES=2**40),
    "stdlib": dict(ORJSON_MAX_BYTES=-1, YIELDING_JSON_BYTES=2**40),
    "yielding": dict(ORJSON_MAX_BYTES=-1, YIELDING_JSON_BYTES=0),
}


def decode_each_way(body: bytes) -> dict[str, Any]:
    """{parser/chunking: the decoded inputs, or the ProtocolError's message}."""
    results: dict[str, Any] = {}
    for parser, setting in PARSERS.items():
        for chunk in (3, 2**40):  # np.asarray in pieces of 3 values, or in one call
            with thresholds(**setting, ASARRAY_VALUES=chunk):
                try:
                    results[f"{parser}/{chunk}"] = decode_request(body, None, SPECS).inputs
                except ProtocolError as exc:
                    results[f"{parser}/{chunk}"] = str(exc)
    return results


json_values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.sampled_from(["1", [1], [1.5, 2]]),
)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(json_values, max_size=12),
    datatype=st.sampled_from(["FP32", "FP64", "INT64", "UINT8", "UINT64", "BOOL"]),
)
def test_every_json_path_decodes_alike(values, datatype):
    """np.asarray in pieces decodes what one call does, under each parser, and the
    GIL-yielding standard library parser what the plain one does: the same arrays, or an
    error for both (numpy words a ragged list differently in pieces). Mixed ints and
    floats, ints past 64 bits, booleans among numbers, nulls, strings, nested lists. (orjson
    reading ints past 64 bits as floats is its own, older difference.)"""
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [len(values)], "datatype": datatype, "data": values}]}
    ).encode()
    results = decode_each_way(body)
    whole = 2**40
    pairs = [(f"{p}/3", f"{p}/{whole}") for p in PARSERS]
    pairs.append((f"yielding/{whole}", f"stdlib/{whole}"))
    for way, reference in pairs:
        got, want = results[way], results[reference]
        assert isinstance(got, str) == isinstance(want, str), (way, got, want)
        if isinstance(got, str):
            assert got.startswith("input 'x': ") and want.startswith("input 'x': ")
        else:
            assert_same(got["x"], want["x"])


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "INT64", "BOOL", "UINT64"])
def test_large_json_decodes_alike_on_every_path(datatype):
    array = sample(datatype, (3, 40, 700), seed=2)  # 84 000 values, flat and nested
    for data in (array.ravel().tolist(), array.tolist()):
        body = json.dumps(
            {
                "inputs": [
                    {"name": "x", "shape": list(array.shape), "datatype": datatype, "data": data}
                ]
            }
        ).encode()
        with thresholds(ASARRAY_VALUES=1000):
            for way, result in decode_each_way(body).items():
                assert not isinstance(result, str), (way, result)
                assert_same(result["x"], array)


@pytest.mark.parametrize(
    ("values", "datatype"),
    [
        (np.random.default_rng(1).random(200_000).tolist(), "FP32"),
        (np.random.default_rng(1).random((2, 100, 1000)).tolist(), "FP32"),
        (list(range(1000, 201_000)), "INT64"),
        ([2**64 - 1] * 100_000, "UINT64"),
        ([True, False] * 100_000, "BOOL"),
        ([0] * 300_000, "FP32"),
    ],
    ids=["floats", "nested", "ints", "big-ints", "bools", "zeros"],
)
def test_decode_estimate_covers_the_decode(values, datatype):
    """json_decode_bytes, which the API checks against [server] max_decode_bytes before
    decoding, is at least what decoding takes (the standard library's path, which documents
    over 8 MiB take)."""
    from edged.serving.protocol import json_decode_bytes

    shape = list(np.shape(values))
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": values}]}
    ).encode()
    del values
    with thresholds(**PARSERS["yielding"]):
        tracemalloc.start()
        try:
            request = decode_request(body, None, SPECS)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert request.inputs["x"].shape == tuple(shape)
    estimate = json_decode_bytes(body, None)
    assert peak <= estimate < 6 * peak, (peak, estimate)  # bools: 4.3x (singletons)


@pytest.mark.parametrize("special", [None, np.nan, np.inf])
def test_large_json_outputs_encode_like_small_ones(special):
    """Over FAST_JSON_VALUES, JSON data is written by orjson when every value is finite,
    and otherwise by the standard library's pure-Python encoder (NaN stays NaN): the same
    document either way."""
    from edged.serving.responses import FAST_JSON_VALUES

    out = np.random.default_rng(3).random((1, 1, 300, 300)).astype(np.float32)
    assert out.size > FAST_JSON_VALUES
    if special is not None:
        out[0, 0, 5, 5] = special
    outputs = {"y": out, "n": np.arange(FAST_JSON_VALUES, dtype=np.int64)}
    request = InferRequest("id-ü", {})
    fast, length = encode_response("m", request, outputs)
    with thresholds(FAST_JSON_VALUES=2**40):
        slow, _ = encode_response("m", request, outputs)
    assert length is None
    assert json.loads(fast) == json.loads(slow) or special is not None
    if special is not None:
        assert (b"NaN" if np.isnan(special) else b"Infinity") in fast
    result = parse_response(fast, None)
    assert_same(result.as_numpy("y"), out)
    assert_same(result.as_numpy("n"), outputs["n"])
