"""Read flattened device trees (DTB, FDT v16/v17) and live device-tree folders.

Hand-written on purpose: pylibfdt needs a C compiler on the board, and the `fdt` package on
PyPI guesses property types (and gets cell lists vs. strings wrong). Here every property stays
raw bytes and is decoded on demand by whoever knows what it means.

Trees come from three places: a .dtb file (`load_fdt`, `parse_fdt`), the kernel's live tree
(`read_tree_dir` on /sys/firmware/devicetree/base), and a fake live tree written by
`materialize` so tests can give the audit a real board's device tree without that board.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DeviceTree",
    "FdtError",
    "Node",
    "load_fdt",
    "materialize",
    "parse_fdt",
    "read_tree_dir",
]

FDT_MAGIC = 0xD00DFEED
FDT_BEGIN_NODE, FDT_END_NODE, FDT_PROP, FDT_NOP, FDT_END = 1, 2, 3, 4, 9
_LAST_VERSION = 17  # the newest format we understand; v16 lacks only size_dt_struct
_HEADER = struct.Struct(">10I")
_HEADER_V16_SIZE = 36  # v16 headers stop before size_dt_struct
_U32 = struct.Struct(">I")
_PROP_HEAD = struct.Struct(">II")  # value length, name offset in the strings block
_RSV_ENTRY = struct.Struct(">QQ")
# libfdt and the kernel's unflattening stop at 64 levels; real boards use about 10. The limit
# also keeps a hostile blob of nested one-letter nodes from building gigabytes of path strings.
MAX_DEPTH = 64


class FdtError(ValueError):
    """A device tree that cannot be read; the message names the source, what and where."""


@dataclass(eq=True)
class Node:
    """One device-tree node; property values are the raw bytes from the tree."""

    name: str
    path: str
    properties: dict[str, bytes] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)
    parent: Node | None = field(default=None, repr=False, compare=False)
    # Only so that decode errors can name the file the node came from.
    source: str = field(default="<fdt>", repr=False, compare=False, kw_only=True)

    def prop(self, name: str) -> bytes | None:
        return self.properties.get(name)

    def prop_str(self, name: str) -> str | None:
        """The first NUL-terminated string, e.g. `status` or `model`."""
        value = self.properties.get(name)
        if value is None:
            return None
        return _decode(value.split(b"\0", 1)[0])

    def prop_strings(self, name: str) -> list[str]:
        """A string list such as `compatible` (`[]` when the property is absent or empty)."""
        value = self.properties.get(name)
        if not value:
            return []
        if value.endswith(b"\0"):
            value = value[:-1]
        return [_decode(part) for part in value.split(b"\0")]

    def prop_u32s(self, name: str) -> list[int]:
        """Big-endian 32-bit cells such as `reg` or `interrupts` (`[]` when absent)."""
        value = self.properties.get(name)
        if value is None:
            return []
        if len(value) % 4:
            raise FdtError(
                f"{self.source}: {self.path}: property {name!r} is {len(value)} bytes, "
                "not a whole number of 32-bit cells"
            )
        return list(struct.unpack(f">{len(value) // 4}I", value))

    def prop_u64(self, name: str) -> int | None:
        """A single number of one or two cells (the spec allows both, e.g. clock-frequency)."""
        value = self.properties.get(name)
        if value is None:
            return None
        if len(value) not in (4, 8):
            raise FdtError(
                f"{self.source}: {self.path}: property {name!r} is {len(value)} bytes, "
                "not a 32- or 64-bit number"
            )
        return int.from_bytes(value, "big")

    def child(self, name: str) -> Node | None:
        """The child called `name`; without a unit address, the first `name@...` (as libfdt)."""
        for node in self.children:
            if node.name == name:
                return node
        if "@" not in name:
            for node in self.children:
                if node.base_name == name:
                    return node
        return None

    def walk(self) -> Iterator[Node]:
        """This node and all below it, parents before children, in tree order."""
        stack = [self]
        while stack:  # iterative: corrupt or odd trees may nest deeper than the recursion limit
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    @property
    def status_ok(self) -> bool:
        """Whether the node is enabled: no `status`, or "okay" ("ok" is the old spelling)."""
        status = self.prop_str("status")
        return status is None or status in ("okay", "ok")

    @property
    def base_name(self) -> str:
        """The name without its unit address (`serial` for `serial@30860000`)."""
        return self.name.partition("@")[0]

    @property
    def unit_address(self) -> str | None:
        """The text after `@` (`30860000`), or None when the name has no unit address."""
        _, at, unit = self.name.partition("@")
        return unit if at else None


@dataclass
class DeviceTree:
    """A whole tree plus the header facts of the blob it came from."""

    root: Node
    reserve_map: list[tuple[int, int]] = field(default_factory=list)
    boot_cpuid: int = 0
    version: int = _LAST_VERSION
    source: str = "<fdt>"
    _phandles: dict[int, Node] | None = field(default=None, init=False, repr=False, compare=False)

    def find(self, path: str) -> Node | None:
        """The node at `path`; a first component without `/` is an alias (`serial0/...`).

        Like the kernel's of_find_node_by_path, anything after `:` is options, not path.
        """
        path = path.split(":", 1)[0]
        if path.startswith("/"):
            node: Node | None = self.root
        else:
            alias, _, path = path.partition("/")
            aliases = self.root.child("aliases")
            target = aliases.prop_str(alias) if aliases else None
            if not target or not target.startswith("/"):
                return None
            node = self.find(target)
        for part in path.split("/"):
            if node is None:
                return None
            if part:
                node = node.child(part)
        return node

    def by_phandle(self, ph: int) -> Node | None:
        """The node whose `phandle` (or older `linux,phandle`) is `ph`."""
        if self._phandles is None:
            self._phandles = {}
            for node in self.walk():
                for key in ("phandle", "linux,phandle"):
                    value = node.properties.get(key)
                    if value is not None and len(value) == 4:
                        self._phandles.setdefault(_U32.unpack(value)[0], node)
        return self._phandles.get(ph)

    def walk(self) -> Iterator[Node]:
        return self.root.walk()

    def compatible(self) -> list[str]:
        """The board's compatible list, most specific first."""
        return self.root.prop_strings("compatible")

    def model(self) -> str | None:
        return self.root.prop_str("model")


def _decode(raw: bytes) -> str:
    # Device-tree text is ASCII by spec; never fail on a stray byte, show it instead.
    return raw.decode("utf-8", "backslashreplace")


def _check_name(name: str, what: str, where: str) -> None:
    """Names become path components and file names (materialize): keep them safe."""
    if not name or "/" in name or name in (".", ".."):
        raise FdtError(f"{where}: invalid {what} name {name!r}")


# --- flattened (.dtb) -------------------------------------------------------------------------


def parse_fdt(data: bytes, source: str = "<fdt>") -> DeviceTree:
    """Parse a DTB blob; every malformation raises FdtError naming source, problem and offset."""
    data = bytes(data)
    header = _read_header(data, source)
    strings = _Strings(data, header["off_dt_strings"], header["size_dt_strings"], source)
    root = _read_structure(data, header, strings, source)
    return DeviceTree(
        root=root,
        reserve_map=_read_reserve_map(data, header, source),
        boot_cpuid=header["boot_cpuid_phys"],
        version=header["version"],
        source=source,
    )


# Real board trees are 20-200 KiB; the FDT header's totalsize is 32-bit, but nothing real
# comes near this. A bound, so `--dtb /dev/zero` (or a huge file) cannot exhaust memory.
MAX_DTB_BYTES = 64 * 2**20


def load_fdt(path: str | os.PathLike[str]) -> DeviceTree:
    """Read and parse a .dtb file; errors name the file. Only a regular file of at most
    MAX_DTB_BYTES is read (a FIFO would block, a device would never end)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer; for a regular
        # file the flag changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FdtError(f"{path}: not a regular file (a device, FIFO or socket), not a .dtb")
            if st.st_size > MAX_DTB_BYTES:
                raise FdtError(
                    f"{path}: {st.st_size} bytes, larger than any device tree "
                    f"(at most {MAX_DTB_BYTES})"
                )
            data = f.read()
    except OSError as exc:
        raise FdtError(f"{path}: cannot read device tree: {exc.strerror or exc}") from exc
    return parse_fdt(data, source=path.name)


_FIELDS = (
    "magic", "totalsize", "off_dt_struct", "off_dt_strings", "off_mem_rsvmap",
    "version", "last_comp_version", "boot_cpuid_phys", "size_dt_strings", "size_dt_struct",
)  # fmt: skip


def _read_header(data: bytes, source: str) -> dict[str, int]:
    """Validate the header so that every later read stays inside the blob."""
    size = len(data)
    if size == 0:
        raise FdtError(f"{source}: empty (0 bytes), not a flattened device tree")
    if size < 4:
        raise FdtError(f"{source}: truncated: {size} bytes, too short for the FDT magic")
    (magic,) = _U32.unpack_from(data)
    if magic != FDT_MAGIC:
        raise FdtError(f"{source}: bad magic 0x{magic:08x} (not a flattened device tree)")
    if size < _HEADER_V16_SIZE:
        raise FdtError(
            f"{source}: truncated: header needs at least {_HEADER_V16_SIZE} bytes "
            f"but file is {size} bytes"
        )
    raw = data[: _HEADER.size].ljust(_HEADER.size, b"\0")  # a v16 header has one field less
    h = dict(zip(_FIELDS, _HEADER.unpack(raw), strict=True))
    if h["version"] < 16:
        raise FdtError(f"{source}: FDT version {h['version']} is too old (need 16 or 17)")
    if h["last_comp_version"] > _LAST_VERSION:
        raise FdtError(
            f"{source}: FDT version {h['version']} is only compatible back to "
            f"{h['last_comp_version']} (we read up to {_LAST_VERSION})"
        )
    header_size = _HEADER_V16_SIZE if h["version"] == 16 else _HEADER.size
    if size < header_size:
        raise FdtError(
            f"{source}: truncated: v{h['version']} header needs {header_size} bytes "
            f"but file is {size} bytes"
        )
    total = h["totalsize"]
    if total > size:
        raise FdtError(
            f"{source}: truncated: header says 0x{total:x} bytes but file is 0x{size:x} bytes"
        )
    if total < header_size:
        raise FdtError(f"{source}: totalsize 0x{total:x} is smaller than the header")
    if h["version"] == 16:  # no size field: the structure block may run to the end of the blob
        h["size_dt_struct"] = max(total - h["off_dt_struct"], 0)
    _check_block(source, "memory reservation map", h["off_mem_rsvmap"], 0, header_size, total)
    _check_block(
        source, "structure block", h["off_dt_struct"], h["size_dt_struct"], header_size, total
    )
    _check_block(
        source, "strings block", h["off_dt_strings"], h["size_dt_strings"], header_size, total
    )
    return h


def _check_block(source: str, what: str, offset: int, size: int, start: int, total: int) -> None:
    if offset < start or offset > total:
        raise FdtError(
            f"{source}: {what} offset 0x{offset:x} is outside the blob (0x{start:x}..0x{total:x})"
        )
    if offset + size > total:
        raise FdtError(
            f"{source}: truncated: {what} ends at 0x{offset + size:x} "
            f"but the blob (totalsize) is 0x{total:x} bytes"
        )


def _read_reserve_map(data: bytes, header: dict[str, int], source: str) -> list[tuple[int, int]]:
    """Memory the OS must not touch, as (address, size) pairs up to the (0, 0) terminator."""
    offset, end = header["off_mem_rsvmap"], header["totalsize"]
    entries: list[tuple[int, int]] = []
    while True:
        if offset + _RSV_ENTRY.size > end:
            raise FdtError(
                f"{source}: truncated: memory reservation map has no (0, 0) terminator "
                f"before 0x{end:x}"
            )
        address, size = _RSV_ENTRY.unpack_from(data, offset)
        if address == 0 and size == 0:
            return entries
        entries.append((address, size))
        offset += _RSV_ENTRY.size


class _Strings:
    """The strings block: property names, looked up by offset and cached (names repeat a lot)."""

    def __init__(self, data: bytes, offset: int, size: int, source: str) -> None:
        self.block, self.offset, self.source = data[offset : offset + size], offset, source
        self.cache: dict[int, str] = {}

    def name(self, nameoff: int, at: int, node: Node) -> str:
        name = self.cache.get(nameoff)
        if name is not None:
            return name
        if nameoff >= len(self.block):
            raise FdtError(
                f"{self.source}: property at 0x{at:x} (in {node.path}): name offset "
                f"0x{nameoff:x} is outside the strings block "
                f"(0x{len(self.block):x} bytes at 0x{self.offset:x})"
            )
        end = self.block.find(b"\0", nameoff)
        if end < 0:
            raise FdtError(
                f"{self.source}: property at 0x{at:x} (in {node.path}): name at strings "
                f"offset 0x{nameoff:x} runs past the end of the strings block"
            )
        name = _decode(self.block[nameoff:end])
        _check_name(name, "property", f"{self.source}: 0x{at:x} (in {node.path})")
        self.cache[nameoff] = name
        return name


def _align4(offset: int, base: int) -> int:
    return offset + (-(offset - base) & 3)  # tokens are 4-aligned relative to the block start


def _read_structure(data: bytes, header: dict[str, int], strings: _Strings, source: str) -> Node:
    """Turn the token stream into nodes; iterative so deep trees cannot overflow the stack."""
    base = header["off_dt_struct"]
    end = base + header["size_dt_struct"]
    offset = base
    stack: list[Node] = []
    child_names: list[set[str]] = []  # per open node, to reject duplicate children
    root: Node | None = None

    def fail(what: str, at: int) -> FdtError:
        path = stack[-1].path if stack else "(outside any node)"
        return FdtError(f"{source}: {what} at 0x{at:x} (in {path})")

    while True:
        if offset + 4 > end:
            raise FdtError(f"{source}: truncated: structure block ends at 0x{end:x} before FDT_END")
        (token,) = _U32.unpack_from(data, offset)
        at, offset = offset, offset + 4
        if token == FDT_PROP:
            if offset + 8 > end:
                raise fail("truncated property header", at)
            length, nameoff = _PROP_HEAD.unpack_from(data, offset)
            offset += 8
            if offset + length > end:
                raise fail(f"property value of {length} bytes runs past the structure block", at)
            if not stack:
                raise fail("property outside any node", at)
            node = stack[-1]
            name = strings.name(nameoff, at, node)
            if name in node.properties:
                raise fail(f"duplicate property {name!r}", at)
            node.properties[name] = data[offset : offset + length]
            offset = _align4(offset + length, base)
        elif token == FDT_BEGIN_NODE:
            name_end = data.find(b"\0", offset, end)
            if name_end < 0:
                raise fail("unterminated node name", at)
            name = _decode(data[offset:name_end])
            offset = _align4(name_end + 1, base)
            if len(stack) >= MAX_DEPTH:
                raise fail(f"nodes nested deeper than {MAX_DEPTH} levels", at)
            if child_names:
                if name in child_names[-1]:
                    raise fail(f"duplicate node {name!r}", at)
                child_names[-1].add(name)
            stack.append(_new_node(name, stack, root, source, at))
            child_names.append(set())
            if root is None:
                root = stack[0]
        elif token == FDT_END_NODE:
            if not stack:
                raise fail("unbalanced FDT_END_NODE", at)
            stack.pop()
            child_names.pop()
        elif token == FDT_NOP:
            pass
        elif token == FDT_END:
            if stack:
                raise fail(f"FDT_END with {len(stack)} node(s) still open (unbalanced)", at)
            if root is None:
                raise fail("FDT_END before any node", at)
            return root  # anything after FDT_END is padding and ignored
        else:
            raise fail(f"unknown token 0x{token:08x}", at)


def _new_node(name: str, stack: list[Node], root: Node | None, source: str, at: int) -> Node:
    if not stack:
        if root is not None:
            raise FdtError(f"{source}: second root node at 0x{at:x}")
        return Node(name="", path="/", source=source)  # v16+ roots are nameless
    parent = stack[-1]
    _check_name(name, "node", f"{source}: 0x{at:x} (in {parent.path})")
    node = Node(name=name, path=f"{parent.path.rstrip('/')}/{name}", parent=parent, source=source)
    parent.children.append(node)
    return node


# --- live trees (/sys/firmware/devicetree/base) -----------------------------------------------


def read_tree_dir(path: str | os.PathLike[str], source: str | None = None) -> DeviceTree:
    """Read a live-style tree: directories are nodes, regular files are raw property values.

    The kernel's `name` pseudo-properties are kept as ordinary properties, as the kernel shows
    them. Entries are read in sorted order, because directory order means nothing here. A
    folder has no header, so reserve_map, boot_cpuid and version keep their defaults.
    """
    top = Path(path)
    label = source or str(top)
    if not top.is_dir():
        raise FdtError(f"{label}: not a device-tree directory ({top})")
    root = Node(name="", path="/", source=label)
    stack = [(top, root)]
    while stack:
        folder, node = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    child = Node(
                        name=entry.name,
                        path=f"{node.path.rstrip('/')}/{entry.name}",
                        parent=node,
                        source=label,
                    )
                    node.children.append(child)
                    stack.append((Path(entry.path), child))
                elif entry.is_file(follow_symlinks=False):
                    node.properties[entry.name] = Path(entry.path).read_bytes()
        except OSError as exc:
            raise FdtError(
                f"{label}: {node.path}: cannot read {exc.filename}: {exc.strerror}"
            ) from exc
    return DeviceTree(root=root, source=label)


def materialize(tree: DeviceTree, dest: Path) -> None:
    """Write `tree` the way the kernel lays out /sys/firmware/devicetree/base under `dest`.

    Like the kernel (drivers/of/fdt.c populate_properties), every node without a `name`
    property, the root included, gets one: the node name without unit address, NUL-terminated.
    Like drivers/of/kobj.c safe_name, a child whose name is already taken in its folder (by a
    property of the same name) gets `#1`, `#2`... appended.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest}: not empty; materialize writes a whole tree")
    stack = [(dest, tree.root)]
    while stack:
        folder, node = stack.pop()
        taken = set()
        properties = dict(node.properties)
        properties.setdefault("name", node.base_name.encode() + b"\0")
        for name, value in properties.items():
            (folder / name).write_bytes(value)
            taken.add(name)
        for child in node.children:
            dirname = _safe_name(child.name, taken)
            taken.add(dirname)
            (folder / dirname).mkdir()
            stack.append((folder / dirname, child))


def _safe_name(name: str, taken: set[str]) -> str:
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}#{n}"
    return candidate
