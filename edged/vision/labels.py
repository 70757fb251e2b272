"""Label maps: class id -> name. Read from a text file in either common layout (one name
per line, the line's number its id; or `<id> <name>` per line, as Frigate's and TFLite's
label maps are), or the 80 COCO names YOLO-family detectors are trained on."""

from __future__ import annotations

from pathlib import Path

MAX_LABELMAP_BYTES = 1 << 20  # a label map is a few KB; a bound, not a limit anyone meets

COCO80 = (  # noqa: SIM905 (a word list reads better as words)
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant "
    "stop_sign parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe "
    "backpack umbrella handbag tie suitcase frisbee skis snowboard sports_ball kite "
    "baseball_bat baseball_glove skateboard surfboard tennis_racket bottle wine_glass cup "
    "fork knife spoon bowl banana apple sandwich orange broccoli carrot hot_dog pizza donut "
    "cake chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard "
    "cell_phone microwave oven toaster sink refrigerator book clock vase scissors teddy_bear "
    "hair_drier toothbrush"
).split()


class LabelmapError(ValueError):
    """A label map file that cannot be read; the message names the file and the line."""


def coco80() -> dict[int, str]:
    """The COCO names by the 0-based ids YOLO models use, with spaces (`traffic light`)."""
    return {i: name.replace("_", " ") for i, name in enumerate(COCO80)}


def read_labelmap(path: Path) -> dict[int, str]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_LABELMAP_BYTES + 1)
    except OSError as exc:
        raise LabelmapError(f"{path}: cannot read the label map: {exc.strerror or exc}") from None
    if len(data) > MAX_LABELMAP_BYTES:
        raise LabelmapError(f"{path}: larger than {MAX_LABELMAP_BYTES} bytes; not a label map")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LabelmapError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    lines = [line.strip() for line in text.splitlines()]
    numbered = [line for line in lines if line]
    labels: dict[int, str] = {}
    if numbered and all(line.split(maxsplit=1)[0].isdigit() for line in numbered):
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            head, _, name = line.partition(" ")
            if not name.strip():
                raise LabelmapError(f"{path}:{number}: id {head} has no name")
            ident = int(head)
            if ident in labels:
                raise LabelmapError(f"{path}:{number}: id {ident} given twice")
            labels[ident] = name.strip()
        return labels
    return {i: line for i, line in enumerate(lines) if line}


MAX_NAMES_CHARS = 1 << 16  # a model's class-name table: a few KB


def names_from_metadata(metadata: dict[str, str], where: str) -> dict[int, str]:
    """The class names a model file carries: an Ultralytics export's `names` entry, a Python
    dict literal of id -> name (`{0: 'person', 1: 'bicycle'}`), read as a literal only
    (ast.literal_eval: no code runs). LabelmapError says what is missing or wrong."""
    import ast

    text = metadata.get("names")
    if text is None:
        raise LabelmapError(
            f"{where}: the model's metadata has no class names (an Ultralytics export keeps "
            "them as 'names'); give a label map file"
        )
    if len(text) > MAX_NAMES_CHARS:
        raise LabelmapError(f"{where}: its 'names' metadata is over {MAX_NAMES_CHARS} characters")
    try:
        names = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise LabelmapError(
            f"{where}: its 'names' metadata is not a literal id -> name table"
        ) from None
    if isinstance(names, list):
        names = dict(enumerate(names))
    if not isinstance(names, dict) or not all(
        type(k) is int and k >= 0 and isinstance(v, str) and v for k, v in names.items()
    ):
        raise LabelmapError(f"{where}: its 'names' metadata is not a table of id -> name")
    return names
