"""Typed, field-by-field access to an OpenAI request body.

Every accessor raises `APIError` (400) whose message says what to fix and whose
`param` names the field, the way OpenAI's own errors do, so a client sees
"'temperature' must be a number, got string" instead of a stack trace.
A JSON null counts as "absent" everywhere: OpenAI clients send explicit nulls
for optional fields they do not set.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

log = logging.getLogger(__name__)


class APIError(Exception):
    """An OpenAI-shaped error: status code + {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):   # before int: bool is an int subclass
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def wrong_type(param: str, kind: str, value: Any) -> APIError:
    return bad(param, f"'{param}' must be {kind}, got {json_type(value)}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return is_int(value) or isinstance(value, float)


def load_object(body: bytes) -> dict:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got JSON {json_type(obj)}")
    return obj


class ReadFields(Mapping):
    """A JSON object that remembers which of its fields were looked at (get,
    [], in): what no parser read is what the server ignored."""

    def __init__(self, obj: Mapping[str, Any]):
        self._obj = obj
        self._read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self._read.add(name)
        return self._obj[name]

    def get(self, name: str, default: Any = None) -> Any:
        self._read.add(name)
        return self._obj.get(name, default)

    def __contains__(self, name: object) -> bool:
        self._read.add(name)
        return name in self._obj

    def __iter__(self):
        return iter(self._obj)

    def __len__(self) -> int:
        return len(self._obj)

    def unread(self) -> tuple[str, ...]:
        return tuple(name for name in self._obj if name not in self._read)


class Fields:
    """Typed getters over a request body (or a nested object of it, whose
    fields are then named `prefix + name` in errors, e.g. "messages[2].role").
    Each returns `default` when the field is missing or null, else the checked
    value. Every field read, through a getter or `obj`, is marked: `unread()`
    names the fields of the body nothing looked at."""

    def __init__(self, obj: Mapping[str, Any], prefix: str = ""):
        self.obj = obj if isinstance(obj, ReadFields) else ReadFields(obj)
        self.prefix = prefix

    def unread(self) -> tuple[str, ...]:
        return self.obj.unread()

    def param(self, name: str) -> str:
        return self.prefix + name

    def _typed(self, name: str, check: Callable[[Any], bool], kind: str) -> Any:
        """The field's value (None: missing or null), refused as not `kind` unless check(value)."""
        value = self.obj.get(name)
        if value is not None and not check(value):
            raise wrong_type(self.param(name), kind, value)
        return value

    def integer(self, name: str, default: int | None = None, *, lo: int | None = None,
                hi: int | None = None) -> int | None:
        value = self._typed(name, is_int, "an integer")
        if value is None:
            return default
        _check_range(self.param(name), value, lo, hi)
        return value

    def number(self, name: str, default: float | None = None, *, lo: float | None = None,
               hi: float | None = None, lo_exclusive: bool = False) -> float | None:
        value = self._typed(name, is_number, "a number")
        if value is None:
            return default
        param = self.param(name)
        if lo_exclusive and lo is not None and value <= lo:
            raise bad(param, f"'{param}' must be > {lo} and <= {hi}, got {value}")
        _check_range(param, value, lo, hi)
        return float(value)

    def boolean(self, name: str, default: bool | None = None) -> bool | None:
        value = self._typed(name, lambda v: isinstance(v, bool), "a boolean")
        return default if value is None else value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self._typed(name, lambda v: isinstance(v, str), "a string")
        return default if value is None else value

    def mapping(self, name: str) -> dict | None:
        return self._typed(name, lambda v: isinstance(v, dict), "an object")

    def array(self, name: str) -> list | None:
        return self._typed(name, lambda v: isinstance(v, list), "an array")


# Ignored field names are logged once per process, up to this many: a client
# inventing names grows neither the set nor the log without end.
MAX_LOGGED_IGNORED = 256
# What a response header lists of them (longer or odd names are only counted).
MAX_LISTED_IGNORED = 32
MAX_LISTED_NAME_CHARS = 64
_logged_ignored: set[str] = set()


def say_ignored(names: Sequence[str]) -> str | None:
    """Fields a request carried that nothing read: each name logged at WARNING
    the first time; the value of the header that lists them (None: none)."""
    if not names:
        return None
    for name in names:
        if name in _logged_ignored or len(_logged_ignored) > MAX_LOGGED_IGNORED:
            continue
        _logged_ignored.add(name)
        if len(_logged_ignored) > MAX_LOGGED_IGNORED:
            log.warning("more request fields pdd does not know were ignored; no more of their names are logged")
        else:
            log.warning("request field %r is not one pdd knows: accepted and ignored (listed in the response's "
                        "X-Pdd-Ignored-Fields header; logged once)", name[:MAX_LISTED_NAME_CHARS])
    listed = [n for n in names if len(n) <= MAX_LISTED_NAME_CHARS and n.isascii() and n.isprintable()
              and "," not in n][:MAX_LISTED_IGNORED]
    more = len(names) - len(listed)
    return ", ".join(listed + ([f"(+{more} more)"] if more else []))


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise bad(name, f"'{name}' must be between {lo} and {hi}, got {value}")
    if lo is not None and value < lo:
        raise bad(name, f"'{name}' must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(name, f"'{name}' must be <= {hi}, got {value}")


# Without the vocabulary size, a token id must still fit the int64 fields it
# travels in (msgpack cannot encode a larger integer).
_INT64_LIMIT = 1 << 63


def token_ids(param: str, value: list, vocab_size: int | None = None) -> list[int]:
    """A list of token ids: non-negative JSON integers (true/false are not ids),
    below `vocab_size` when it is known."""
    limit = vocab_size or _INT64_LIMIT
    for i, t in enumerate(value):
        if not is_int(t) or t < 0:
            shown = t if is_int(t) else json_type(t)
            raise bad(param, f"'{param}' must contain only non-negative integer token ids, "
                             f"got {shown} at index {i}")
        if t >= limit:
            where = f"the vocabulary [0, {vocab_size})" if vocab_size else "int64"
            raise bad(param, f"'{param}': token id {t} at index {i} is outside {where}")
    return value


# ---- OpenAI features we do not implement: refuse loudly rather than ignore ----

def unsupported(name: str, why: str = "") -> APIError:
    return bad(name, f"'{name}' is not supported{why}")


def reject_unless(f: Fields, name: str, neutral: float) -> None:
    """A number we accept only at the value that changes nothing (a penalty of 0 or 1)."""
    if f.number(name, neutral) != neutral:
        raise unsupported(name, f" (only {neutral:g} is accepted)")


def reject_nonempty(f: Fields, name: str) -> None:
    value = f.obj.get(name)
    if value:   # None, {}, [] and "" all mean "not used"
        raise unsupported(name)


def reject_tool_choice(f: Fields, name: str) -> None:
    """`function_call` (the deprecated form of tool_choice): "none" and "auto"
    both mean plain text without `functions`, so clients that always send them
    still work; anything else needs `tools` and `tool_choice`."""
    value = f.obj.get(name)
    if value is None or value in ("none", "auto"):
        return
    raise unsupported(name, f" (only \"none\" or \"auto\"; use 'tools' and 'tool_choice'), "
                            f"got {orjson.dumps(value).decode()}")
