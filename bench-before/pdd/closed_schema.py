"""JSON schemas with their objects closed, as vLLM's default backend reads
them (xgrammar in strict mode): an object admits the properties its schema
names and no others, unless the schema says so (`additionalProperties` true
or a schema, `unevaluatedProperties`). llguidance follows JSON Schema, where
an object without `additionalProperties` takes any extra key: a model then
writes keys the client's parser does not know, or never ends the object.

`closed` writes `"additionalProperties": false` into every object schema that
leaves it unset, found anywhere a subschema may be (properties, items,
anyOf/oneOf, $defs, ...). Where schemas are intersected, closing each part
would refuse what another part names (`allOf` of two objects; an object with
sibling `anyOf`/`$ref`): those parts, and the $defs they reference, stay as
written (open, as before).
"""
from __future__ import annotations

# Keywords that make a schema without "type" an object's.
OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")
# Keywords by which the schema itself says what extra keys may be.
OPENERS = ("additionalProperties", "unevaluatedProperties")
# Where subschemas are: one, a map of them, a list of them ("items" is either).
ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
       "contains", "not", "if", "then", "else", "propertyNames")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
BRANCHES = ("anyOf", "oneOf", "allOf")

Path = tuple[str, ...]


def closed(schema: dict) -> dict:
    """A copy of `schema` with its objects closed (see the module's docstring);
    `schema` itself is not changed."""
    keep_open: set[Path] = set()
    _find_intersections(schema, (), keep_open)
    return _close(schema, (), keep_open)


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    if isinstance(kind, str):
        return kind == "object"
    if isinstance(kind, list):
        return "object" in kind
    return any(k in node for k in OBJECT_KEYS)


def _intersects(node: dict) -> bool:
    """Whether the schema is the intersection of parts (whose closing would
    refuse each other's properties)."""
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return True
    return _is_object(node) and any(k in node for k in (*BRANCHES, "$ref"))


def _children(node: dict, path: Path):
    """(subschema, its path) of every keyword of `node` that holds schemas."""
    for key in ONE:
        value = node.get(key)
        if isinstance(value, dict):
            yield value, (*path, key)
    for key in MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield sub, (*path, key, name)
    for key in LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    yield sub, (*path, key, str(i))


def _pointer(ref) -> Path | None:
    """The path a local $ref ("#/$defs/a") points at; None for any other."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    parts = [p for p in ref[1:].split("/") if p]
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in parts)


def _find_intersections(node: dict, path: Path, keep_open: set[Path]) -> None:
    """Add to keep_open the paths of the schemas that are parts of an
    intersection (and the schema they make), and what those parts reference."""
    if _intersects(node):
        keep_open.add(path)
        parts = [(node, path)]
        for key in BRANCHES:
            value = node.get(key)
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    if isinstance(sub, dict):
                        keep_open.add((*path, key, str(i)))
                        parts.append((sub, (*path, key, str(i))))
        for part, _ in parts:
            target = _pointer(part.get("$ref"))
            if target is not None:
                keep_open.add(target)
    for sub, sub_path in _children(node, path):
        _find_intersections(sub, sub_path, keep_open)


def _close(node: dict, path: Path, keep_open: set[Path]) -> dict:
    out = dict(node)
    for sub, sub_path in _children(node, path):
        closed_sub = _close(sub, sub_path, keep_open)
        where = sub_path[len(path):]
        if len(where) == 1:
            out[where[0]] = closed_sub
        else:   # in a map or a list: copied once, then filled in
            key, name = where
            holder = out[key]
            if holder is node[key]:
                holder = out[key] = dict(holder) if isinstance(holder, dict) else list(holder)
            holder[int(name) if isinstance(holder, list) else name] = closed_sub
    # A const or enum says the whole value (an object among them keeps its keys).
    if (_is_object(node) and path not in keep_open and not any(k in node for k in OPENERS)
            and "const" not in node and "enum" not in node):
        out["additionalProperties"] = False
    return out
