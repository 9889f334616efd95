"""msgpack codec with type checks on decode.

`decode` never raises anything but ProtocolError: whatever arrives on a socket
(garbage, another version, a wrong field type) becomes one error with a
message naming what is wrong, which the socket layer logs before dropping it.
"""
from __future__ import annotations

import dataclasses
import operator
import typing
from functools import lru_cache

import msgpack

from pdd.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message


class ProtocolError(ValueError):
    pass


def encode(msg: Message) -> bytes:
    payload = {"t": msg.TYPE, "v": PROTOCOL_VERSION}
    payload.update(msg.__dict__)
    return msgpack.packb(payload, use_bin_type=True, default=_as_fields)


def _as_fields(obj):
    """Nested dataclasses (TokenItem, SamplingParams) travel as arrays of their
    fields in declaration order, without the trailing fields that hold their
    defaults: a step's TokenBatch holds hundreds of items, most of them a
    token and nothing else, and an array is a quarter of the bytes of a map and
    packs and unpacks several times faster (no key strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _field_values(type(obj))(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


# Defaults a trailing field may leave off the wire: constants only (a
# default_factory's value is a new object each time) of the types whose
# equality is exact (0 == False, so the type is compared as well).
_CONSTANT_DEFAULTS = (type(None), bool, int, float, str)


@lru_cache(maxsize=None)
def _field_values(cls):
    """obj -> the tuple of its field values up to the last one that differs
    from its default (msgpack packs a tuple as an array): generated code, a
    test a trailing field, as the builders are."""
    fields = dataclasses.fields(cls)
    get = operator.attrgetter(*(f.name for f in fields))
    full = get if len(fields) > 1 else (lambda obj: (get(obj),))
    trailing = 0
    for f in reversed(fields):
        if f.default is dataclasses.MISSING or type(f.default) not in _CONSTANT_DEFAULTS:
            break
        trailing += 1
    if not trailing:
        return full
    env = {"_full": full}
    lines = ["def values(o):"]
    for i in range(len(fields) - 1, len(fields) - 1 - trailing, -1):
        f = fields[i]
        env[f"_d{i}"] = f.default
        same = f"v is _d{i}" if f.default is None or type(f.default) is bool else \
            f"(type(v) is {type(f.default).__name__} and v == _d{i})"
        lines += [f"    v = o.{f.name}",
                  f"    if not ({same}):",
                  f"        return _full(o){'' if i == len(fields) - 1 else f'[:{i + 1}]'}"]
    kept = len(fields) - trailing
    lines.append(f"    return ({''.join(f'o.{f.name}, ' for f in fields[:kept])})")
    exec("\n".join(lines), env)   # noqa: S102 -- code generated from our own dataclasses
    return env["values"]


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"message must be a map, got {type(raw).__name__}")
    kind, version = raw.pop("t", None), raw.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_shown(version)}, expected {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None   # a list or map is not even hashable
    if cls is None:
        raise ProtocolError(f"unknown message type {_shown(kind)}")
    return _build(cls, raw, kind)


# What an error message quotes of a peer's value: the log line of one bad
# message stays a line, whatever the message holds.
_SHOWN_CHARS = 80
_SHOWN_NAMES = 8


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _names(names: list) -> str:
    """Field names for an error message: the first few, and how many more."""
    shown = ", ".join(_shown(n) for n in names[:_SHOWN_NAMES])
    more = len(names) - _SHOWN_NAMES
    return f"[{shown}{f', (+{more} more)' if more > 0 else ''}]"


def _build(cls, raw: dict, where: str):
    """An instance of message class `cls` from a decoded map, every field checked."""
    try:
        return _builder(cls, False)(raw)
    except _Mismatch as e:
        raise ProtocolError(f"{where}{''.join(reversed(e.path))}: {e.message}") from None


class _Mismatch(Exception):
    """A value that does not conform; `path` grows (innermost first) as it unwinds."""

    def __init__(self, message: str):
        self.message, self.path = message, []


# The checks are compiled once per type: a TokenBatch of a whole decode step
# carries hundreds of items, and the router decodes one per worker per step.
# Each type gets generated code that checks a conforming value inline (no call
# per field) and hands anything else to the field-by-field builder, which names
# what is wrong. A message is a map; a dataclass inside one is an array of its
# fields (`positional`).

@lru_cache(maxsize=None)
def _builder(cls, positional: bool):
    checked = _checked_builder(cls, positional)
    return (_fast_positional_builder if positional else _fast_builder)(cls, checked)


def _checked_builder(cls, positional: bool = False):
    spec = _fields(cls)
    names = frozenset(spec)
    order = list(spec)
    required = [name for name, (_, req) in spec.items() if req]
    convert = {name: _converter(hint) for name, (hint, _) in spec.items()}

    def build(raw):
        if positional:
            if not isinstance(raw, list):
                raise _Mismatch(f"expected a {cls.__name__} array of fields, got {type(raw).__name__}")
            if len(raw) > len(order):
                raise _Mismatch(f"{len(raw)} fields, a {cls.__name__} has {len(order)}")
            raw = dict(zip(order, raw))
        elif not isinstance(raw, dict):
            raise _Mismatch(f"expected a {cls.__name__} map, got {type(raw).__name__}")
        missing = [name for name in required if name not in raw]
        if missing:
            raise _Mismatch(f"missing field(s) {missing}")
        if not names.issuperset(raw):
            raise _Mismatch(f"unknown field(s) {_names(sorted(set(raw) - names, key=repr))}")
        for name, value in raw.items():
            try:
                raw[name] = convert[name](value)
            except _Mismatch as e:
                e.path.append(f".{name}")
                raise
        return cls(**raw)
    return build


_MISSING = object()


def _fast_builder(cls, checked):
    """Generated code for `cls`: a conforming map becomes an instance; anything
    else goes to `checked` untouched (nested values are only stored once every
    field passed), so its error names the field."""
    spec = _fields(cls)
    env = {"_cls": cls, "_checked": checked, "_names": frozenset(spec), "_MISSING": _MISSING,
           "_Mismatch": _Mismatch}
    lines = ["def build(raw):",
             "    if type(raw) is not dict or not _names.issuperset(raw):",
             "        return _checked(raw)"]
    nested = []
    if any(_optional_dataclass(hint) is not None for hint, _ in spec.values()):
        return checked    # none at a message's top level today: the checked path suffices
    for i, (name, (hint, required)) in enumerate(spec.items()):
        var = f"v{i}"
        lines.append(f"    {var} = raw.get({name!r}, _MISSING)")
        if required:
            lines += [f"    if {var} is _MISSING:", "        return _checked(raw)"]
        element = typing.get_args(hint)[0] if typing.get_origin(hint) is list and typing.get_args(hint) else None
        if dataclasses.is_dataclass(hint) or dataclasses.is_dataclass(element):
            one = dataclasses.is_dataclass(hint)
            env[f"_b{i}"] = _builder(hint if one else element, True)
            lines += [f"    if {var} is not _MISSING:",
                      f"        if not ({'True' if one else f'type({var}) is list'}):",
                      "            return _checked(raw)",
                      "        try:",
                      f"            {var} = {f'_b{i}({var})' if one else f'[_b{i}(x) for x in {var}]'}",
                      "        except _Mismatch:",
                      "            return _checked(raw)"]
            nested.append((name, var))
        else:
            env[f"_p{i}"] = _predicate(hint)
            test = _inline_check(hint, var) or f"_p{i}({var})"
            lines += [f"    if not ({var} is _MISSING or {test}):", "        return _checked(raw)"]
    for name, var in nested:
        lines.append(f"    if {var} is not _MISSING:\n        raw[{name!r}] = {var}")
    lines.append("    return _cls(**raw)")
    exec("\n".join(lines), env)   # noqa: S102 -- code generated from our own type hints
    return env["build"]


def _fast_positional_builder(cls, checked):
    """Generated code for a nested `cls` sent as an array of its fields, all of
    them or the first ones (what `encode` sends: the trailing defaults left
    off), a branch an array length, the shortest first; anything else goes to
    `checked`."""
    spec = _fields(cls)
    if any(f.kw_only or not f.init for f in dataclasses.fields(cls)):
        return checked    # built by keyword (cls(**fields)) there
    if any(dataclasses.is_dataclass(hint) or _nested_list(hint) for hint, _ in spec.values()):
        return checked    # no such nesting below a nested dataclass today: the checked path suffices
    env = {"_cls": cls, "_checked": checked}
    lines = ["def build(raw):", "    if type(raw) is not list:", "        return _checked(raw)", "    n = len(raw)"]
    required = sum(req for _, req in spec.values())
    for length in range(required, len(spec) + 1):
        names = [f"v{i}" for i in range(length)]
        lines.append(f"    if n == {length}:")
        if names:
            lines.append(f"        {', '.join(names)}{',' if len(names) == 1 else ''} = raw")
        for i, (var, (hint, _)) in enumerate(zip(names, spec.values())):
            optional = _optional_dataclass(hint)
            if optional is not None:   # SamplingParams.structured_output: None, or an array of its fields
                env[f"_b{i}"], env["_Mismatch"] = _builder(optional, True), _Mismatch
                lines += [f"        if {var} is not None:", "            try:", f"                {var} = _b{i}({var})",
                          "            except _Mismatch:", "                return _checked(raw)"]
                continue
            env[f"_p{i}"] = _predicate(hint)
            test = _inline_check(hint, var) or f"_p{i}({var})"
            lines += [f"        if not {test}:", "            return _checked(raw)"]
        lines.append(f"        return _cls({', '.join(names)})")
    lines.append("    return _checked(raw)")
    exec("\n".join(lines), env)   # noqa: S102 -- code generated from our own type hints
    return env["build"]


def _optional_dataclass(hint):
    """The dataclass D of a hint `D | None`; None for any other hint."""
    args = typing.get_args(hint)
    if ((typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType") and len(args) == 2
            and type(None) in args):
        inner = args[0] if args[1] is type(None) else args[1]
        if dataclasses.is_dataclass(inner):
            return inner
    return None


def _nested_list(hint) -> bool:
    args = typing.get_args(hint)
    return typing.get_origin(hint) is list and bool(args) and dataclasses.is_dataclass(args[0])


def _inline_check(hint, var: str) -> str | None:
    """A Python expression testing `var` against `hint` as _predicate does, for
    the common hints; None: call the predicate."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        parts = [_inline_check(h, var) for h in args]
        return None if None in parts else "(" + " or ".join(parts) + ")"
    simple = {type(None): f"{var} is None", bool: f"({var} is True or {var} is False)",
              int: f"type({var}) is int", float: f"(type({var}) is float or type({var}) is int)",
              str: f"type({var}) is str", bytes: f"type({var}) is bytes",
              list: f"type({var}) is list", dict: f"type({var}) is dict"}
    if hint is typing.Any:
        return "True"
    if hint in simple:
        return simple[hint]
    if hint == list[int]:   # most often a decode step's one token: tested without a list of tests
        return (f"(type({var}) is list and (len({var}) == 1 and type({var}[0]) is int "
                f"or all([type(x) is int for x in {var}])))")
    return None


@lru_cache(maxsize=None)
def _converter(hint):
    """A function: the value checked against `hint` (raising _Mismatch), nested
    dataclass arrays made instances."""
    if dataclasses.is_dataclass(hint):
        return _builder(hint, True)
    optional = _optional_dataclass(hint)
    if optional is not None:
        build = _builder(optional, True)
        return lambda value: None if value is None else build(value)
    if _nested_list(hint):
        item = _builder(typing.get_args(hint)[0], True)

        def items(value):
            if not isinstance(value, list):
                raise _Mismatch(f"expected a list, got {type(value).__name__}")
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(item(v))
                except _Mismatch as e:
                    e.path.append(f"[{i}]")
                    raise
            return out
        return items
    ok = _predicate(hint)

    def check(value):
        if not ok(value):
            raise _Mismatch(f"expected {_describe(hint)}, got {type(value).__name__}")
        return value
    return check


@lru_cache(maxsize=None)
def _predicate(hint):
    """value -> whether it conforms to `hint` (exact msgpack types: bool is no int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        alternatives = [_predicate(h) for h in args]
        return lambda v: any(p(v) for p in alternatives)
    if hint is type(None):
        return lambda v: v is None
    if hint is typing.Any:
        return lambda v: True
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    if hint is bytes:
        return lambda v: isinstance(v, bytes)
    if hint is list[int]:   # the hot one: token ids
        return lambda v: type(v) is list and all(type(x) is int for x in v)
    if origin is list or hint is list:
        element = _predicate(args[0]) if args else None
        return lambda v: isinstance(v, list) and (element is None or all(element(x) for x in v))
    if origin is dict or hint is dict:
        key, val = (_predicate(args[0]), _predicate(args[1])) if args else (None, None)
        return lambda v: isinstance(v, dict) and (key is None or all(key(k) and val(x) for k, x in v.items()))
    return lambda v: True


@lru_cache(maxsize=None)
def _fields(cls) -> dict[str, tuple[object, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out[f.name] = (hints[f.name], required)
    return out


def _describe(hint) -> str:
    if typing.get_args(hint):   # list[int], dict[str, float]: the element types are part of what is wrong
        return str(hint)
    return getattr(hint, "__name__", None) or str(hint)
