"""A stand-in for `hailo_platform` (HailoRT's Python API) at the library boundary, for the
Hailo backend's tests on a machine with no Hailo device.

It has the real names and return conventions of pyhailort 4.18-4.23 as its source defines
them (hailort: libhailort/bindings/python/platform/hailo_platform/pyhailort/pyhailort.py and
the pybind classes of bindings/python/src): `VDevice.create_params()` -> VDeviceParams
(scheduling_algorithm, group_id, multi_process_service, device_ids; the Python default
scheduler is NONE), `VDevice(params)`, `create_infer_model(path)` -> InferModel
(input_names, output_names, input()/output() -> InferStream with name, shape, format,
set_format_type, quant_infos, is_nms), `configure()` -> ConfiguredInferModel
(create_bindings, run(bindings, timeout), shutdown), Bindings (input()/output() ->
set_buffer, get_buffer(tf_format)), `get_physical_devices()` -> Device with `.control`
(identify, get_chip_temperature -> ts0/ts1_temperature, get_extended_device_information,
power_measurement), and the HailoRTException family with the status names HailoRT's
ExceptionWrapper puts in its messages.

What the device computes comes from onnxruntime on an ONNX model the test names: a frame
arrives as the HEF's uint8 NHWC, is dequantized with the input's quant info, runs in NCHW
float32, and leaves in HailoRT's layout (NC, NHWC), as float32 when the output's format type
was set to FLOAT32, else quantized to uint8 as a HEF's outputs are by default. The rules of
the real device that the backend depends on are kept: a VDevice marks its device used (one
group per process shares it; another process cannot have it without the service), the
multi-process service needs a scheduler and a running hailort_service, the driver and
library versions must match, a HEF runs only on the chips HailoRT allows, buffers must be
C-contiguous and of the frame's size and type, and an unplugged device fails every call.

`write_hef` writes a synthetic HEF in the header layout of hef_internal.hpp (no real .hef
can be downloaded here, and none ships in a PyPI package): its protobuf is hand-encoded and
its xxh3 checksums are zero (HailoRT would refuse such a file; edged does not check them).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__version__ = "4.20.0"

# -- synthetic HEF files ----------------------------------------------------------------------

MAGIC = 0x01484546
HW_ARCH = {"hailo8": 1, "hailo8r": 2, "hailo8l": 3, "hailo15m": 4, "hailo10h": 5, "hailo15h": 103}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def hef_proto(hw_arch: int | None, sdk_version: str = "3.29.0", name: str = "synthetic") -> bytes:
    """A ProtoHEFHef (hef.proto) with a header (hw_arch, timestamp, sdk_version, version),
    one network group naming itself, and a mapping blob. hw_arch None leaves the header
    message out; 0 is left out of it, as proto3 does for a default."""
    parts = b""
    if hw_arch is not None:
        header = (_field(1, hw_arch) if hw_arch else b"") + _field(2, 1_717_000_000)
        header += _field(3, sdk_version.encode()) + _field(4, 1)
        parts += _field(1, header)
    network_group = _field(1, _field(1, name.encode()))  # metadata { network_group_name }
    return parts + _field(2, network_group) + _field(3, bytes(range(64)))


def hef_bytes(
    version: int = 2,
    hw_arch: int | None = 3,
    sdk_version: str = "3.29.0",
    ccws: bytes = b"\xa5" * 256,
    proto: bytes | None = None,
) -> bytes:
    """A synthetic HEF: header version 0-3 (hef_internal.hpp, big-endian), protobuf, ccws."""
    proto = hef_proto(hw_arch, sdk_version) if proto is None else proto
    common = struct.pack(">III", MAGIC, version, len(proto))
    if version == 0:  # v0 has no ccws: the file is header + proto
        return common + struct.pack(">I", 0) + hashlib.md5(proto).digest() + proto
    if version == 1:
        crc = zlib.crc32(proto + ccws)
        return common + struct.pack(">IQI", crc, len(ccws), 0) + proto + ccws
    if version == 2:
        return common + struct.pack(">QQQQ", 0, len(ccws), 0, 0) + proto + ccws
    if version == 3:
        padding, additional = 16, b"\x5a" * 24
        body = ccws + b"\x00" * padding
        distinct = struct.pack(">QQIQQQ", 0, len(body), padding, len(additional), 0, 0)
        return common + distinct + proto + body + additional
    raise ValueError(f"HEF header version {version}: 0-3 exist")


def write_hef(path: Path, **kwargs: Any) -> Path:
    path.write_bytes(hef_bytes(**kwargs))
    return path


# -- what the stand-in device runs ------------------------------------------------------------


@dataclass
class HefModel:
    """A synthetic HEF's network: an ONNX model computes it. `height`/`width` fix the ONNX
    input's spatial size (HEFs are static); `nms` adds an on-chip-NMS-like output made from
    the scores of `nms_from` (classes, max boxes per class): one full-frame box per class."""

    onnx: Path
    height: int
    width: int
    arch: str = "hailo8l"  # what the HEF is compiled for
    input_quant: tuple[float, int] = (1 / 255, 0)  # (qp_scale, qp_zp)
    output_quant: tuple[float, int] = (1 / 255, 0)
    nms: tuple[str, int, int] | None = None  # (source output, classes, max boxes)
    nms_order: str = "HAILO_NMS_BY_CLASS"
    corrupt: bool = False  # its checksum is wrong: HailoRT refuses it when it reads it
    _session: Any = None

    def session(self):
        if self._session is None:
            import onnxruntime

            self._session = onnxruntime.InferenceSession(
                str(self.onnx), providers=["CPUExecutionProvider"]
            )
        return self._session


@dataclass
class Board:
    """The one Hailo device the stand-in has, and the host around it."""

    architecture: str = "HAILO8L"  # DeviceArchitectureTypes name the firmware reports
    device_id: str = "0000:01:00.0"
    driver_version: str = "4.20.0"
    temperatures: tuple[float, float] = (47.5, 49.25)  # ts0, ts1
    current_monitoring: bool = False  # an INA231 on the module: power can be measured
    product_name: str = "HAILO-8L AI ACC M.2 B+M KEY MODULE EXT TMP"
    power_watts: float = 1.75
    service_running: bool = False  # hailort_service
    held_elsewhere: bool = False  # another process has a VDevice on it (no service)
    plugged: bool = True
    hung: bool = False  # runs time out
    models: dict[str, HefModel] = field(default_factory=dict)
    # What happened, for the tests to look at.
    vdevice_params: list[dict[str, Any]] = field(default_factory=list)
    open_groups: dict[str, int] = field(default_factory=dict)  # group -> open VDevices
    released: int = 0
    shutdowns: int = 0
    run_timeouts: list[int] = field(default_factory=list)
    frames_run: int = 0
    control_calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # what set_batch_size was given

    def unplug(self) -> None:
        self.plugged = False


BOARD = Board()  # install() sets the test's own


def install(monkeypatch, board: Board, version: str = "4.20.0") -> Board:
    """Make `import hailo_platform` give this module, on `board`, as HailoRT `version`."""
    import sys

    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "hailo_platform", module)
    monkeypatch.setattr(module, "BOARD", board)
    monkeypatch.setattr(module, "__version__", version)
    return board


# -- exceptions (pyhailort.py) ----------------------------------------------------------------


class HailoRTException(Exception):
    pass


class HailoRTTimeout(HailoRTException):
    pass


class HailoRTInvalidOperationException(HailoRTException):
    pass


class HailoRTInvalidArgumentException(HailoRTException):
    pass


class HailoRTNotFoundException(HailoRTException):
    pass


class HailoRTInvalidHEFException(HailoRTException):
    pass


class HailoRTDriverOperationFailedException(HailoRTException):
    pass


HailoRTPCIeDriverException = HailoRTDriverOperationFailedException


class HailoRTNetworkGroupNotActivatedException(HailoRTException):
    pass


class HailoCommunicationClosedException(HailoRTException):
    pass


def _status(code: int, name: str) -> HailoRTException:
    """What ExceptionWrapper raises for a status it has no class for."""
    return HailoRTException(f"libhailort failed with error: {code} ({name})")


def _check_plugged(service: bool) -> None:
    if not BOARD.plugged:
        if service:
            raise HailoCommunicationClosedException(
                "Communication closed failure. Check server-client connection"
            )
        raise HailoRTDriverOperationFailedException(
            "Failure in hailort driver ioctl. run 'dmesg | grep hailo' for more information"
        )


# -- enums (the pybind enums) -----------------------------------------------------------------


class HailoSchedulingAlgorithm(enum.IntEnum):
    NONE = 0
    ROUND_ROBIN = 1


class FormatType(enum.IntEnum):
    AUTO = 0
    UINT8 = 1
    UINT16 = 2
    FLOAT32 = 3


class FormatOrder(enum.IntEnum):
    AUTO = 0
    NHWC = 1
    NC = 5
    HAILO_NMS = 9
    HAILO_NMS_WITH_BYTE_MASK = 21
    HAILO_NMS_BY_CLASS = 23
    HAILO_NMS_BY_SCORE = 24


class DvmTypes(enum.IntEnum):
    AUTO = 0


class PowerMeasurementTypes(enum.IntEnum):
    AUTO = 0
    SHUNT_VOLTAGE = 1
    BUS_VOLTAGE = 2
    POWER = 3
    CURRENT = 4


class DeviceArchitectureTypes(enum.IntEnum):
    HAILO8_A0 = 0
    HAILO8 = 1
    HAILO8L = 2
    HAILO15H = 3
    HAILO15L = 4
    HAILO15M = 5
    HAILO10H = 6

    def __str__(self) -> str:
        return self.name


# is_hef_compatible (device_internal.cpp): which HEF targets each chip runs.
COMPATIBLE = {
    "HAILO8": ("hailo8", "hailo8r", "hailo8l"),
    "HAILO8L": ("hailo8l",),
    "HAILO10H": ("hailo15h", "hailo15m", "hailo10h"),
}


@dataclass
class HailoFormat:
    type: FormatType
    order: FormatOrder
    flags: int = 0


@dataclass
class QuantInfo:
    qp_zp: float
    qp_scale: float
    limvals_min: float = 0.0
    limvals_max: float = 255.0


@dataclass
class NmsShape:
    number_of_classes: int
    max_bboxes_per_class: int


# -- devices ----------------------------------------------------------------------------------


class VDeviceParams:
    def __init__(self) -> None:
        self.device_ids: list[str] = []
        self.device_count = 1
        self.scheduling_algorithm = HailoSchedulingAlgorithm.NONE  # Python's default
        self.group_id = "UNIQUE"  # HAILO_DEFAULT_VDEVICE_GROUP_ID
        self.multi_process_service = False


@dataclass
class BoardInformation:
    device_architecture: DeviceArchitectureTypes
    firmware_version: str
    product_name: str
    board_name: str = "Hailo-8"


@dataclass
class TemperatureInfo:
    ts0_temperature: float
    ts1_temperature: float
    sample_count: int = 1


@dataclass
class SupportedFeatures:
    current_monitoring: bool
    pcie: bool = True
    ethernet: bool = False
    mipi: bool = False
    mdio: bool = False


@dataclass
class ExtendedDeviceInformation:
    supported_features: SupportedFeatures
    neural_network_core_clock_rate: int = 400_000_000


class Control:
    def __init__(self, device: Device) -> None:
        self._owner = device

    def _call(self) -> None:
        BOARD.control_calls += 1
        if self._owner.released:
            raise HailoRTInvalidOperationException("Device was released")
        _check_plugged(False)

    def identify(self) -> BoardInformation:
        self._call()
        return BoardInformation(
            DeviceArchitectureTypes[BOARD.architecture], __version__, BOARD.product_name
        )

    def get_chip_temperature(self) -> TemperatureInfo:
        self._call()
        return TemperatureInfo(*BOARD.temperatures)

    def get_extended_device_information(self) -> ExtendedDeviceInformation:
        self._call()
        return ExtendedDeviceInformation(SupportedFeatures(BOARD.current_monitoring))

    def power_measurement(self, dvm=DvmTypes.AUTO, measurement_type=PowerMeasurementTypes.AUTO):
        self._call()
        if not BOARD.current_monitoring:
            raise HailoRTFirmwareControlFailedException("libhailort control operation failed")
        if measurement_type != PowerMeasurementTypes.POWER:
            raise HailoRTInvalidArgumentException("only POWER in the stand-in")
        return BOARD.power_watts


class HailoRTFirmwareControlFailedException(HailoRTException):
    pass


class Device:
    """A physical device handle for control (opening one does not mark the device used)."""

    def __init__(self, device_id: str | None = None) -> None:
        _check_plugged(False)
        self.device_id = device_id or BOARD.device_id
        self.released = False
        self._control = Control(self)

    @property
    def control(self) -> Control:
        return self._control

    def release(self) -> None:
        self.released = True


class VDevice:
    def __init__(self, params: VDeviceParams | None = None, *, device_ids=None) -> None:
        params = params or VDevice.create_params()
        BOARD.vdevice_params.append(dict(vars(params)))
        if params.device_ids and params.device_ids != [BOARD.device_id]:
            raise _status(8, "HAILO_INVALID_ARGUMENT")
        service = params.multi_process_service
        if service:
            if params.scheduling_algorithm == HailoSchedulingAlgorithm.NONE:
                raise HailoRTInvalidArgumentException(
                    "Invalid argument. See hailort.log for more information"
                )
            if not BOARD.service_running:
                raise _status(77, "HAILO_RPC_FAILED")
        else:
            _check_plugged(False)
            if BOARD.service_running or BOARD.held_elsewhere:
                raise _status(74, "HAILO_OUT_OF_PHYSICAL_DEVICES")
            if BOARD.driver_version != __version__:
                raise _status(76, "HAILO_INVALID_DRIVER_VERSION")
            # One VDevice group per process has the device (SharedResourceManager).
            others = [g for g, n in BOARD.open_groups.items() if n and g != params.group_id]
            if others or (params.group_id == "UNIQUE" and BOARD.open_groups.get("UNIQUE")):
                raise _status(74, "HAILO_OUT_OF_PHYSICAL_DEVICES")
        self._params = params
        self._service = service
        self._open = True
        BOARD.open_groups[params.group_id] = BOARD.open_groups.get(params.group_id, 0) + 1

    @staticmethod
    def create_params() -> VDeviceParams:
        return VDeviceParams()

    def get_physical_devices_ids(self) -> list[str]:
        return [BOARD.device_id]

    def get_physical_devices(self) -> list[Device]:
        return [Device(i) for i in self.get_physical_devices_ids()]

    def create_infer_model(self, hef_source, name: str = "") -> InferModel:
        if not self._open:
            raise HailoRTInvalidOperationException("VDevice was released")
        path = Path(hef_source)
        data = path.read_bytes()
        if data[:4] != struct.pack(">I", MAGIC):
            raise HailoRTInvalidHEFException("Invalid HEF. See hailort.log for more information")
        model = BOARD.models.get(str(path))
        if model is None or model.corrupt:
            raise HailoRTInvalidHEFException("Invalid HEF. See hailort.log for more information")
        return InferModel(self, model, str(path))

    def release(self) -> None:
        if self._open:
            self._open = False
            BOARD.open_groups[self._params.group_id] -= 1
            BOARD.released += 1


# -- the InferModel API -----------------------------------------------------------------------


def _onnx_frame_shape(dims: list[Any], model: HefModel) -> tuple[int, ...]:
    """One frame's shape in HailoRT's layout for an ONNX output of `dims` (batch first)."""
    rest = [d if isinstance(d, int) else None for d in dims[1:]]
    if len(rest) == 1:
        return (rest[0],)  # NC
    if len(rest) == 3:  # NCHW -> HWC; the spatial size follows the input's here
        channels, height, width = rest
        return (height or model.height, width or model.width, channels)
    raise HailoRTInvalidHEFException(f"stand-in: no HailoRT layout for {dims}")


class InferStream:
    """InferModel.InferStream: an edge's name, frame shape and format."""

    def __init__(self, name: str, shape: tuple[int, ...], fmt: HailoFormat, quant, nms=None):
        self._name = name
        self._shape = shape
        self._format = fmt
        self._quant = quant
        self._nms = nms

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def format(self) -> HailoFormat:
        return self._format

    def set_format_type(self, type) -> None:
        self._format = HailoFormat(FormatType(type), self._format.order)

    @property
    def quant_infos(self) -> list[QuantInfo]:
        return [QuantInfo(self._quant[1], self._quant[0])]

    @property
    def is_nms(self) -> bool:
        return self._nms is not None


@dataclass
class VStreamInfo:
    name: str
    shape: tuple[int, ...]
    format: HailoFormat
    nms_shape: NmsShape | None = None


class HEF:
    def __init__(self, hef_source) -> None:
        self._model = BOARD.models[str(hef_source)]

    def get_output_vstream_infos(self, name=None) -> list[VStreamInfo]:
        model = self._model
        if model.nms is None:
            return []
        _, classes, boxes = model.nms
        return [
            VStreamInfo(
                "nms_out",
                (classes, 5, boxes),
                HailoFormat(FormatType.FLOAT32, FormatOrder[model.nms_order]),
                NmsShape(classes, boxes),
            )
        ]


class InferModel:
    def __init__(self, vdevice: VDevice, model: HefModel, path: str) -> None:
        self._vdevice = vdevice
        self._model = model
        self._path = path
        self.batch_size = 0  # HAILO_DEFAULT_BATCH_SIZE: automatic
        session = model.session()
        self._inputs = [
            InferStream(
                i.name,
                (model.height, model.width, int(i.shape[1])),
                HailoFormat(FormatType.UINT8, FormatOrder.NHWC),
                model.input_quant,
            )
            for i in session.get_inputs()
        ]
        self._outputs = []
        for o in session.get_outputs():
            shape = _onnx_frame_shape(o.shape, model)
            order = FormatOrder.NC if len(shape) == 1 else FormatOrder.NHWC
            self._outputs.append(
                InferStream(o.name, shape, HailoFormat(FormatType.UINT8, order), model.output_quant)
            )
        if model.nms is not None:
            _, classes, boxes = model.nms
            raw = (classes * (1 + 5 * boxes),)  # per class: a count, then its boxes
            self._outputs.append(
                InferStream(
                    "nms_out",
                    raw,
                    HailoFormat(FormatType.FLOAT32, FormatOrder[model.nms_order]),
                    (1.0, 0),
                    nms=(classes, boxes),
                )
            )

    @property
    def hef(self) -> HEF:
        return HEF(self._path)

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size
        BOARD.batch_sizes.append(batch_size)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self._inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self._outputs]

    @property
    def inputs(self) -> list[InferStream]:
        return list(self._inputs)

    @property
    def outputs(self) -> list[InferStream]:
        return list(self._outputs)

    def _find(self, streams: list[InferStream], name: str) -> InferStream:
        if not name and len(streams) == 1:
            return streams[0]
        for stream in streams:
            if stream.name == name:
                return stream
        raise HailoRTNotFoundException("Item not found. See hailort.log for more information")

    def input(self, name: str = "") -> InferStream:
        return self._find(self._inputs, name)

    def output(self, name: str = "") -> InferStream:
        return self._find(self._outputs, name)

    def configure(self) -> ConfiguredInferModel:
        _check_plugged(self._vdevice._service)
        # check_hef_is_compatible: a HEF for another chip is refused at configure.
        if self._model.arch not in COMPATIBLE.get(BOARD.architecture, ()):
            raise HailoRTInvalidHEFException("Invalid HEF. See hailort.log for more information")
        return ConfiguredInferModel(self)


_DTYPES = {FormatType.UINT8: np.uint8, FormatType.UINT16: np.uint16, FormatType.FLOAT32: np.float32}


class _BoundStream:
    """ConfiguredInferModel.Bindings.InferStream."""

    def __init__(self, stream: InferStream) -> None:
        self._stream = stream
        self._buffer: np.ndarray | None = None

    def set_buffer(self, buffer: np.ndarray) -> None:
        if not buffer.flags.c_contiguous:
            raise HailoRTException("Buffer must be C_CONTIGUOUS")
        kind = self._stream.format.type
        dtype = _DTYPES[FormatType.UINT8 if kind == FormatType.AUTO else kind]
        frame = int(np.prod(self._stream.shape))
        if buffer.dtype != dtype or buffer.size != frame:
            raise HailoRTInvalidArgumentException(
                "Invalid argument. See hailort.log for more information"
            )
        self._buffer = buffer

    def get_buffer(self, tf_format: bool | None = False):
        buffer = self._buffer
        if tf_format is None or self._stream._nms is None:
            return buffer
        classes, boxes = self._stream._nms
        per_class, pos = [], 0
        for _ in range(classes):
            count = int(buffer[pos])
            per_class.append(buffer[pos + 1 : pos + 1 + 5 * count].reshape(count, 5))
            pos += 1 + 5 * boxes
        if not tf_format:
            return per_class
        out = np.zeros((classes, 5, boxes), np.float32)
        for c, found in enumerate(per_class):
            out[c, :, : len(found)] = found.T
        return out


class Bindings:
    def __init__(self, model: InferModel) -> None:
        self._inputs = {s.name: _BoundStream(s) for s in model._inputs}
        self._outputs = {s.name: _BoundStream(s) for s in model._outputs}

    def _pick(self, streams: dict[str, _BoundStream], name: str) -> _BoundStream:
        if not name and len(streams) == 1:
            return next(iter(streams.values()))
        if name not in streams:
            raise HailoRTNotFoundException("Item not found. See hailort.log for more information")
        return streams[name]

    def input(self, name: str = "") -> _BoundStream:
        return self._pick(self._inputs, name)

    def output(self, name: str = "") -> _BoundStream:
        return self._pick(self._outputs, name)


class ConfiguredInferModel:
    def __init__(self, infer_model: InferModel) -> None:
        self._infer_model = infer_model
        self._active = False
        self._shut = False

    def __enter__(self) -> ConfiguredInferModel:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def activate(self) -> None:
        if self._infer_model._vdevice._params.scheduling_algorithm != HailoSchedulingAlgorithm.NONE:
            raise HailoRTInvalidOperationException("activate() is invalid with the scheduler")
        self._active = True

    def create_bindings(self, input_buffers=None, output_buffers=None) -> Bindings:
        bindings = Bindings(self._infer_model)
        for name, buffer in (input_buffers or {}).items():
            bindings.input(name).set_buffer(buffer)
        for name, buffer in (output_buffers or {}).items():
            bindings.output(name).set_buffer(buffer)
        return bindings

    def run(self, bindings: list[Bindings], timeout: int) -> None:
        model = self._infer_model
        vdevice = model._vdevice
        if self._shut or not vdevice._open:
            raise HailoRTInvalidOperationException("the model was shut down")
        if vdevice._params.scheduling_algorithm == HailoSchedulingAlgorithm.NONE and not (
            self._active
        ):
            raise HailoRTNetworkGroupNotActivatedException("Network group is not activated")
        _check_plugged(vdevice._service)
        BOARD.run_timeouts.append(timeout)
        if BOARD.hung:
            raise HailoRTTimeout(
                "Received a timeout - hailort has failed because a timeout had occurred"
            )
        for binding in bindings:
            for stream in (*binding._inputs.values(), *binding._outputs.values()):
                if stream._buffer is None:
                    raise HailoRTInvalidOperationException(
                        "Invalid operation. See hailort.log for more information"
                    )
            self._compute(model, binding)
            BOARD.frames_run += 1

    @staticmethod
    def _compute(model: InferModel, binding: Bindings) -> None:
        hef = model._model
        session = hef.session()
        feeds = {}
        for name, bound in binding._inputs.items():
            scale, zero = bound._stream._quant
            frame = bound._buffer.reshape(bound._stream.shape).astype(np.float32)
            feeds[name] = ((frame - zero) * scale).transpose(2, 0, 1)[None]
        values = dict(
            zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
        )
        for name, bound in binding._outputs.items():
            stream = bound._stream
            if stream._nms is not None:
                bound._buffer[...] = _nms_raw(values[hef.nms[0]][0], *stream._nms)
                continue
            value = values[name][0]
            if value.ndim == 3:
                value = value.transpose(1, 2, 0)
            if stream.format.type == FormatType.FLOAT32:
                bound._buffer[...] = value.reshape(bound._buffer.shape)
            else:
                scale, zero = stream._quant
                q = np.clip(np.rint(value / scale) + zero, 0, 255).astype(np.uint8)
                bound._buffer[...] = q.reshape(bound._buffer.shape)

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            BOARD.shutdowns += 1


def _nms_raw(scores: np.ndarray, classes: int, boxes: int) -> np.ndarray:
    """NMS-by-class host buffer: per class a box count, then that many (y_min, x_min, y_max,
    x_max, score) boxes, in a slot of `boxes` boxes. Here each class has one full-frame box
    scored by the model's probability for it."""
    raw = np.zeros(classes * (1 + 5 * boxes), np.float32)
    for c in range(classes):
        base = c * (1 + 5 * boxes)
        raw[base] = 1
        raw[base + 1 : base + 6] = (0.0, 0.0, 1.0, 1.0, float(scores[c]))
    return raw
