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
    spec = _fields(cls)
    missing = [name for name, (_, required) in spec.items() if required and name not in raw]
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {missing}")
    unknown = set(raw) - set(spec)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name, value in raw.items():
        raw[name] = _convert(value, spec[name][0], f"{where}.{name}")
    return cls(**raw)


def _convert(value, hint, where: str):
    """`value` checked against `hint`; nested dataclass maps become instances."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a {hint.__name__} map, got {type(value).__name__}")
        return _build(hint, value, where)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if not _conforms(value, hint):
        raise ProtocolError(f"{where}: expected {_describe(hint)}, got {type(value).__name__}")
    return value


@lru_cache(maxsize=None)
def _fields(cls) -> dict[str, tuple[object, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out[f.name] = (hints[f.name], required)
    return out


def _conforms(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is typing.Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is bytes:
        return isinstance(value, bytes)
    if origin is list or hint is list:
        if not isinstance(value, list):
            return False
        args = typing.get_args(hint)
        return not args or all(_conforms(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        args = typing.get_args(hint)
        return not args or all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    return True


def _describe(hint) -> str:
    if typing.get_args(hint):   # list[int], dict[str, float]: the element types are part of what is wrong
        return str(hint)
    return getattr(hint, "__name__", None) or str(hint)
