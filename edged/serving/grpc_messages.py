"""The messages of the KServe v2 / Triton gRPC service (`inference.GRPCInferenceService`),
the part edged reads or writes, as protobuf message classes.

Why declared here. They are declared below by name, field number and type, and built at
import into a private protobuf descriptor pool. Not tritonclient's generated modules: they
would make a client library (and its protobuf pin, <7 today) a runtime dependency of the
server, and generated code checks the protobuf runtime it meets. Not compiled from a .proto
with grpcio-tools: a build step and a copy of Triton's .proto for the few dozen fields edged
serves. Declared here, edged needs only the protobuf runtime (already there for onnx), any
protobuf version reads them, and tests/serving/test_grpc.py checks every field against
tritonclient's own descriptors (same numbers, types and labels: the same wire format).
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

# -- the messages -------------------------------------------------------------------------------
# Each message: its fields as "number name type", comma-separated. A type is a scalar, a
# message (nested ones dotted, from the package), "*type" for a repeated field, "map<Type>"
# for a map from string to Type; "oneof:NAME" after a field puts it in that oneof. Only what
# edged reads or writes: a field left out is skipped on reading, as protobuf skips any
# unknown field, and never sent.
_MESSAGES = {
    "ServerLiveRequest": "",
    "ServerLiveResponse": "1 live bool",
    "ServerReadyRequest": "",
    "ServerReadyResponse": "1 ready bool",
    "ModelReadyRequest": "1 name string, 2 version string",
    "ModelReadyResponse": "1 ready bool",
    "ServerMetadataRequest": "",
    "ServerMetadataResponse": "1 name string, 2 version string, 3 extensions *string",
    "ModelMetadataRequest": "1 name string, 2 version string",
    "ModelMetadataResponse": "1 name string, 2 versions *string, 3 platform string, "
    "4 inputs *ModelMetadataResponse.TensorMetadata, "
    "5 outputs *ModelMetadataResponse.TensorMetadata",
    "ModelMetadataResponse.TensorMetadata": "1 name string, 2 datatype string, 3 shape *int64",
    "InferParameter": "1 bool_param bool oneof:parameter_choice, "
    "2 int64_param int64 oneof:parameter_choice, 3 string_param string oneof:parameter_choice, "
    "4 double_param double oneof:parameter_choice, 5 uint64_param uint64 oneof:parameter_choice",
    "InferTensorContents": "1 bool_contents *bool, 2 int_contents *int32, "
    "3 int64_contents *int64, 4 uint_contents *uint32, 5 uint64_contents *uint64, "
    "6 fp32_contents *float, 7 fp64_contents *double, 8 bytes_contents *bytes",
    "ModelInferRequest": "1 model_name string, 2 model_version string, 3 id string, "
    "4 parameters map<InferParameter>, 5 inputs *ModelInferRequest.InferInputTensor, "
    "6 outputs *ModelInferRequest.InferRequestedOutputTensor, 7 raw_input_contents *bytes",
    "ModelInferRequest.InferInputTensor": "1 name string, 2 datatype string, 3 shape *int64, "
    "4 parameters map<InferParameter>, 5 contents InferTensorContents",
    "ModelInferRequest.InferRequestedOutputTensor": "1 name string, "
    "2 parameters map<InferParameter>",
    "ModelInferResponse": "1 model_name string, 2 model_version string, 3 id string, "
    "4 parameters map<InferParameter>, 5 outputs *ModelInferResponse.InferOutputTensor, "
    "6 raw_output_contents *bytes",
    "ModelInferResponse.InferOutputTensor": "1 name string, 2 datatype string, "
    "3 shape *int64, 4 parameters map<InferParameter>, 5 contents InferTensorContents",
    "ModelStreamInferResponse": "1 error_message string, 2 infer_response ModelInferResponse",
    "ModelConfigRequest": "1 name string, 2 version string",
    "ModelConfigResponse": "1 config ModelConfig",
    "ModelStatisticsRequest": "1 name string, 2 version string",
    "StatisticDuration": "1 count uint64, 2 ns uint64",
    "InferStatistics": "1 success StatisticDuration, 2 fail StatisticDuration, "
    "3 queue StatisticDuration, 4 compute_input StatisticDuration, "
    "5 compute_infer StatisticDuration, 6 compute_output StatisticDuration, "
    "7 cache_hit StatisticDuration, 8 cache_miss StatisticDuration",
    "InferBatchStatistics": "1 batch_size uint64, 2 compute_input StatisticDuration, "
    "3 compute_infer StatisticDuration, 4 compute_output StatisticDuration",
    "MemoryUsage": "1 type string, 2 id int64, 3 byte_size uint64",
    "ModelStatistics": "1 name string, 2 version string, 3 last_inference uint64, "
    "4 inference_count uint64, 5 execution_count uint64, 6 inference_stats InferStatistics, "
    "7 batch_stats *InferBatchStatistics, 8 memory_usage *MemoryUsage",
    "ModelStatisticsResponse": "1 model_stats *ModelStatistics",
    "RepositoryIndexRequest": "1 repository_name string, 2 ready bool",
    "RepositoryIndexResponse": "1 models *RepositoryIndexResponse.ModelIndex",
    "RepositoryIndexResponse.ModelIndex": "1 name string, 2 version string, 3 state string, "
    "4 reason string",
    "ModelRepositoryParameter": "1 bool_param bool oneof:parameter_choice, "
    "2 int64_param int64 oneof:parameter_choice, 3 string_param string oneof:parameter_choice, "
    "4 bytes_param bytes oneof:parameter_choice",
    "RepositoryModelLoadRequest": "1 repository_name string, 2 model_name string, "
    "3 parameters map<ModelRepositoryParameter>",
    "RepositoryModelLoadResponse": "",
    "RepositoryModelUnloadRequest": "1 repository_name string, 2 model_name string, "
    "3 parameters map<ModelRepositoryParameter>",
    "RepositoryModelUnloadResponse": "",
    "SystemSharedMemoryStatusRequest": "1 name string",
    "SystemSharedMemoryStatusResponse": "1 regions "
    "map<SystemSharedMemoryStatusResponse.RegionStatus>",
    "SystemSharedMemoryStatusResponse.RegionStatus": "1 name string, 2 key string, "
    "3 offset uint64, 4 byte_size uint64",
    "SystemSharedMemoryRegisterRequest": "1 name string, 2 key string, 3 offset uint64, "
    "4 byte_size uint64",
    "SystemSharedMemoryRegisterResponse": "",
    "SystemSharedMemoryUnregisterRequest": "1 name string",
    "SystemSharedMemoryUnregisterResponse": "",
    # CUDA shared memory: answered as a Triton without GPUs answers (nothing registers).
    "CudaSharedMemoryStatusRequest": "1 name string",
    "CudaSharedMemoryStatusResponse": "1 regions map<CudaSharedMemoryStatusResponse.RegionStatus>",
    "CudaSharedMemoryStatusResponse.RegionStatus": "1 name string, 2 device_id uint64, "
    "3 byte_size uint64",
    "CudaSharedMemoryRegisterRequest": "1 name string, 2 raw_handle bytes, 3 device_id int64, "
    "4 byte_size uint64",
    "CudaSharedMemoryRegisterResponse": "",
    "CudaSharedMemoryUnregisterRequest": "1 name string",
    "CudaSharedMemoryUnregisterResponse": "",
    # The trace extension's settings (a map of name -> list of strings; empty: clear).
    "TraceSettingRequest": "1 settings map<TraceSettingRequest.SettingValue>, 2 model_name string",
    "TraceSettingRequest.SettingValue": "1 value *string",
    "TraceSettingResponse": "1 settings map<TraceSettingResponse.SettingValue>",
    "TraceSettingResponse.SettingValue": "1 value *string",
    # Triton's model configuration (its model_config.proto), the part edged fills in.
    "ModelConfig": "1 name string, 2 platform string, 17 backend string, "
    "4 max_batch_size int32, 5 input *ModelInput, 6 output *ModelOutput, "
    "11 dynamic_batching ModelDynamicBatching oneof:scheduling_choice",
    "ModelInput": "1 name string, 2 data_type DataType, 4 dims *int64",
    "ModelOutput": "1 name string, 2 data_type DataType, 3 dims *int64",
    "ModelDynamicBatching": "1 preferred_batch_size *int32, 2 max_queue_delay_microseconds uint64",
}
_ENUMS = {
    "DataType": "TYPE_INVALID TYPE_BOOL TYPE_UINT8 TYPE_UINT16 TYPE_UINT32 TYPE_UINT64 "
    "TYPE_INT8 TYPE_INT16 TYPE_INT32 TYPE_INT64 TYPE_FP16 TYPE_FP32 TYPE_FP64 TYPE_STRING "
    "TYPE_BF16",  # numbered 0, 1, ... in this order
}
_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}


def _build(package: str) -> dict[str, type[Message]]:
    """The message classes of `_MESSAGES`, in a pool of their own (a tritonclient in the same
    process registers the same names in the default pool)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="edged/grpc_service.proto", package=package, syntax="proto3"
    )
    for enum, names in _ENUMS.items():
        values = [{"name": n, "number": i} for i, n in enumerate(names.split())]
        file.enum_type.add(name=enum, value=values)
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full in _MESSAGES:  # parents before their nested messages
        parent, _, short = full.rpartition(".")
        protos[full] = (protos[parent].nested_type if parent else file.message_type).add(name=short)
    for full, spec in _MESSAGES.items():
        proto = protos[full]
        oneofs: list[str] = []
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            number, name, kind, *extra = entry.split()
            field = proto.field.add(name=name, number=int(number), label=_F.LABEL_OPTIONAL)
            if kind.startswith("*"):
                field.label, kind = _F.LABEL_REPEATED, kind[1:]
            if kind.startswith("map<"):
                entry_name = "".join(p.capitalize() for p in name.split("_")) + "Entry"
                map_entry = proto.nested_type.add(name=entry_name)
                map_entry.options.map_entry = True
                map_entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=1)
                value = map_entry.field.add(name="value", number=2, label=1)
                value.type, value.type_name = _F.TYPE_MESSAGE, f".{package}.{kind[4:-1]}"
                field.label, field.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
                field.type_name = f".{package}.{full}.{entry_name}"
            elif kind in _SCALARS:
                field.type = _SCALARS[kind]
            else:
                field.type = _F.TYPE_ENUM if kind in _ENUMS else _F.TYPE_MESSAGE
                field.type_name = f".{package}.{kind}"
            for option in extra:
                oneof = option.removeprefix("oneof:")
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    proto.oneof_decl.add(name=oneof)
                field.oneof_index = oneofs.index(oneof)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for name in _MESSAGES
    }


MESSAGES = _build("inference")
ServerLiveRequest = MESSAGES["ServerLiveRequest"]
ServerLiveResponse = MESSAGES["ServerLiveResponse"]
ServerReadyRequest = MESSAGES["ServerReadyRequest"]
ServerReadyResponse = MESSAGES["ServerReadyResponse"]
ModelReadyRequest = MESSAGES["ModelReadyRequest"]
ModelReadyResponse = MESSAGES["ModelReadyResponse"]
ServerMetadataRequest = MESSAGES["ServerMetadataRequest"]
ServerMetadataResponse = MESSAGES["ServerMetadataResponse"]
ModelMetadataRequest = MESSAGES["ModelMetadataRequest"]
ModelMetadataResponse = MESSAGES["ModelMetadataResponse"]
ModelInferRequest = MESSAGES["ModelInferRequest"]
ModelInferResponse = MESSAGES["ModelInferResponse"]
ModelStreamInferResponse = MESSAGES["ModelStreamInferResponse"]
ModelConfigRequest = MESSAGES["ModelConfigRequest"]
ModelConfigResponse = MESSAGES["ModelConfigResponse"]
ModelStatisticsRequest = MESSAGES["ModelStatisticsRequest"]
ModelStatisticsResponse = MESSAGES["ModelStatisticsResponse"]
RepositoryIndexRequest = MESSAGES["RepositoryIndexRequest"]
RepositoryIndexResponse = MESSAGES["RepositoryIndexResponse"]
RepositoryModelLoadRequest = MESSAGES["RepositoryModelLoadRequest"]
RepositoryModelLoadResponse = MESSAGES["RepositoryModelLoadResponse"]
RepositoryModelUnloadRequest = MESSAGES["RepositoryModelUnloadRequest"]
RepositoryModelUnloadResponse = MESSAGES["RepositoryModelUnloadResponse"]
SystemSharedMemoryStatusRequest = MESSAGES["SystemSharedMemoryStatusRequest"]
SystemSharedMemoryStatusResponse = MESSAGES["SystemSharedMemoryStatusResponse"]
SystemSharedMemoryRegisterRequest = MESSAGES["SystemSharedMemoryRegisterRequest"]
SystemSharedMemoryRegisterResponse = MESSAGES["SystemSharedMemoryRegisterResponse"]
SystemSharedMemoryUnregisterRequest = MESSAGES["SystemSharedMemoryUnregisterRequest"]
SystemSharedMemoryUnregisterResponse = MESSAGES["SystemSharedMemoryUnregisterResponse"]
CudaSharedMemoryStatusRequest = MESSAGES["CudaSharedMemoryStatusRequest"]
CudaSharedMemoryStatusResponse = MESSAGES["CudaSharedMemoryStatusResponse"]
CudaSharedMemoryRegisterRequest = MESSAGES["CudaSharedMemoryRegisterRequest"]
CudaSharedMemoryRegisterResponse = MESSAGES["CudaSharedMemoryRegisterResponse"]
CudaSharedMemoryUnregisterRequest = MESSAGES["CudaSharedMemoryUnregisterRequest"]
CudaSharedMemoryUnregisterResponse = MESSAGES["CudaSharedMemoryUnregisterResponse"]
TraceSettingRequest = MESSAGES["TraceSettingRequest"]
TraceSettingResponse = MESSAGES["TraceSettingResponse"]
