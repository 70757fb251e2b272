"""Edits of a .tflite graph that `edgectl quantize` needs around LiteRT's quantizer.

* `fold_float16`: MediaPipe-style models store weights as float16 constants behind DEQUANTIZE
  ops. LiteRT's post-training quantizer reads a conv's weights from the conv's own input
  tensor, finds no buffer there and crashes (a null read in AdjustWeightsForBiasScale), so
  the float16 constants are widened to float32 and the DEQUANTIZE ops removed first.
* `keep_float`: mixed precision. LiteRT's quantizer can quantize everything or one op, not
  "all but these", so the named ops of a full-integer model are put back in float: the float
  model's op with its float weights, DEQUANTIZE before it and QUANTIZE after it, to and from
  the int8 tensors the rest of the graph uses. On an NPU those ops then run on the CPU.
* `compute_ops`: the ops whose arithmetic INT8 changes most (conv, depthwise, fully
  connected, transposed conv), named by their first output tensor, which LiteRT's quantizer keeps.

* `clip_ranges`: a detector's score logits get a clipped calibrated range.
* `fuse_activations`: standalone RELUs folded into the op before them.

Written over `backends.tflite_edit` (LiteRT's generated flatbuffer classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from backends import tflite_edit as tfl

COMPUTE_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV")


class GraphError(ValueError):
    """The graph is not one this module can edit; the message says why."""


def compute_ops(data: bytes) -> list[str]:
    """The compute ops (`COMPUTE_OPS`) by their first output's name, in graph order."""
    return [name for kind, name in tfl.op_types(data) if kind in COMPUTE_OPS and name]


def fold_float16(data: bytes) -> tuple[bytes, int]:
    """The model with every DEQUANTIZE of a float16 constant replaced by a float32 constant,
    and the count folded; the model unchanged (same bytes) when there are none."""
    schema = tfl.generated()
    model = tfl.load(data)
    dequantize = [
        i
        for i, c in enumerate(model.operatorCodes)
        if tfl.code(c) == schema.BuiltinOperator.DEQUANTIZE
    ]
    if not dequantize:
        return data, 0
    folded = 0
    for graph in model.subgraphs:
        kept = []
        for op in graph.operators:
            if op.opcodeIndex in dequantize:
                source = graph.tensors[op.inputs[0]]
                if source.type == schema.TensorType.FLOAT16 and tfl.constant(model, source):
                    raw = np.asarray(model.buffers[source.buffer].data, dtype=np.uint8)
                    widened = raw.view(np.float16).astype(np.float32)
                    graph.tensors[op.outputs[0]].buffer = tfl.add_buffer(model, widened)
                    folded += 1
                    continue
            kept.append(op)
        graph.operators = kept
    if not folded:
        return data, 0
    tfl.prune(model)
    return tfl.dump(model), folded


def _opcode_index(model, code: int, version: int) -> int:
    schema = tfl.generated()
    for index, opcode in enumerate(model.operatorCodes):
        if tfl.code(opcode) == code and opcode.version == version:
            return index
    opcode = schema.OperatorCodeT()
    opcode.builtinCode = code
    greater = schema.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES  # codes past a byte
    opcode.deprecatedBuiltinCode = min(code, greater)
    opcode.version = version
    model.operatorCodes.append(opcode)
    return len(model.operatorCodes) - 1


def _float_tensor(graph, like, name: str, buffer: int = 0, kind: int | None = None) -> int:
    """A new tensor shaped like `like`: float32, or `kind` (a constant's own type)."""
    tensor = tfl.generated().TensorT()
    tensor.name = name
    tensor.type = tfl.generated().TensorType.FLOAT32 if kind is None else kind
    tensor.shape = like.shape
    tensor.shapeSignature = like.shapeSignature
    tensor.buffer = buffer
    graph.tensors.append(tensor)
    return len(graph.tensors) - 1


def _operator(opcode: int, inputs: Sequence[int], outputs: Sequence[int], template=None):
    op = tfl.generated().OperatorT()
    op.opcodeIndex = opcode
    op.inputs, op.outputs = list(inputs), list(outputs)
    if template is not None:
        op.builtinOptionsType = template.builtinOptionsType
        op.builtinOptions = template.builtinOptions
    return op


def _quantized(tensor) -> bool:
    """An integer tensor with a scale (int8/uint8 activations), not an index or shape."""
    q = tensor.quantization
    return q is not None and q.scale is not None and len(q.scale) > 0


def keep_float(quantized: bytes, original: bytes, names: Sequence[str]) -> tuple[bytes, list[str]]:
    """`quantized` with the ops named (by first output) computing in float32 again, taken
    from the float model `original` (after `fold_float16`). Returns the model and the names
    it could not find in both graphs."""
    schema = tfl.generated()
    q_model, f_model = tfl.load(quantized), tfl.load(original)
    q_graph, f_graph = q_model.subgraphs[0], f_model.subgraphs[0]

    def producers(graph) -> dict[str, Any]:
        return {
            tfl.tensor_name(graph.tensors[op.outputs[0]]): op
            for op in graph.operators
            if op.outputs
        }

    q_ops, f_ops = producers(q_graph), producers(f_graph)
    wanted = [n for n in names if n in q_ops and n in f_ops]
    missing = [n for n in names if n not in wanted]
    chosen = {id(q_ops[n]): f_ops[n] for n in wanted}
    dequantize = _opcode_index(q_model, schema.BuiltinOperator.DEQUANTIZE, 2)  # v2: int8 in
    quantize = _opcode_index(q_model, schema.BuiltinOperator.QUANTIZE, 1)
    as_float: dict[int, int] = {}  # int8 tensor -> its dequantized float tensor
    rewritten = []
    for q_op in q_graph.operators:
        f_op = chosen.get(id(q_op))
        if f_op is None:
            rewritten.append(q_op)
            continue
        f_code = f_model.operatorCodes[f_op.opcodeIndex]
        opcode = _opcode_index(q_model, tfl.code(f_code), f_code.version)
        inputs = []
        for position, f_index in enumerate(f_op.inputs):
            if f_index < 0:
                inputs.append(f_index)
                continue
            f_tensor = f_graph.tensors[f_index]
            if tfl.constant(f_model, f_tensor):  # weights and bias: the float model's own
                data = np.asarray(f_model.buffers[f_tensor.buffer].data, dtype=np.uint8)
                buffer = tfl.add_buffer(q_model, data)
                name = tfl.tensor_name(f_tensor) + "/float"
                inputs.append(_float_tensor(q_graph, f_tensor, name, buffer, f_tensor.type))
                continue
            q_index = q_op.inputs[position] if position < len(q_op.inputs) else -1
            if q_index < 0:  # the quantized op lacks this input: not the same op
                raise GraphError(f"op {tfl.tensor_name(f_tensor)}: the graphs' inputs differ")
            q_tensor = q_graph.tensors[q_index]
            if q_tensor.type == schema.TensorType.FLOAT32 or not _quantized(q_tensor):
                inputs.append(q_index)  # float already, or an index/shape tensor
                continue
            if q_index not in as_float:
                as_float[q_index] = _float_tensor(
                    q_graph, q_tensor, tfl.tensor_name(q_tensor) + "/dequantized"
                )
                rewritten.append(_operator(dequantize, [q_index], [as_float[q_index]]))
            inputs.append(as_float[q_index])
        outputs, requantize = [], []
        for q_index in q_op.outputs:
            q_tensor = q_graph.tensors[q_index]
            if q_tensor.type == schema.TensorType.FLOAT32 or not _quantized(q_tensor):
                outputs.append(q_index)
                continue
            float_out = _float_tensor(q_graph, q_tensor, tfl.tensor_name(q_tensor) + "/float")
            outputs.append(float_out)
            requantize.append(_operator(quantize, [float_out], [q_index]))
        rewritten.append(_operator(opcode, inputs, outputs, f_op))
        rewritten.extend(requantize)
    q_graph.operators = rewritten
    tfl.prune(q_model)
    return tfl.dump(q_model), missing


SHAPE_OPS = ("RESHAPE", "CONCATENATION", "SQUEEZE", "EXPAND_DIMS", "TRANSPOSE")


def clip_ranges(calibrated: bytes, output: str, low: float, high: float) -> tuple[bytes, list[str]]:
    """The calibrated model with the recorded min/max of `output` and of every tensor feeding
    it through shape-only ops (reshape, concatenation...) up to and including the compute ops
    that make them, clipped to [low, high]; and those tensors' names.

    For a detector's score logits: the calibration set's most negative background anchors
    (hundreds below zero) would otherwise set the int8 step, and a step of about one logit
    moves every score near the threshold; below the clip a score is 0 either way."""
    names = tfl.op_names()
    model = tfl.load(calibrated)
    graph = model.subgraphs[0]
    by_name = {tfl.tensor_name(t): i for i, t in enumerate(graph.tensors)}
    if output not in by_name:
        raise GraphError(f"no tensor {output!r} in the model")
    producer = {o: op for op in graph.operators for o in op.outputs}
    clipped, stack, seen = [], [by_name[output]], set()
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        tensor = graph.tensors[index]
        q = tensor.quantization
        if q is not None and q.min is not None and q.max is not None and len(q.min):
            # Both ends into [low, high], so a range wholly outside it stays a range.
            q.min = np.clip(np.asarray(q.min, np.float32), low, high).astype(np.float32)
            q.max = np.clip(np.asarray(q.max, np.float32), low, high).astype(np.float32)
            q.max = np.maximum(q.max, q.min)
            clipped.append(tfl.tensor_name(tensor))
        op = producer.get(index)
        if op is not None:
            kind = names.get(tfl.code(model.operatorCodes[op.opcodeIndex]), "")
            if kind in SHAPE_OPS:
                stack.extend(
                    i for i in op.inputs if i >= 0 and not tfl.constant(model, graph.tensors[i])
                )
    return tfl.dump(model), clipped


# Ops with a fused activation, and the standalone activations that fold into it.
FUSABLE = ("ADD", "SUB", "MUL", "CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
ACTIVATIONS = ("RELU", "RELU6", "RELU_N1_TO_1")  # each is also its ActivationFunctionType


def fuse_activations(data: bytes) -> tuple[bytes, int]:
    """The model with each standalone RELU/RELU6 folded into the op before it, where that op
    has a fused-activation field left at NONE and the RELU is its output's only reader; and
    the count. MediaPipe's detectors have ADD then RELU; XNNPACK takes float RELU but not an
    int8 one, so a full-integer model would leave 17 RELUs on the CPU (17 delegate
    partitions, 6x slower than float on XNNPACK). Vela fuses them itself."""
    schema = tfl.generated()
    names = tfl.op_names()
    model = tfl.load(data)
    graph = model.subgraphs[0]
    kind = [names.get(tfl.code(model.operatorCodes[op.opcodeIndex]), "") for op in graph.operators]
    readers: dict[int, list[int]] = {}
    for index, op in enumerate(graph.operators):
        for tensor in op.inputs:
            readers.setdefault(tensor, []).append(index)
    producer = {t: i for i, op in enumerate(graph.operators) for t in op.outputs}
    activation = vars(schema.ActivationFunctionType)
    removed = set()
    for index, op in enumerate(graph.operators):
        if kind[index] not in ACTIVATIONS or len(op.inputs) != 1:
            continue
        source = op.inputs[0]
        before = producer.get(source)
        if before is None or kind[before] not in FUSABLE or source in graph.outputs:
            continue
        options = graph.operators[before].builtinOptions
        if (
            readers.get(source) != [index]
            or options is None
            or getattr(options, "fusedActivationFunction", None) != activation["NONE"]
        ):
            continue
        options.fusedActivationFunction = activation[kind[index]]
        graph.operators[before].outputs = list(op.outputs)
        removed.add(index)
    if not removed:
        return data, 0
    graph.operators = [op for i, op in enumerate(graph.operators) if i not in removed]
    tfl.prune(model)
    return tfl.dump(model), len(removed)
