"""A fallback validator for the JSON Schema subset that schema.json uses.

jsonschema is a declared dependency, but deployment hosts (the project's GPU machine is
one) may lack it, and loading a descriptor must not fail there. Errors mimic
jsonschema's (path, validator, message) so descriptor.py reports them the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

TYPES = {
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


@dataclass
class MiniError:
    absolute_path: tuple[Any, ...]
    validator: str
    validator_value: Any
    message: str
    instance: Any

    @property
    def path(self) -> tuple[Any, ...]:
        return self.absolute_path


def iter_errors(schema: Mapping[str, Any], inst: Any, path: tuple[Any, ...] = ()) -> Iterator[MiniError]:
    def err(rule: str, msg: str) -> MiniError:
        return MiniError(path, rule, schema[rule], msg, inst)

    if "type" in schema and not TYPES[schema["type"]](inst):
        yield err("type", f"{inst!r} is not of type {schema['type']!r}")
        return
    if "const" in schema and inst != schema["const"]:
        yield err("const", f"{schema['const']!r} was expected")
    if "enum" in schema and inst not in schema["enum"]:
        yield err("enum", f"{inst!r} is not one of {schema['enum']!r}")
    if TYPES["number"](inst):
        if "minimum" in schema and inst < schema["minimum"]:
            yield err("minimum", f"{inst!r} is less than the minimum of {schema['minimum']!r}")
        if "maximum" in schema and inst > schema["maximum"]:
            yield err("maximum", f"{inst!r} is greater than the maximum of {schema['maximum']!r}")
        if "exclusiveMinimum" in schema and inst <= schema["exclusiveMinimum"]:
            yield err("exclusiveMinimum", f"{inst!r} is less than or equal to the minimum of {schema['exclusiveMinimum']!r}")
    if isinstance(inst, str):
        if "minLength" in schema and len(inst) < schema["minLength"]:
            yield err("minLength", f"{inst!r} is too short")
        if "maxLength" in schema and len(inst) > schema["maxLength"]:
            yield err("maxLength", f"{inst!r} is too long")
        if "pattern" in schema and not re.search(schema["pattern"], inst):
            yield err("pattern", f"{inst!r} does not match {schema['pattern']!r}")
    if isinstance(inst, list):
        if "minItems" in schema and len(inst) < schema["minItems"]:
            yield err("minItems", f"{inst!r} should be non-empty")
        if schema.get("uniqueItems") and len({repr(x) for x in inst}) != len(inst):
            yield err("uniqueItems", f"{inst!r} has non-unique elements")
        if "items" in schema:
            for i, x in enumerate(inst):
                yield from iter_errors(schema["items"], x, (*path, i))
    if isinstance(inst, Mapping):
        for name in schema.get("required", []):
            if name not in inst:
                yield err("required", f"{name!r} is a required property")
        if "minProperties" in schema and len(inst) < schema["minProperties"]:
            yield err("minProperties", f"{dict(inst)!r} should be non-empty")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        unexpected = [k for k in inst if k not in props]
        if extra is False and unexpected:
            names = ", ".join(repr(k) for k in unexpected)
            yield err("additionalProperties", f"Additional properties are not allowed ({names} {'was' if len(unexpected) == 1 else 'were'} unexpected)")
        for k, v in inst.items():
            if k in props:
                yield from iter_errors(props[k], v, (*path, k))
            elif isinstance(extra, Mapping):
                yield from iter_errors(extra, v, (*path, k))
