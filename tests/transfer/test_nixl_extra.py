"""Without the optional extra (pdd[nixl]) the nixl backend is absent and says
so in one line, naming the extra; the other backends do not care. The
missing import is forced (NIXL is installed where the tests run)."""
from __future__ import annotations

import pytest

from pdd.transfer import make_receiver, make_sender
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import NixlUnavailable
from tests.transfer.conftest import make_layout, make_pool


@pytest.fixture
def without_nixl(monkeypatch):
    import pdd.transfer.nixl_agent as nixl_agent
    monkeypatch.setattr(nixl_agent, "_import", lambda: (None, "nixl_cu13: No module named 'nixl_cu13'"))


def test_asking_for_nixl_without_the_extra_says_so_in_one_line(without_nixl):
    layout = make_layout()
    for make in (lambda: make_sender("nixl", layout),
                 lambda: make_receiver("nixl", make_pool(layout, 1), layout, LeaseTable())):
        with pytest.raises(NixlUnavailable) as e:
            make()
        assert str(e.value) == ("the nixl KV transfer backend is not installed (pip install 'pdd[nixl]'): "
                                "nixl_cu13: No module named 'nixl_cu13'")
    receiver = make_receiver("tcp", make_pool(layout, 1), layout, LeaseTable())
    assert receiver.nixl is None
    make_sender("tcp", layout).close()


def test_a_pool_that_is_not_contiguous_is_refused():
    from pdd.transfer.nixl_agent import unavailable
    if unavailable():
        pytest.skip(unavailable())
    layout = make_layout()
    pool = make_pool(layout, 1).transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="must be contiguous"):
        make_receiver("nixl", pool, layout, LeaseTable())
