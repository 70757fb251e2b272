"""Reading and editing a .tflite graph with LiteRT's generated flatbuffer classes
(`ai_edge_litert.schema_py_generated`, the object API), imported when used.

The format's helpers that more than one part of edged needs: op types by output name,
metadata entries (how a compiler's report travels inside the model), renumbering after an
edit. No flatbuffer tool on the package registries edits a .tflite graph, and these are a
few dozen lines over the schema LiteRT itself ships. Reading a model's form without LiteRT
is `backends.model_info`'s job.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def generated():
    from ai_edge_litert import schema_py_generated as schema

    return schema


def load(data: bytes):
    return generated().ModelT.InitFromPackedBuf(bytearray(data), 0)


def dump(model) -> bytes:
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def code(opcode) -> int:
    # builtin_code is the field since schema 3a; older files only set the deprecated byte.
    return max(int(opcode.builtinCode), int(opcode.deprecatedBuiltinCode))


def op_names() -> dict[int, str]:
    ops = generated().BuiltinOperator
    return {v: k for k, v in vars(ops).items() if not k.startswith("_") and isinstance(v, int)}


def tensor_name(table) -> str:
    """The `name` of a tensor or a metadata entry (bytes in the object API) as text."""
    name = table.name
    return name.decode() if isinstance(name, bytes) else str(name or "")


def constant(model, tensor) -> bool:
    buf = model.buffers[tensor.buffer] if 0 < tensor.buffer < len(model.buffers) else None
    return buf is not None and buf.data is not None and len(buf.data) > 0


def op_types(data: bytes) -> list[tuple[str, str]]:
    """(op type, first output's name) of every op of the main subgraph, in graph order."""
    model = load(data)
    names = op_names()
    graph = model.subgraphs[0]
    result = []
    for op in graph.operators:
        opcode = model.operatorCodes[op.opcodeIndex]
        kind = names.get(code(opcode), "CUSTOM")
        if kind == "CUSTOM":
            custom = opcode.customCode
            kind = custom.decode() if isinstance(custom, bytes) else str(custom)
        output = tensor_name(graph.tensors[op.outputs[0]]) if len(op.outputs) else ""
        result.append((kind, output))
    return result


def add_buffer(model, array: np.ndarray) -> int:
    buffer = generated().BufferT()
    buffer.data = np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=np.uint8)
    model.buffers.append(buffer)
    return len(model.buffers) - 1


def prune(model) -> None:
    """Drop tensors no op, input or output uses, the buffers no tensor uses and the opcodes
    no op uses; every index is renumbered."""
    used_buffers = {0}  # buffer 0 is the schema's empty sentinel
    for graph in model.subgraphs:
        used = set(graph.inputs) | set(graph.outputs)
        for op in graph.operators:
            used.update(i for i in op.inputs if i >= 0)
            used.update(i for i in op.outputs if i >= 0)
            used.update(i for i in (op.intermediates if op.intermediates is not None else ()))
        order = sorted(used)
        renumber = {old: new for new, old in enumerate(order)}
        graph.tensors = [graph.tensors[i] for i in order]

        def remap(indices: Iterable[int], renumber: dict[int, int] = renumber) -> list[int]:
            return [renumber[i] if i >= 0 else i for i in indices]

        for op in graph.operators:
            op.inputs = remap(op.inputs)
            op.outputs = remap(op.outputs)
            if op.intermediates is not None:
                op.intermediates = remap(op.intermediates)
        graph.inputs, graph.outputs = remap(graph.inputs), remap(graph.outputs)
        for signature in model.signatureDefs or ():
            if signature.subgraphIndex == model.subgraphs.index(graph):
                for entry in [*(signature.inputs or ()), *(signature.outputs or ())]:
                    entry.tensorIndex = renumber[entry.tensorIndex]
        used_buffers.update(t.buffer for t in graph.tensors)
    used_buffers.update(m.buffer for m in model.metadata or ())
    order = sorted(b for b in used_buffers if b < len(model.buffers))
    renumber = {old: new for new, old in enumerate(order)}
    model.buffers = [model.buffers[i] for i in order]
    for graph in model.subgraphs:
        for tensor in graph.tensors:
            tensor.buffer = renumber.get(tensor.buffer, 0)
    for entry in model.metadata or ():
        entry.buffer = renumber[entry.buffer]
    if model.metadataBuffer is not None:
        model.metadataBuffer = [renumber[b] for b in model.metadataBuffer if b in renumber]
    used_codes = sorted({op.opcodeIndex for g in model.subgraphs for op in g.operators})
    renumber = {old: new for new, old in enumerate(used_codes)}
    model.operatorCodes = [model.operatorCodes[i] for i in used_codes]
    for graph in model.subgraphs:
        for op in graph.operators:
            op.opcodeIndex = renumber[op.opcodeIndex]


def metadata(data: bytes) -> dict[str, bytes]:
    """The model's metadata entries, by name."""
    model = load(data)
    return {
        tensor_name(m): bytes(np.asarray(model.buffers[m.buffer].data, dtype=np.uint8))
        for m in model.metadata or ()
        if model.buffers[m.buffer].data is not None
    }
