"""Where a worker reserves nixl's landing region, and how large
(pdd.transfer.nixl_landing.landing_size): only where a nixl writer can come.
Pure: no NIXL, no process."""
from __future__ import annotations

import pytest

from pdd.config import WorkerConfig
from pdd.transfer.nixl_landing import landing_size
from pdd.transfer.wire import loopback_only

PER_TOKEN, MAX_TOKENS = 2048, 4096      # one request: 8 MiB
ONE_REQUEST = PER_TOKEN * MAX_TOKENS
LOOPBACK, ROUTABLE = "tcp://127.0.0.1:0", "tcp://10.0.0.2:7200"


def size(installed: bool = True, **worker) -> int:
    wc = WorkerConfig(**{"role": "decode", **worker}).validate()
    return landing_size(wc, installed, PER_TOKEN, MAX_TOKENS).nbytes


def test_explicit_nixl_keeps_the_region_on_any_address():
    assert size(transfer_backend="nixl", data_addr=LOOPBACK) == ONE_REQUEST
    assert size(transfer_backend="nixl", data_addr=ROUTABLE) == ONE_REQUEST


def test_auto_on_a_routable_address_keeps_the_region():
    assert size(transfer_backend="auto", data_addr=ROUTABLE) == ONE_REQUEST
    assert size(transfer_backend="auto", data_addr="tcp://0.0.0.0:7200") == ONE_REQUEST
    assert size(transfer_backend="auto", data_addr="tcp://*:7200") == ONE_REQUEST


@pytest.mark.parametrize("addr", [LOOPBACK, "tcp://127.0.0.2:7200", "tcp://localhost:7200", "tcp://[::1]:0",
                                  "tcp://lo:7200", "ipc:///tmp/pdd-data"])
def test_auto_on_loopback_reserves_none(addr):
    """No other host reaches the data socket, and on this one auto takes
    cuda_ipc or tcp; a nixl-only prefill worker here writes into the blocks."""
    wc = WorkerConfig(role="decode", transfer_backend="auto", data_addr=addr).validate()
    landing = landing_size(wc, True, PER_TOKEN, MAX_TOKENS)
    assert landing.nbytes == 0
    assert "loopback" in landing.why and "worker.nixl_landing_bytes" in landing.why


def test_an_explicit_setting_wins():
    assert size(transfer_backend="auto", data_addr=LOOPBACK, nixl_landing_bytes=12345) == 12345
    assert size(transfer_backend="auto", data_addr=ROUTABLE, nixl_landing_bytes=0) == 0
    assert size(transfer_backend="nixl", data_addr=LOOPBACK, nixl_landing_bytes=0) == 0
    assert size(transfer_backend="nixl", data_addr=ROUTABLE, nixl_landing_bytes=1 << 30) == 1 << 30


def test_the_default_is_one_longest_request_at_most_2_gib():
    wc = WorkerConfig(role="decode", transfer_backend="nixl").validate()
    assert landing_size(wc, True, 128 << 10, 16384).nbytes == 2 << 30      # the 8B shape's 16k tokens
    assert "capped" in landing_size(wc, True, 128 << 10, 131072).why
    whole = landing_size(wc, True, PER_TOKEN, MAX_TOKENS)
    assert whole.nbytes == ONE_REQUEST and f"one request of {MAX_TOKENS} tokens" in whole.why
    assert "capped" not in whole.why


def test_none_where_no_kv_comes_over_nixl():
    """A worker never sent KV, one that does not offer nixl, or one without the extra."""
    assert size(role="prefill", transfer_backend="nixl", data_addr=ROUTABLE, nixl_landing_bytes=1 << 20) == 0
    assert size(role="colocated", transfer_backend="nixl", data_addr=ROUTABLE) == 0
    assert size(role="colocated", prefill_for_others=True, transfer_backend="nixl", data_addr=ROUTABLE) == \
        ONE_REQUEST
    for backend in ("tcp", "cuda_ipc"):
        assert size(transfer_backend=backend, data_addr=ROUTABLE, nixl_landing_bytes=1 << 20) == 0
    assert size(installed=False, transfer_backend="auto", data_addr=ROUTABLE) == 0


def test_loopback_only_reads_the_endpoint():
    assert loopback_only("tcp://127.0.0.1:0") and loopback_only("tcp://[::1]:7200")
    assert loopback_only("ipc:///run/pdd/data") and loopback_only("inproc://data")
    assert not loopback_only("tcp://0.0.0.0:7200") and not loopback_only("tcp://[::]:7200")
    assert not loopback_only("tcp://10.0.0.2:7200") and not loopback_only("tcp://eth0:7200")
    assert not loopback_only("tcp://decode-b.example:7200")
