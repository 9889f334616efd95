"""Data-plane frames: a msgpack header, the raw page bytes, and a msgpack ack.

A pages message is two ZeroMQ frames, [header, payload]. The payload is the
bytes of a contiguous CPU tensor [2, n, block_size, kv_heads, head_dim] in the
dtype the header names; it is sent as its own frame so it is never copied into
msgpack. bf16 has no numpy dtype, so tensors travel as uint8 views.

A done message is one frame, the last of a request's stream (tcp, local): it
names how many pages messages came before it (its `seq`) and carries the
prefill side's handoff (the first token); it is answered by an ack like a
pages message.

A control message (cuda_ipc, nixl: open the pool, begin / commit / end a
one-sided write) is one frame, answered by one "reply" frame carrying the same
token. A commit carries the handoff as the done message does.

A write notification (nixl) is not a data-socket frame: NIXL delivers it to
the decode worker's agent once the write it rides on has landed. It names the
request, lease, pool incarnation and KV layout (by digest) the write was made
under, and the blocks it wrote; the decode side checks them before a commit
is accepted. A write into the decode worker's landing region
(pdd.transfer.nixl_landing) names the range it landed in (`landing`, its
offset; -1 or absent: straight into the blocks) and where in it each block's
pages went (`places`, one per block). A writer asks for a range in
its begin (`landing`: true); a decode worker that has none, or predates them,
grants none and the writer writes into the blocks, so either side may be the
older one.
"""
from __future__ import annotations

from typing import Any

import hashlib

import msgpack
import torch

VERSION = 2   # 2: a request's last message carries the handoff (the decode side starts on it)
_MAX_HEADER_BYTES = 1 << 20  # a header lists block ids: generous, but bounded


class WireError(ValueError):
    """A frame that does not decode into a well-formed header or ack."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_uint_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v)


# Field name -> (checker, expected-type description) for each kind of frame.
_PAGES_FIELDS = {
    "v": (_is_int, "int"),
    "kind": (lambda v: v == "pages", "'pages'"),
    "request_id": (lambda v: isinstance(v, str), "str"),
    "lease_id": (lambda v: isinstance(v, str), "str"),
    "layer": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
    "dst_block_ids": (_is_uint_list, "list of non-negative ints"),
    "dtype": (lambda v: isinstance(v, str), "str"),
    "shape": (_is_uint_list, "list of non-negative ints"),
    "layout": (lambda v: isinstance(v, dict), "map"),
    "seq": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
}

_ACK_FIELDS = {
    "v": (_is_int, "int"),
    "kind": (lambda v: v == "ack", "'ack'"),
    "request_id": (lambda v: isinstance(v, str), "str"),
    "seq": (_is_int, "int"),
    "ok": (lambda v: isinstance(v, bool), "bool"),
    "error": (lambda v: isinstance(v, str), "str"),
}


_IS_STR = (lambda v: isinstance(v, str), "str")


def _is_handoff(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and _is_int(v.get("first_token"))
                         and (v.get("logprobs") is None or isinstance(v.get("logprobs"), list))
                         and _is_int(v.get("num_cached_tokens")) and v["num_cached_tokens"] >= 0)


_HANDOFF = (_is_handoff, "nil or a map {first_token: int, logprobs: list | nil, num_cached_tokens: int >= 0}")

_DONE_FIELDS = {
    "v": (_is_int, "int"),
    "kind": (lambda v: v == "done", "'done'"),
    "request_id": _IS_STR,
    "lease_id": _IS_STR,
    "seq": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
    "handoff": _HANDOFF,
}

# Control messages: kind -> fields beyond v, kind, token.
_CONTROL_FIELDS = {
    "ipc_open": {"layout": (lambda v: isinstance(v, dict), "map")},
    "ipc_begin": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR},
    "ipc_commit": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR, "handoff": _HANDOFF},
    "ipc_end": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR},
    "nixl_open": {"layout": (lambda v: isinstance(v, dict), "map")},
    "nixl_begin": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR},
    "nixl_commit": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR, "handoff": _HANDOFF,
                    "writes": (lambda v: _is_int(v) and v >= 0, "non-negative int")},
    "nixl_end": {"request_id": _IS_STR, "lease_id": _IS_STR, "pool_id": _IS_STR},
}

_WRITE_NOTIF_FIELDS = {
    "v": (_is_int, "int"),
    "kind": (lambda v: v == "nixl_write", "'nixl_write'"),
    "request_id": _IS_STR,
    "lease_id": _IS_STR,
    "pool_id": _IS_STR,
    "layout_id": _IS_STR,
    "seq": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
    "layer": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
    "dst_block_ids": (_is_uint_list, "list of non-negative ints"),
    "nbytes": (lambda v: _is_int(v) and v >= 0, "non-negative int"),
}

_REPLY_FIELDS = {
    "v": (_is_int, "int"),
    "kind": (lambda v: v == "reply", "'reply'"),
    "token": (_is_int, "int"),
    "ok": (lambda v: isinstance(v, bool), "bool"),
    "error": _IS_STR,
    "data": (lambda v: isinstance(v, dict), "map"),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WireError(f"unknown dtype {name!r}")
    return dt


def encode_pages_header(*, request_id: str, lease_id: str, layer: int, dst_block_ids: list[int],
                        dtype: torch.dtype | str, shape: list[int], layout: dict, seq: int) -> bytes:
    return msgpack.packb({
        "v": VERSION, "kind": "pages", "request_id": request_id, "lease_id": lease_id,
        "layer": int(layer), "dst_block_ids": [int(b) for b in dst_block_ids],
        "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype),
        "shape": [int(s) for s in shape], "layout": layout, "seq": int(seq),
    })


def encode_done(*, request_id: str, lease_id: str, seq: int, handoff: dict | None) -> bytes:
    return msgpack.packb({"v": VERSION, "kind": "done", "request_id": request_id, "lease_id": lease_id,
                          "seq": int(seq), "handoff": handoff})


def encode_ack(request_id: str, seq: int, ok: bool, error: str = "") -> bytes:
    return msgpack.packb({"v": VERSION, "kind": "ack", "request_id": request_id, "seq": int(seq),
                          "ok": bool(ok), "error": error})


def encode_control(kind: str, token: int, **fields) -> bytes:
    assert kind in _CONTROL_FIELDS, kind
    return msgpack.packb({"v": VERSION, "kind": kind, "token": int(token), **fields})


def encode_reply(token: int, ok: bool, error: str = "", **data) -> bytes:
    return msgpack.packb({"v": VERSION, "kind": "reply", "token": int(token), "ok": bool(ok),
                          "error": error, "data": data})


def layout_digest(layout: dict) -> str:
    """A short fingerprint of a KV layout descriptor (its to_dict()): what a
    write notification names, so the check per write costs one string compare."""
    return hashlib.sha256(msgpack.packb(sorted(layout.items()))).hexdigest()[:16]


def encode_write_notif(*, request_id: str, lease_id: str, pool_id: str, layout_id: str, seq: int, layer: int,
                       dst_block_ids: list[int], nbytes: int, landing: int = -1, places=()) -> bytes:
    return msgpack.packb({"v": VERSION, "kind": "nixl_write", "request_id": request_id, "lease_id": lease_id,
                          "pool_id": pool_id, "layout_id": layout_id, "seq": int(seq), "layer": int(layer),
                          "dst_block_ids": [int(b) for b in dst_block_ids], "nbytes": int(nbytes),
                          "landing": int(landing), "places": [int(p) for p in places]})


def _unpack(raw: bytes | memoryview) -> Any:
    if len(raw) > _MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {_MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not msgpack ({type(e).__name__}: {e})") from None


def _validate(obj: Any, fields: dict) -> dict:
    if not isinstance(obj, dict):
        raise WireError(f"expected a map, got {type(obj).__name__}")
    if obj.get("v") != VERSION:
        raise WireError(f"unsupported wire version {obj.get('v')!r} (this side speaks {VERSION})")
    for name, (ok, expected) in fields.items():
        if name not in obj:
            raise WireError(f"missing field {name!r}")
        if not ok(obj[name]):
            raise WireError(f"field {name!r} must be {expected}, got {obj[name]!r:.80}")
    return obj


def decode_header(raw: bytes | memoryview) -> dict:
    """A validated pages header; WireError says what is wrong."""
    return _validate(_unpack(raw), _PAGES_FIELDS)


def decode_done(raw: bytes | memoryview) -> dict:
    """A validated done message; WireError says what is wrong."""
    return _validate(_unpack(raw), _DONE_FIELDS)


def is_done(raw: bytes | memoryview) -> bool:
    """Whether a one-frame message says it is a done message (else: control)."""
    try:
        obj = _unpack(raw)
    except WireError:
        return False
    return isinstance(obj, dict) and obj.get("kind") == "done"


def decode_ack(raw: bytes | memoryview) -> dict:
    return _validate(_unpack(raw), _ACK_FIELDS)


def decode_control(raw: bytes | memoryview) -> dict:
    """A validated control message; WireError says what is wrong."""
    obj = _unpack(raw)
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind not in _CONTROL_FIELDS:
        raise WireError(f"unknown control message kind {kind!r} "
                        f"(expected one of {', '.join(_CONTROL_FIELDS)})")
    return _validate(obj, {"v": (_is_int, "int"), "token": (_is_int, "int"), **_CONTROL_FIELDS[kind]})


def decode_write_notif(raw: bytes | memoryview) -> dict:
    """A validated write notification; WireError says what is wrong."""
    note = _validate(_unpack(raw), _WRITE_NOTIF_FIELDS)
    landing = note.setdefault("landing", -1)
    if not (_is_int(landing) and landing >= -1):
        raise WireError(f"field 'landing' must be an int >= -1, got {landing!r:.80}")
    places = note.setdefault("places", [])
    if not _is_uint_list(places) or (landing >= 0 and len(places) != len(note["dst_block_ids"])):
        raise WireError(f"field 'places' must list a non-negative int per block, got {places!r:.80}")
    return note


def control_family(msg: dict) -> str:
    """Which one-sided backend a decoded control message is for ("ipc", "nixl")."""
    return msg["kind"].split("_", 1)[0]


def decode_reply(raw: bytes | memoryview) -> dict:
    return _validate(_unpack(raw), _REPLY_FIELDS)


def peek_token(raw: bytes | memoryview) -> int:
    """The token of a control message that failed validation, or -1."""
    try:
        obj = _unpack(raw)
        token = obj.get("token") if isinstance(obj, dict) else None
        return token if _is_int(token) else -1
    except Exception:  # garbage: nobody to address
        return -1


def peek_ids(raw: bytes | memoryview) -> tuple[str, int]:
    """(request_id, seq) of a header that failed validation, when they can be
    read at all: lets the receiver address its refusal to the right request."""
    try:
        obj = _unpack(raw)
        rid, seq = obj.get("request_id"), obj.get("seq")
        if isinstance(rid, str) and _is_int(seq):
            return rid, seq
    except Exception:  # garbage: nobody to address
        pass
    return "", -1


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (keeps `t` alive)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def bytes_to_tensor(buf: bytes | memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Inverse of tensor_bytes; shares memory with `buf`."""
    if memoryview(buf).nbytes == 0:  # frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
