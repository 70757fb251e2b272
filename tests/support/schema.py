"""The payload schemas in docs/schema (JSON Schema 2020-12), checked with jsonschema: every MQTT
and log payload a test sees is validated against its file, `$ref`s between the files resolved
by their `$id`s."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator, validators
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.support import REPO

SCHEMAS = REPO / "docs" / "schema"

# Keywords that only annotate: jsonschema ignores them, and so may we. ("then" and "else" are
# read by "if", the only ones jsonschema validates without a function of their own.)
_ANNOTATIONS = {
    "$schema",
    "$id",
    "$defs",
    "$comment",
    "$anchor",
    "$vocabulary",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
}
# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_ONE = {
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
}
_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}
_MAP = {"properties", "patternProperties", "$defs", "dependentSchemas"}


def _is_integer(checker: Any, instance: Any) -> bool:
    """A JSON integer as Python's json reads it: 2020-12 also counts 1.0, which a seq, a count
    or a bdSeq sent as a float must not pass for."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def unknown_keywords(node: Any) -> set[str]:
    """Keywords in a schema that neither validate nor annotate: a typo ("require") that
    jsonschema would silently ignore, so the schema would check less than it says."""
    if not isinstance(node, dict):
        return set()
    found = set(node) - set(Draft202012Validator.VALIDATORS) - {"then", "else"} - _ANNOTATIONS
    for key, value in node.items():
        if key in _ONE:
            found |= unknown_keywords(value)
        elif key in _LIST:
            found |= set().union(*map(unknown_keywords, value))
        elif key in _MAP:
            found |= set().union(*map(unknown_keywords, value.values()))
    return found


@cache
def _loaded(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def schema(name: str) -> dict:
    """docs/schema/NAME.schema.json, a copy the caller may change."""
    return json.loads(json.dumps(_loaded(name)))


def _as_ours(name: str) -> dict:
    """The schema without its "$schema" (2020-12, as test_mqtt asserts): at a `$ref` into a
    file that names its dialect, jsonschema would go on with its stock 2020-12 validator and
    drop our integer."""
    return {k: v for k, v in _loaded(name).items() if k != "$schema"}


@cache
def _validator(name: str) -> Draft202012Validator:
    """NAME's validator, every schema file it may `$ref` checked against the 2020-12
    meta-schema and for unknown keywords first."""
    names = [f.name.removesuffix(".schema.json") for f in SCHEMAS.glob("*.schema.json")]
    for each in names:
        _Validator.check_schema(_loaded(each))
        unknown = unknown_keywords(_loaded(each))
        assert not unknown, f"{each}.schema.json: unknown keywords {sorted(unknown)}"
    registry = Registry().with_resources(
        (_loaded(n)["$id"], DRAFT202012.create_resource(_as_ours(n))) for n in names
    )
    return _Validator(_as_ours(name), registry=registry, format_checker=_Validator.FORMAT_CHECKER)


def errors(payload: Any, name: str) -> list[str]:
    """What is wrong with `payload` as a NAME payload, one line per violation (none: valid)."""
    found = sorted(_validator(name).iter_errors(payload), key=lambda e: list(map(str, e.path)))
    # The schema path too: jsonschema leaves the instance path out for a `false` subschema.
    return [
        f"{e.json_path}: {e.message} (schema: {'/'.join(map(str, e.schema_path))})" for e in found
    ]


def check(kind: str, payload: dict) -> None:
    problems = errors(payload, kind)
    assert not problems, f"{kind} payload {payload} breaks its schema: {problems}"
