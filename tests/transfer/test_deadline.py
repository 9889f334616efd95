"""The transfer deadline: a transfer fails once the data plane has owed it
something for the timeout without progress, and every acknowledgement is
progress. The tcp sender keeps it (pdd.transfer.progress.Progress)."""
from __future__ import annotations

import pytest

from pdd import faults
from pdd.transfer.progress import Progress


@pytest.fixture
def backend() -> str:  # overrides the parametrized one: the tcp sender keeps the deadline
    return "tcp"


@pytest.fixture
def no_faults():
    faults.load_env({})
    yield
    faults.load_env({})


def test_the_deadline_counts_from_the_last_progress():
    p = Progress("r")
    assert p.deadline(2.0) is None            # nothing handed over: the prompt computes
    p.owe(10.0)
    p.owe(11.0)                               # a later handover does not move the clock
    assert p.deadline(2.0) == 12.0
    p.delivered(64, [3], now=11.5, still_owed=True)
    assert p.deadline(2.0) == 13.5            # an ack is progress: the clock restarts
    p.delivered(64, [4], now=12.0, still_owed=False)
    assert p.deadline(2.0) is None            # all acknowledged: no deadline while it computes on
    p.owe(20.0)
    assert p.deadline(2.0) == 22.0
    assert (p.bytes, p.blocks, p.t_last) == (128, {3, 4}, 12.0)


def test_a_slow_transfer_that_progresses_is_not_cut_off(make_pair, no_faults):
    # Each pages message is held 0.5 s before it goes (injected), so the request's
    # nine messages take ~4.5 s to land, more than twice the 2 s deadline, but
    # one lands every 0.5 s: the transfer completes.
    pair = make_pair(timeout_s=2.0)
    faults.apply({"transfer.send_delay_s": 0.5})
    target = pair.target("r", [1, 2, 3])
    for step in range(3):
        for layer in range(pair.src.shape[0]):
            pair.sender.send_layer(target, layer, pair.src[layer], [4 + step], [step])
    pair.sender.finish("r")
    r = pair.wait_result("r", timeout=60)
    assert r.ok, r.error
    assert r.blocks_sent == 3
    for step in range(3):
        assert (pair.dst[:, :, 1 + step] == pair.src[:, :, 4 + step]).all()


def test_a_stalled_transfer_fails_at_its_deadline(make_pair, no_faults):
    # The first pages message is held 30 s: nothing lands meanwhile, and the
    # request fails at its 0.5 s deadline with the reason, long before the
    # message would go: the I/O thread keeps the clock while the message waits.
    pair = make_pair(timeout_s=0.5)
    faults.apply({"transfer.send_delay_s": 30})
    pair.send_all(pair.target("r", [1]), [2])
    pair.sender.finish("r")
    r = pair.wait_result("r", timeout=20)
    assert not r.ok
    assert r.error == "stalled: no progress for 0.5s waiting for the decode worker (worker.transfer_timeout_s)"
    assert pair.receiver.stats.messages == 0
