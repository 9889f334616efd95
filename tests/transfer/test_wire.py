from __future__ import annotations

import msgpack
import pytest
import torch

from pdd.transfer import make_receiver, make_sender, offered_backends
from pdd.transfer.leases import LeaseTable
from pdd.transfer.base import Handoff
from pdd.transfer.wire import (VERSION, WireError, bytes_to_tensor, decode_ack, decode_done, decode_header,
                               decode_write_notif, encode_ack, encode_done, encode_pages_header, encode_write_notif,
                               is_done, layout_digest, tensor_bytes)
from tests.transfer.conftest import make_layout


def _header(**over) -> dict:
    h = dict(request_id="r", lease_id="l", layer=2, dst_block_ids=[3, 1], dtype=torch.bfloat16,
             shape=[2, 2, 4, 2, 8], layout=make_layout().to_dict(), seq=5)
    h.update(over)
    return h


def test_header_round_trip():
    h = decode_header(encode_pages_header(**_header()))
    assert h["dtype"] == "bfloat16" and h["dst_block_ids"] == [3, 1] and h["seq"] == 5
    assert h["layout"] == make_layout().to_dict() and h["v"] == VERSION


@pytest.mark.parametrize("raw,expected", [
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),
    (msgpack.packb("str"), "expected a map"),
    (msgpack.packb({"v": VERSION}), "missing field 'kind'"),
    (encode_pages_header(**_header(seq=-1)), "field 'seq'"),
    (encode_pages_header(**_header(dst_block_ids=[1, -2])), "field 'dst_block_ids'"),
    (encode_pages_header(**_header(request_id=7)), "field 'request_id' must be str"),
    (encode_ack("r", 1, True), "field 'kind' must be 'pages'"),
])
def test_garbage_headers(raw, expected):
    with pytest.raises(WireError, match=expected):
        decode_header(raw)


def test_done_round_trip():
    handoff = Handoff(7, [[-0.5, [[7, -0.5]]]], 16).to_dict()
    d = decode_done(encode_done(request_id="r", lease_id="l", seq=3, handoff=handoff))
    assert (d["request_id"], d["lease_id"], d["seq"], d["handoff"]) == ("r", "l", 3, handoff)
    assert decode_done(encode_done(request_id="r", lease_id="l", seq=0, handoff=None))["handoff"] is None
    assert is_done(encode_done(request_id="r", lease_id="l", seq=0, handoff=None))
    assert not is_done(encode_ack("r", 1, True)) and not is_done(b"\xc1")
    for bad in ({"first_token": "x", "logprobs": None, "num_cached_tokens": 0},
                {"first_token": 1, "logprobs": None, "num_cached_tokens": -1}, {"first_token": 1}):
        with pytest.raises(WireError, match="field 'handoff'"):
            decode_done(encode_done(request_id="r", lease_id="l", seq=0, handoff=bad))


def test_write_notif_round_trip():
    fields = dict(request_id="r", lease_id="l", pool_id="pdd-decode-1", layout_id=layout_digest(make_layout().to_dict()),
                  seq=4, layer=2, dst_block_ids=[7, 8], nbytes=4096)
    assert {k: v for k, v in decode_write_notif(encode_write_notif(**fields)).items()
            if k not in ("v", "kind")} == {**fields, "landing": -1, "places": []}
    landed = {**fields, "landing": 512, "places": [3, 4]}
    assert {k: v for k, v in decode_write_notif(encode_write_notif(**landed)).items()
            if k not in ("v", "kind")} == landed
    # An older writer's notification (no landing fields) reads as a write into the blocks.
    older = msgpack.packb({"v": VERSION, "kind": "nixl_write", **fields})
    assert (decode_write_notif(older)["landing"], decode_write_notif(older)["places"]) == (-1, [])
    with pytest.raises(WireError, match="field 'places'"):
        decode_write_notif(encode_write_notif(**{**landed, "places": [3]}))
    with pytest.raises(WireError, match="field 'dst_block_ids'"):
        decode_write_notif(encode_write_notif(**{**fields, "dst_block_ids": [-1]}))
    with pytest.raises(WireError, match="field 'kind' must be 'nixl_write'"):
        decode_write_notif(encode_done(request_id="r", lease_id="l", seq=0, handoff=None))
    # The digest names the whole descriptor: any field changes it.
    assert layout_digest(make_layout().to_dict()) != layout_digest(make_layout(block_size=8).to_dict())
    assert layout_digest(make_layout().to_dict()) == layout_digest(dict(reversed(make_layout().to_dict().items())))


def test_ack_round_trip():
    a = decode_ack(encode_ack("r", 3, False, "nope"))
    assert (a["request_id"], a["seq"], a["ok"], a["error"]) == ("r", 3, False, "nope")
    with pytest.raises(WireError):
        decode_ack(encode_pages_header(**_header()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_payload_round_trip(dtype):
    t = (torch.rand(2, 3, 4, 2, 8) + 1).to(dtype)
    buf = tensor_bytes(t)
    assert buf.nbytes == t.numel() * t.element_size()
    assert torch.equal(bytes_to_tensor(bytearray(buf), dtype, list(t.shape)), t)


def test_factories():
    layout = make_layout()
    with pytest.raises(ValueError, match="tcp, local, cuda_ipc"):
        make_sender("rdma", layout)
    with pytest.raises(ValueError, match="choices"):
        make_receiver("rdma", torch.zeros(3, 2, 12, 4, 2, 8), layout, LeaseTable())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda_ipc KV transfer backend needs a GPU"):
            make_sender("cuda_ipc", layout)
    with pytest.raises(ValueError, match="KV pool has shape"):
        make_receiver("tcp", torch.zeros(3, 2, 12, 8, 2, 8), layout, LeaseTable())


def test_offered_backends(monkeypatch):
    import pdd.transfer.nixl_agent as nixl_agent
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(nixl_agent, "_import", lambda: (object(), ""))          # the extra, installed
    assert offered_backends("auto", cpu) == ["nixl", "tcp"]
    assert offered_backends("auto", gpu) == ["cuda_ipc", "nixl", "tcp"]
    assert offered_backends("nixl", cpu) == ["nixl"]
    assert offered_backends("tcp", gpu) == ["tcp"]
    with pytest.raises(ValueError, match="a worker offers auto, tcp, cuda_ipc or nixl"):
        offered_backends("local", cpu)   # it joins two engines of one process, never two workers
    with pytest.raises(ValueError, match="'cuda_ipc' needs a GPU; this worker runs on cpu"):
        offered_backends("cuda_ipc", cpu)
    monkeypatch.setattr(nixl_agent, "_import", lambda: (None, "nixl_cu13: No module named 'nixl_cu13'"))   # absent
    assert offered_backends("auto", cpu) == ["tcp"]
    assert offered_backends("auto", gpu) == ["cuda_ipc", "tcp"]
    with pytest.raises(nixl_agent.NixlUnavailable) as e:
        offered_backends("nixl", cpu)
    assert str(e.value) == ("worker.transfer_backend = 'nixl': the nixl KV transfer backend is not installed "
                            "(pip install 'pdd[nixl]'): nixl_cu13: No module named 'nixl_cu13'")