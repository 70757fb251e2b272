"""The Hailo HEF file, read without HailoRT: which HailoRT can read it (its header's version)
and which chip it was compiled for (its protobuf header's hw_arch). The format is owned by
`backends.hailo` (its FORMATS); this module only reads the bytes.

Every length and offset is checked against the file, so a truncated or damaged HEF is a
ModelError naming it (tests/hostile/test_parser_fuzz.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from backends.errors import ModelError
from backends.formats import FormatFacts

# The header (hailort libhailort/src/hef/hef_internal.hpp, hef__header_t; packed, every field
# big-endian: hef.cpp converts each with BYTE_ORDER__htonl/htonll):
#   0 magic u32 = 0x01484546 ("\x01HEF")   4 version u32   8 hef_proto_size u32
# then by version (HEADER_VERSION_0..3), after which come the protobuf (ProtoHEFHef,
# hef.proto), then the compiled contexts (ccws):
#   v0: reserved u32, md5[16]                                    -> 32 bytes; file = proto
#   v1: crc32 u32, ccws_size u64, reserved u32                   -> 28 bytes; proto + ccws
#   v2: xxh3 u64, ccws_size u64, reserved u64 x2                 -> 44 bytes; proto + ccws
#   v3: xxh3 u64, ccws_size_with_padding u64, padding u32,
#       additional_info_size u64, proto_xxh3 u64, reserved u64   -> 56 bytes;
#       proto + ccws_with_padding + additional_info
# HailoRT checks exactly these lengths ("HEF file length does not match"), so a truncated
# file is caught here; its checksums (md5, crc32, xxh3) HailoRT verifies at load.
HEF_MAGIC = b"\x01HEF"
_HEADER_SIZES = {0: 32, 1: 28, 2: 44, 3: 56}
# The first HailoRT that reads each header version (from the header versions each release's
# hef_internal.hpp defines: v2 from 4.20, v3 from 4.21; v1 took this layout in 4.18).
HEADER_READERS = {0: (4, 0, 0), 1: (4, 18, 0), 2: (4, 20, 0), 3: (4, 21, 0)}
# ProtoHEFHwArch (hef.proto): ProtoHEFHef.header (field 1) is a ProtoHEFHeader whose field 1
# is hw_arch, "the target hw_arch the HEF is compiled to"; 3 is sdk_version. proto3: an
# absent hw_arch is 0. A Hailo-8 accepts HAILO8P (1), not 0 (is_hef_compatible), so Hailo-8
# HEFs carry 1; edged names both "hailo8", as the Dataflow Compiler's --hw-arch does.
HW_ARCH = {
    0: "hailo8",
    1: "hailo8",
    2: "hailo8r",
    3: "hailo8l",
    4: "hailo15m",
    5: "hailo10h",
    6: "hailo15l",
    100: "sage_a0",
    101: "sage_b0",
    102: "paprika_b0",
    103: "hailo15h",
    104: "ginger",
    105: "lavender",
    106: "pluto",
}


@dataclass(frozen=True)
class HefHeader:
    version: int
    proto_size: int
    target: str | None  # "hailo8l"; None when the protobuf has no header message
    sdk_version: str | None  # the Dataflow Compiler that wrote it

    @property
    def min_hailort(self) -> tuple[int, int, int]:
        return HEADER_READERS[self.version]


def recognise_hef(data: bytes) -> bool:
    return data[:4] == HEF_MAGIC


def read_hef_header(path: Path, data: bytes, size: int | None = None) -> HefHeader:
    """The header and the protobuf header of a HEF; ModelError names the path for a file
    that is not one, is cut short, or has a header HailoRT would refuse. `data` may be the
    file's first bytes only when `size` gives the whole file's length (the protobuf's own
    header comes first, so a few KiB tell the target)."""
    size = len(data) if size is None else size
    if size < 12 or len(data) < 12:
        raise ModelError(f"{path}: truncated HEF ({size} bytes, the header alone is 12+)")
    if not recognise_hef(data):
        raise ModelError(f"{path}: not a HEF (no magic 01 48 45 46 at byte 0)")
    version, proto_size = struct.unpack_from(">II", data, 4)
    if version not in _HEADER_SIZES:
        raise ModelError(
            f"{path}: HEF header version {version} is unknown (HailoRT up to 5.x writes 0-3)"
        )
    header_size = _HEADER_SIZES[version]
    if size < header_size or len(data) < header_size:
        raise ModelError(
            f"{path}: truncated HEF ({size} bytes, a v{version} header is {header_size})"
        )
    if version == 0:
        rest = 0
    elif version == 1:
        (rest,) = struct.unpack_from(">Q", data, 16)
    elif version == 2:
        (rest,) = struct.unpack_from(">Q", data, 20)
    else:
        (ccws,) = struct.unpack_from(">Q", data, 20)
        (additional,) = struct.unpack_from(">Q", data, 32)
        rest = ccws + additional
    expected = header_size + proto_size + rest
    if size != expected:
        cut = "truncated" if size < expected else "trailing bytes after the"
        raise ModelError(
            f"{path}: {cut} HEF: its v{version} header says {expected} bytes, the file has {size}"
        )
    proto = memoryview(data)[header_size : header_size + proto_size]
    target, sdk = _proto_header(path, proto, whole=len(data) == size)
    return HefHeader(version, proto_size, target, sdk)


def read_hef(path: Path, data: bytes) -> FormatFacts:
    header = read_hef_header(path, data)
    built = f"compiled for {header.target}" if header.target else "target not stated"
    sdk = f" by Dataflow Compiler {header.sdk_version}" if header.sdk_version else ""
    return FormatFacts(
        "int8",  # the Dataflow Compiler quantizes (8-bit, some layers 16-bit)
        f"Hailo HEF v{header.version} ({built}{sdk}; HailoRT "
        f"{'.'.join(map(str, header.min_hailort[:2]))}+ reads it)",
        target=header.target,
    )


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("varint runs past the message")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview):
    """(field number, wire type, value) of one protobuf message level: a varint's value, or
    a length-delimited field's bytes. Only what the HEF header needs; no protobuf library."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | memoryview | None
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError(f"field {number} runs past the message")
            value, pos = buf[pos : pos + length], pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"wire type {wire} at field {number}")
        yield number, wire, value


def _proto_header(path: Path, proto: memoryview, whole: bool) -> tuple[str | None, str | None]:
    """hw_arch and sdk_version of ProtoHEFHef.header. Serializers write fields in number
    order, so the header (field 1) comes first and the walk stops there. Of a file's first
    bytes only (`whole` false), what they do not hold is not known, not corrupt."""
    try:
        for number, wire, value in _fields(proto):
            if number == 1 and wire == 2:
                arch, sdk = 0, None
                for sub, sub_wire, sub_value in _fields(value):
                    if sub == 1 and sub_wire == 0:
                        arch = sub_value
                    elif sub == 3 and sub_wire == 2:
                        sdk = bytes(sub_value).decode(errors="replace")
                return HW_ARCH.get(arch, f"unknown hw_arch {arch}"), sdk
    except ValueError as exc:
        if not whole:
            return None, None
        raise ModelError(f"{path}: corrupt HEF: its protobuf part is unreadable ({exc})") from None
    return None, None


# Which HEFs each chip runs (device_internal.cpp, DeviceBase::is_hef_compatible): a Hailo-8
# also runs Hailo-8L HEFs (slower), a Hailo-8L only its own. Keys: the firmware's
# DeviceArchitectureTypes names.
RUNS = {
    "HAILO8": ("hailo8", "hailo8r", "hailo8l"),
    "HAILO8L": ("hailo8l",),
    "HAILO15H": ("hailo15h", "hailo15m", "hailo10h", "ginger", "lavender"),
    "HAILO10H": ("hailo15h", "hailo15m", "hailo10h", "ginger", "lavender"),
    "HAILO15L": ("hailo15l", "pluto"),
    "HAILO15M": ("hailo15m",),
}
