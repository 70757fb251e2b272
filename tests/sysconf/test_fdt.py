"""sysconf.fdt on real boards: Debian's arm64 kernel device trees, checked against dtc.

The only hand-made blobs are the malformed ones, and those are real files with bytes cut off
or overwritten, so every test starts from data nobody on this project wrote.
"""

from __future__ import annotations

import codecs
import random
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sysconf.audit.checks.devicetree import RULES, check_tree
from sysconf.fdt import DeviceTree, FdtError, Node, load_fdt, materialize, parse_fdt, read_tree_dir

IMX8MP = "freescale/imx8mp-evk.dtb"
DTC_BOARDS = [
    IMX8MP,
    "freescale/imx93-11x11-evk.dtb",
    "broadcom/bcm2711-rpi-4-b.dtb",
    "rockchip/rk3568-rock-3a.dtb",
    "ti/k3-am62a7-sk.dtb",
    "amlogic/meson-g12b-a311d-khadas-vim3.dtb",
    "nvidia/tegra210-p3450-0000.dtb",
]
needs_dtc = pytest.mark.skipif(
    shutil.which("dtc") is None,
    reason="dtc not installed (Debian package device-tree-compiler); CI installs it",
)


@pytest.fixture(scope="module")
def imx8mp(dtb_corpus: Path) -> DeviceTree:
    return load_fdt(dtb_corpus / IMX8MP)


@pytest.fixture(scope="module")
def imx8mp_bytes(dtb_corpus: Path) -> bytes:
    return (dtb_corpus / IMX8MP).read_bytes()


# --- the whole corpus -------------------------------------------------------------------------


@pytest.mark.timing
def test_every_corpus_dtb_parses(dtb_corpus: Path) -> None:
    files = sorted(dtb_corpus.rglob("*.dtb"))
    assert len(files) > 500, f"expected the ~576 arm64 boards in {dtb_corpus}"
    start = time.perf_counter()
    for path in files:
        tree = load_fdt(path)
        assert tree.version == 17
        assert tree.source == path.name
        assert tree.compatible(), f"{path.name}: root has no compatible"
    # About 1-2 s here for 576 files / 880k properties: the parser is one flat loop. 30 s
    # leaves room for a loaded 2-core CI machine and still catches a quadratic parser.
    assert time.perf_counter() - start < 30


# --- against dtc ------------------------------------------------------------------------------


def _dtc(*args: str | Path) -> bytes:
    return subprocess.run(["dtc", "-qqq", *map(str, args)], check=True, capture_output=True).stdout


_VALUE = re.compile(r'"((?:[^"\\]|\\.)*)"|<([^>]*)>|\[([^\]]*)\]')


def _dts_value(text: str, kinds: set[str]) -> bytes:
    """Turn dtc's rendering of a value back into bytes: "strings", <cells>, [bytes]."""
    out, pos = bytearray(), 0
    for match in _VALUE.finditer(text):
        assert text[pos : match.start()].strip() in ("", ","), f"unparsed dts value: {text!r}"
        pos = match.end()
        string, cells, raw = match.groups()
        if string is not None:
            kinds.add("string")
            out += codecs.decode(string, "unicode_escape").encode("latin-1") + b"\0"
        elif cells is not None:
            kinds.add("cells")
            out += b"".join(struct.pack(">I", int(cell, 16)) for cell in cells.split())
        else:
            kinds.add("bytes")
            out += bytes.fromhex(raw)
    assert text[pos:].strip() == "", f"unparsed dts value: {text!r}"
    return bytes(out)


def _read_dts(text: str) -> tuple[list[tuple[int, int]], dict[str, dict[str, bytes]], set[str]]:
    """dtc -O dts output -> (memreserve, {node path: {property: raw bytes}}, value kinds seen).

    Enough of the dts grammar for what dtc writes from a dtb: one node or property a line.
    """
    reserve, nodes, kinds = [], {}, set()
    stack: list[str] = []
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line == "/dts-v1/;":
            continue
        if line.startswith("/memreserve/"):
            address, size = line.removeprefix("/memreserve/").rstrip(";").split()
            reserve.append((int(address, 16), int(size, 16)))
        elif line.endswith("{"):
            name = line[:-1].strip()
            path = "/" if name == "/" else f"{stack[-1].rstrip('/')}/{name}"
            stack.append(path)
            nodes[path] = {}
        elif line == "};":
            stack.pop()
        else:
            assert line.endswith(";"), f"unexpected dts line: {line!r}"
            name, eq, value = line[:-1].partition(" = ")
            nodes[stack[-1]][name] = _dts_value(value, kinds) if eq else b""
    assert not stack, "unbalanced dts"
    return reserve, nodes, kinds


@needs_dtc
@pytest.mark.parametrize("board", DTC_BOARDS)
def test_matches_dtc(dtb_corpus: Path, board: str) -> None:
    tree = load_fdt(dtb_corpus / board)
    reserve, expected, kinds = _read_dts(
        _dtc("-I", "dtb", "-O", "dts", dtb_corpus / board).decode()
    )
    ours = {node.path: node.properties for node in tree.walk()}
    assert list(ours) == list(expected)  # same nodes, same order
    for path, props in expected.items():
        assert list(ours[path]) == list(props), path  # same property names, same order
        assert ours[path] == props, path  # and every value, byte for byte
    assert tree.reserve_map == reserve
    assert {"string", "cells"} <= kinds  # [bytes] are rare; imx8mp-evk has some (see below)


@needs_dtc
def test_known_renderings(dtb_corpus: Path, imx8mp: DeviceTree) -> None:
    dts = _dtc("-I", "dtb", "-O", "dts", dtb_corpus / IMX8MP).decode()
    assert 'compatible = "fsl,imx8mp-evk\\0fsl,imx8mp";' in dts
    assert imx8mp.compatible() == ["fsl,imx8mp-evk", "fsl,imx8mp"]
    assert "#address-cells = <0x02>;" in dts
    assert imx8mp.root.prop_u32s("#address-cells") == [2]
    gpu = imx8mp.find("/soc@0/gpu@38000000")
    assert gpu is not None
    assert "reg = <0x38000000 0x8000>;" in dts
    assert gpu.prop_u32s("reg") == [0x38000000, 0x8000]
    assert gpu.prop_strings("clock-names") == ["core", "shader", "bus", "reg"]
    assert "fsl,clk-source = [00];" in dts  # a one-byte property: dtc's [bytes] rendering
    sources = [n.prop("fsl,clk-source") for n in imx8mp.walk() if "fsl,clk-source" in n.properties]
    assert sources and all(value == b"\0" for value in sources)


@needs_dtc
def test_version_16_blob(dtb_corpus: Path, tmp_path: Path) -> None:
    """dtc can still write the v16 format (no size_dt_struct); it must read the same."""
    v16 = _dtc("-I", "dtb", "-O", "dtb", "-V", "16", dtb_corpus / IMX8MP)
    tree = parse_fdt(v16, "v16.dtb")
    assert tree.version == 16
    assert tree.root == load_fdt(dtb_corpus / IMX8MP).root


# --- facts of a known board -------------------------------------------------------------------


def test_imx8mp_identity(imx8mp: DeviceTree) -> None:
    assert "fsl,imx8mp-evk" in imx8mp.compatible()
    assert "fsl,imx8mp" in imx8mp.compatible()
    assert imx8mp.model() == "NXP i.MX8MPlus EVK board"
    assert imx8mp.root.path == "/" and imx8mp.root.name == ""
    assert imx8mp.reserve_map == [] and imx8mp.boot_cpuid == 0


def test_imx8mp_aliases_resolve(imx8mp: DeviceTree) -> None:
    aliases = imx8mp.find("/aliases")
    assert aliases is not None and len(aliases.properties) >= 20
    for alias in aliases.properties:
        node = imx8mp.find(alias)
        assert node is not None, alias
        assert node.path == aliases.prop_str(alias)
    serial = imx8mp.find("serial0")
    assert serial is not None
    assert serial.path == "/soc@0/bus@30800000/serial@30860000"
    assert serial.name == "serial@30860000" and serial.unit_address == "30860000"
    assert serial.base_name == "serial"
    assert imx8mp.find("serial0:115200n8") is serial  # console= style options are not path
    assert imx8mp.find("nosuchalias") is None
    assert imx8mp.find("/soc@0/nosuchnode") is None


def test_find_paths(imx8mp: DeviceTree) -> None:
    assert imx8mp.find("/") is imx8mp.root
    cpu0 = imx8mp.find("/cpus/cpu@0")
    assert cpu0 is not None and cpu0.parent is imx8mp.find("/cpus")
    assert imx8mp.find("/cpus/cpu") is cpu0  # no unit address: the first match, like libfdt
    assert cpu0.prop_str("device_type") == "cpu"
    assert next(cpu0.walk()) is cpu0
    assert next(imx8mp.walk()) is imx8mp.root
    assert sum(1 for _ in imx8mp.walk()) == len({n.path for n in imx8mp.walk()})


def _interrupt_parent(node: Node) -> int | None:
    """The kernel's rule: the nearest `interrupt-parent`, on the node or an ancestor."""
    current: Node | None = node
    while current is not None:
        if "interrupt-parent" in current.properties:
            return current.prop_u32s("interrupt-parent")[0]
        current = current.parent
    return None


def test_imx8mp_interrupt_parents(imx8mp: DeviceTree) -> None:
    gic = imx8mp.by_phandle(imx8mp.root.prop_u32s("interrupt-parent")[0])
    assert gic is not None and "interrupt-controller" in gic.properties
    assert "arm,gic-v3" in gic.prop_strings("compatible")
    users = [n for n in imx8mp.walk() if "interrupts" in n.properties]
    assert len(users) > 50
    for node in users:
        controller = imx8mp.by_phandle(_interrupt_parent(node))
        assert controller is not None, node.path
        assert "interrupt-controller" in controller.properties, node.path
    assert imx8mp.by_phandle(0xFFFF_FFF0) is None


def test_imx8mp_vivante_nodes(imx8mp: DeviceTree) -> None:
    # Linux 6.1's imx8mp.dtsi has no NPU node (the VIPNano NPU at 0x38500000 was only added to
    # the dtsi later); "vivante,gc" there is the 3D GPU (GC7000UL) and the 2D GPU (GC520L).
    vivante = [n for n in imx8mp.walk() if "vivante,gc" in n.prop_strings("compatible")]
    assert [n.path for n in vivante] == ["/soc@0/gpu@38000000", "/soc@0/gpu@38008000"]
    assert all(n.status_ok for n in vivante)
    assert not any(n.unit_address == "38500000" for n in imx8mp.walk())


def test_status_and_decoders(imx8mp: DeviceTree) -> None:
    disabled = [n for n in imx8mp.walk() if n.prop_str("status") == "disabled"]
    assert disabled and not any(n.status_ok for n in disabled)
    assert imx8mp.root.status_ok  # no status property at all
    console = imx8mp.find("serial1")  # UART2, the EVK's console; serial0 (UART1) is disabled
    assert console is not None and console.status_ok and console.prop_str("status") == "okay"
    assert not imx8mp.find("serial0").status_ok
    assert imx8mp.root.prop("nosuch") is None and imx8mp.root.prop_str("nosuch") is None
    assert imx8mp.root.prop_strings("nosuch") == [] and imx8mp.root.prop_u32s("nosuch") == []
    cpus = imx8mp.find("/cpus")
    assert cpus is not None and cpus.prop_u64("#address-cells") == 1
    model = imx8mp.root.prop("model")
    assert model is not None and len(model) % 4  # a string whose length is not 4-aligned
    with pytest.raises(FdtError, match=r"imx8mp-evk\.dtb: /: property 'model' is \d+ bytes"):
        imx8mp.root.prop_u32s("model")
    with pytest.raises(FdtError, match="not a 32- or 64-bit number"):
        imx8mp.root.prop_u64("model")


# --- live-tree layout -------------------------------------------------------------------------


def test_materialize_round_trip(imx8mp: DeviceTree, tmp_path: Path) -> None:
    base = tmp_path / "sys" / "firmware" / "devicetree" / "base"
    materialize(imx8mp, base)
    serial = base / "soc@0" / "bus@30800000" / "serial@30860000"
    assert (serial / "compatible").read_bytes() == imx8mp.find("serial0").prop("compatible")
    assert (serial / "name").read_bytes() == b"serial\0"
    assert (base / "name").read_bytes() == b"\0"  # the kernel names the root too: ""

    live = read_tree_dir(base, source="fake-live")
    assert live.source == "fake-live"
    assert {n.path for n in live.walk()} == {n.path for n in imx8mp.walk()}
    for node in imx8mp.walk():
        back = live.find(node.path)
        assert back is not None, node.path
        assert back.properties == {**node.properties, "name": node.base_name.encode() + b"\0"}
    assert live.compatible() == imx8mp.compatible()
    assert live.find("serial0").path == "/soc@0/bus@30800000/serial@30860000"

    again = tmp_path / "again"
    materialize(live, again)  # a tree read back writes the same files
    assert read_tree_dir(again).root == live.root
    with pytest.raises(FileExistsError):
        materialize(imx8mp, base)


def test_read_tree_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FdtError, match="not a device-tree directory"):
        read_tree_dir(tmp_path / "missing")


LIVE = Path("/sys/firmware/devicetree/base")


@pytest.mark.skipif(not LIVE.is_dir(), reason="this machine has no live device tree")
def test_live_tree_reads() -> None:
    tree = read_tree_dir(LIVE)
    assert tree.root.path == "/"
    assert sum(1 for _ in tree.walk()) > 1


# --- malformed input --------------------------------------------------------------------------


def _header(data: bytes) -> dict[str, int]:
    fields = ["magic", "totalsize", "off_struct", "off_strings", "off_rsvmap", "version"]
    fields += ["last_comp", "boot_cpu", "size_strings", "size_struct"]
    return dict(zip(fields, struct.unpack_from(">10I", data), strict=True))


def _patch_u32(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack(">I", value) + data[offset + 4 :]


def _raises(data: bytes, *patterns: str) -> str:
    with pytest.raises(FdtError) as info:
        parse_fdt(data, "board.dtb")
    message = str(info.value)
    assert message.startswith("board.dtb: "), message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


def test_bad_magic_and_empty(imx8mp_bytes: bytes) -> None:
    _raises(b"\0\0\0\0" + imx8mp_bytes[4:], r"bad magic 0x00000000 \(not a flattened")
    _raises(b"", "empty")
    _raises(imx8mp_bytes[:3], "truncated")


def test_truncated(imx8mp_bytes: bytes) -> None:
    h = _header(imx8mp_bytes)
    size = f"0x{len(imx8mp_bytes):x}"
    _raises(imx8mp_bytes[:20], "truncated", "header")
    _raises(imx8mp_bytes[:39], "truncated", "header needs 40 bytes")
    mid_struct = h["off_struct"] + h["size_struct"] // 2
    _raises(imx8mp_bytes[:mid_struct], "truncated", f"says {size} bytes", f"is 0x{mid_struct:x}")
    mid_strings = h["off_strings"] + h["size_strings"] // 2
    _raises(imx8mp_bytes[:mid_strings], "truncated", f"0x{mid_strings:x}")


def test_lying_sizes(imx8mp_bytes: bytes) -> None:
    """Headers that point outside the blob: named block and offsets."""
    h = _header(imx8mp_bytes)
    cut = h["off_strings"] + 8  # a file cut here, and a header claiming it is whole
    short = _patch_u32(imx8mp_bytes[:cut], 4, cut)
    _raises(short, "truncated: strings block ends at", f"0x{cut:x}")
    huge_struct = _patch_u32(imx8mp_bytes, 36, 0x100000)
    _raises(huge_struct, "structure block ends at 0x", "totalsize")
    bad_offset = _patch_u32(imx8mp_bytes, 8, 0x7FFFFFF0)
    _raises(bad_offset, "structure block offset 0x7ffffff0 is outside")
    old = _patch_u32(imx8mp_bytes, 20, 3)
    _raises(old, "version 3 is too old")
    future = _patch_u32(imx8mp_bytes, 24, 18)
    _raises(future, "compatible back to 18")


def test_short_structure_block(imx8mp_bytes: bytes) -> None:
    h = _header(imx8mp_bytes)
    # size_dt_struct that ends inside the first child's name ("aliases" on this board)
    at = imx8mp_bytes.index(b"\0\0\0\x01aliases\0", h["off_struct"])
    _raises(_patch_u32(imx8mp_bytes, 36, at + 6 - h["off_struct"]), "unterminated node name")
    # one that stops before FDT_END
    end = h["off_struct"] + h["size_struct"]
    _raises(_patch_u32(imx8mp_bytes, 36, h["size_struct"] - 4), f"ends at 0x{end - 4:x} before")


def test_corrupt_tokens(imx8mp_bytes: bytes) -> None:
    h = _header(imx8mp_bytes)
    first = h["off_struct"] + 8  # after the root's FDT_BEGIN_NODE and its empty name
    assert struct.unpack_from(">I", imx8mp_bytes, first)[0] == 3  # FDT_PROP
    _raises(_patch_u32(imx8mp_bytes, first, 7), "unknown token 0x00000007", f"at 0x{first:x}")
    far = h["size_strings"] + 100
    _raises(
        _patch_u32(imx8mp_bytes, first + 8, far),
        f"property at 0x{first:x}",
        f"name offset 0x{far:x} is outside the strings block",
    )
    end = h["off_struct"] + h["size_struct"] - 4  # FDT_END; the root's FDT_END_NODE is before it
    _raises(_patch_u32(imx8mp_bytes, end - 4, 4), "FDT_END with 1 node", "unbalanced")
    _raises(_patch_u32(imx8mp_bytes, end, 2), "unbalanced FDT_END_NODE", f"at 0x{end:x}")


def test_nesting_limit(imx8mp_bytes: bytes) -> None:
    h = _header(imx8mp_bytes)
    first = h["off_struct"] + 8  # overwrite the root's first properties with nested nodes
    nested = b"\0\0\0\x01a\0\0\0" * 70
    deep = imx8mp_bytes[:first] + nested + imx8mp_bytes[first + len(nested) :]
    _raises(deep, "nested deeper than 64 levels", "/a/a/a")


def test_data_after_end_is_ignored(imx8mp_bytes: bytes) -> None:
    """Padding after FDT_END inside the structure block, and bytes after totalsize."""
    h = _header(imx8mp_bytes)
    end = h["off_struct"] + h["size_struct"]
    assert h["off_strings"] == end  # dtc's layout: strings follow the structure block
    padded = imx8mp_bytes[:end] + b"\xff" * 16 + imx8mp_bytes[end:] + b"trailing junk"
    for offset, value in ((4, h["totalsize"] + 16), (12, end + 16), (36, h["size_struct"] + 16)):
        padded = _patch_u32(padded, offset, value)
    assert parse_fdt(padded).root == parse_fdt(imx8mp_bytes).root


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FdtError, match=r"nosuch\.dtb: cannot read device tree"):
        load_fdt(tmp_path / "nosuch.dtb")
    with pytest.raises(FdtError, match=r"cannot read device tree"):
        load_fdt(tmp_path)  # a directory


def test_only_fdt_error_on_damage(dtb_corpus: Path) -> None:
    """Any cut or scribble gives FdtError or a tree, never another exception."""
    data = (dtb_corpus / "freescale/imx93-11x11-evk.dtb").read_bytes()
    h = _header(data)
    fixed_sizes = []
    for cut in [*range(0, 64), *range(64, len(data), 97)]:
        fixed_sizes.append(_patch_u32(data[:cut], 4, cut) if cut >= 8 else data[:cut])
    rng = random.Random(1716)
    scribbled = []
    for _ in range(1000):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(0, h["off_strings"] + h["size_strings"])
            damaged[at] = rng.randrange(256)
        scribbled.append(bytes(damaged))
    parsed = 0
    for blob in [*(data[:cut] for cut in range(0, len(data), 61)), *fixed_sizes, *scribbled]:
        try:
            tree = parse_fdt(blob, "imx93.dtb")
        except FdtError as exc:
            assert str(exc).startswith("imx93.dtb: ")
        else:
            parsed += 1
            for node in tree.walk():  # a damaged-but-valid tree still decodes safely
                node.prop_strings("compatible")
                node.prop_str("status")
    assert parsed > 0  # some scribbles only hit property values


# --- fuzzing and cycles -------------------------------------------------------------------------

_FUZZ_BOARDS = ("freescale/imx93-11x11-evk.dtb", "broadcom/bcm2711-rpi-4-b.dtb", IMX8MP)
_INTERESTING = (
    0,
    1,
    3,
    4,
    8,
    16,
    17,
    40,
    0x38,
    0xFF,
    0xFFFF,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFF8,
    0xFFFFFFFC,
    0xFFFFFFFF,
    0xD00DFEED,
)


@pytest.fixture(scope="module")
def fuzz_blobs(dtb_corpus: Path) -> list[bytes]:
    return [(dtb_corpus / board).read_bytes() for board in _FUZZ_BOARDS]


def _mutate(blob: bytes, kind: str, data: st.DataObject) -> bytes:
    if kind == "flip":
        out = bytearray(blob)
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(out) - 1), label="at")
            out[at] = data.draw(st.integers(0, 255), label="byte")
        return bytes(out)
    if kind == "truncate":
        cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
        out = blob[:cut]
        if cut >= 8 and data.draw(st.booleans(), label="fix totalsize"):
            out = _patch_u32(out, 4, cut)  # a header that claims the cut file is whole
        return out
    # header field rewrite: one of the ten u32 fields, an interesting or a random value
    field = data.draw(st.integers(0, 9), label="field")
    value = data.draw(st.sampled_from(_INTERESTING) | st.integers(0, 0xFFFFFFFF), label="value")
    return _patch_u32(blob, field * 4, value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    board=st.integers(0, len(_FUZZ_BOARDS) - 1),
    kind=st.sampled_from(["flip", "truncate", "header"]),
    data=st.data(),
)
def test_fuzz_damaged_real_dtbs(
    fuzz_blobs: list[bytes], board: int, kind: str, data: st.DataObject
) -> None:
    """Mutated real dtbs: FdtError with the source name, or a tree the audit can check."""
    blob = _mutate(fuzz_blobs[board], kind, data)
    try:
        tree = parse_fdt(blob, "fuzz.dtb")
    except FdtError as exc:
        assert str(exc).startswith("fuzz.dtb: ")
        return
    nodes = list(tree.walk())
    assert nodes[0] is tree.root and tree.root.path == "/"
    for node in nodes:
        assert node.path == "/" or node.parent is not None
        node.prop_strings("compatible")
        node.prop_str("status")
    findings = check_tree(tree, "fuzz.dtb")  # the DT rules never crash on a parsed tree
    assert {f.id for f in findings} == set(RULES)


def _prop_value_offset(data: bytes, node_name: bytes, prop: str) -> int:
    """Offset of `prop`'s value inside the node `node_name` of a real blob (dtc layout)."""
    h = _header(data)
    strings = data[h["off_strings"] : h["off_strings"] + h["size_strings"]]
    nameoff = strings.index(prop.encode() + b"\0")
    start = data.index(b"\0\0\0\x01" + node_name + b"\0", h["off_struct"])
    at = start
    while True:
        at = data.index(b"\0\0\0\x03", at + 4)
        length, off = struct.unpack_from(">II", data, at + 4)
        if off == nameoff and length == 4:
            return at + 12


def test_crafted_phandle_cycles(imx8mp_bytes: bytes) -> None:
    """A blob edited so that a node is its own interrupt parent and two nodes share a phandle.

    The flattened format cannot nest a node inside itself (the token stream is a strict
    tree; over-deep or unbalanced nesting is `test_nesting_limit` / `test_corrupt_tokens`), so
    cycles can only come through phandles. They parse, and the DT rules terminate on them.
    """
    tree = parse_fdt(imx8mp_bytes)
    gpc = next(
        n for n in tree.walk() if "phandle" in n.properties and "interrupt-parent" in n.properties
    )
    own = gpc.properties["phandle"]
    data = bytearray(imx8mp_bytes)
    at = _prop_value_offset(imx8mp_bytes, gpc.name.encode(), "interrupt-parent")
    data[at : at + 4] = own  # interrupt-parent = itself
    other = next(
        n
        for n in tree.walk()
        if "phandle" in n.properties and n is not gpc and n.path.startswith("/soc@0")
    )
    at = _prop_value_offset(imx8mp_bytes, other.name.encode(), "phandle")
    data[at : at + 4] = own  # a duplicate phandle
    cyclic = parse_fdt(bytes(data), "cyclic.dtb")
    node = cyclic.find(gpc.path)
    assert node is not None and node.properties["interrupt-parent"] == own
    assert cyclic.by_phandle(struct.unpack(">I", own)[0]) in (node, cyclic.find(other.path))
    findings = check_tree(cyclic, "cyclic.dtb")
    assert {f.id for f in findings} == set(RULES)
