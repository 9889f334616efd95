"""Which data plane a prefill -> decode pair uses, and the per-request dispatch
of a worker that offers several (CPU: tcp and local stand in for cuda_ipc)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdd.router.placement import transfer_backend, transfer_choice
from pdd.transfer import MultiSender


def worker(backends, host_id="boot-a", worker_id="w"):
    return SimpleNamespace(transfer_backends=backends, host_id=host_id, worker_id=worker_id)


def test_backend_choice_per_pair():
    gpu = ["cuda_ipc", "tcp"]
    assert transfer_backend(worker(gpu), worker(gpu)) == "cuda_ipc"
    assert transfer_backend(worker(gpu), worker(gpu, "boot-b")) == "tcp"      # other host
    assert transfer_backend(worker(gpu, ""), worker(gpu, "")) == "tcp"        # host unknown
    assert transfer_backend(worker(gpu), worker(["tcp"])) == "tcp"            # CPU decode worker
    assert transfer_backend(worker(["cuda_ipc"]), worker(["tcp"])) is None    # nothing in common
    assert transfer_backend(worker([]), worker([])) == "tcp"                  # older workers: tcp


def test_auto_with_nixl_uses_it_across_hosts_only_and_says_why():
    gpu, cpu = ["cuda_ipc", "nixl", "tcp"], ["nixl", "tcp"]
    p = worker(gpu, worker_id="p")
    assert transfer_choice(p, worker(gpu, worker_id="d")) == ("cuda_ipc", "both take cuda_ipc, one host")
    assert transfer_choice(p, worker(gpu, "boot-b", "d")) == ("nixl", "both take nixl, two hosts; "
                                                                      "cuda_ipc needs one host")
    assert transfer_choice(worker(cpu), worker(cpu)) == ("tcp", "both take tcp; nixl is for two hosts")
    assert transfer_choice(worker(cpu), worker(cpu, "boot-b")) == ("nixl", "both take nixl, two hosts")
    assert transfer_choice(p, worker(["tcp"], "boot-b", "d")) == ("tcp", "both take tcp; d does not take "
                                                                         "cuda_ipc; d does not take nixl")
    # nixl alone (worker.transfer_backend = "nixl") on one host: nothing else to take, so nixl.
    assert transfer_choice(worker(["nixl"]), worker(cpu)) == ("nixl", "both take nixl, and nothing else both "
                                                                      "take; nixl is for two hosts")
    assert transfer_choice(worker(["nixl"], worker_id="p"), worker(["tcp"], worker_id="d")) == (
        None, "no backend in common: p offers nixl, d takes tcp")


@pytest.fixture
def backend() -> str:
    return "local"


def test_dispatch_by_the_target_backend(make_pair):
    pair = make_pair()
    other = make_pair()
    multi = MultiSender({"local": pair.sender, "tcp": other.sender})  # (both local senders underneath)
    t = pair.target("r", [4])
    with pytest.raises(ValueError, match="backend 'cuda_ipc' is not offered by this worker"):
        multi.prepare(type(t)(**{**vars(t), "backend": "cuda_ipc"}))
    t = type(t)(**{**vars(t), "backend": "local"})
    multi.prepare(t)
    multi.send_layer(t, 0, pair.src[0], [2], [0])
    multi.finish("r")
    assert [r.ok for r in multi.poll()] == [True]
    assert (pair.dst[0, :, 4] == pair.src[0, :, 2]).all()
    multi.finish("never-prepared")     # reports "nothing sent", never hangs the request
    assert [(r.request_id, r.ok, r.bytes) for r in multi.poll()] == [("never-prepared", True, 0)]
