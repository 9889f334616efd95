"""msgpack codec with type checks on decode.

`decode` never raises anything but ProtocolError: whatever arrives on a socket
(garbage, another version, a wrong field type) becomes one error with a
message naming what is wrong, which the socket layer logs before dropping it.
"""
from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache

import msgpack

from pdd.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message


class ProtocolError(ValueError):
    pass


def encode(msg: Message) -> bytes:
    payload = {"t": msg.TYPE, "v": PROTOCOL_VERSION}
    payload.update(msg.__dict__)
    return msgpack.packb(payload, use_bin_type=True, default=_as_map)


def _as_map(obj):
    """Nested dataclasses (TokenItem, SamplingParams) travel as maps of their fields."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return obj.__dict__
    raise TypeError(f"cannot encode {type(obj).__name__}")


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"message must be a map, got {type(raw).__name__}")
    kind, version = raw.pop("t", None), raw.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    return _build(cls, raw, kind)


def _build(cls, raw: dict, where: str):
    """An instance of dataclass `cls` from a decoded map, every field checked."""
    try:
        return _builder(cls)(raw)
    except _Mismatch as e:
        raise ProtocolError(f"{where}{''.join(reversed(e.path))}: {e.message}") from None


class _Mismatch(Exception):
    """A value that does not conform; `path` grows (innermost first) as it unwinds."""

    def __init__(self, message: str):
        self.message, self.path = message, []


# The checks are compiled once per type: a TokenBatch of a whole decode step
# carries hundreds of items, and the router decodes one per worker per step.

@lru_cache(maxsize=None)
def _builder(cls):
    spec = _fields(cls)
    names = frozenset(spec)
    required = [name for name, (_, req) in spec.items() if req]
    convert = {name: _converter(hint) for name, (hint, _) in spec.items()}

    def build(raw):
        if not isinstance(raw, dict):
            raise _Mismatch(f"expected a {cls.__name__} map, got {type(raw).__name__}")
        missing = [name for name in required if name not in raw]
        if missing:
            raise _Mismatch(f"missing field(s) {missing}")
        if not names.issuperset(raw):
            raise _Mismatch(f"unknown field(s) {sorted(set(raw) - names)}")
        for name, value in raw.items():
            try:
                raw[name] = convert[name](value)
            except _Mismatch as e:
                e.path.append(f".{name}")
                raise
        return cls(**raw)
    return build


@lru_cache(maxsize=None)
def _converter(hint):
    """A function: the value checked against `hint` (raising _Mismatch), nested
    dataclass maps made instances."""
    if dataclasses.is_dataclass(hint):
        return _builder(hint)
    if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        item = _builder(typing.get_args(hint)[0])

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
