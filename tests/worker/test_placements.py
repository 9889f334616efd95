"""The worker's placement table: one request id under several epochs."""
from __future__ import annotations

import pytest

from pdd.api import InvalidRequest
from pdd.worker.placements import PlacementTable, engine_id


def test_epochs_of_one_request_are_separate_placements():
    table = PlacementTable()
    a, b = table.add("r", 1), table.add("r", 2)
    assert (a, b) == (engine_id("r", 1), engine_id("r", 2)) and a != b
    assert table.of_request("r") == [a, b]
    with pytest.raises(InvalidRequest, match="epoch 1 is already placed"):
        table.add("r", 1)
    assert table.remove(a).epoch == 1 and table.of_request("r") == [b]
    assert table.add("r", 1) == a            # gone, so it may come back
    table.remove(a)
    table.remove(b)
    assert len(table) == 0 and table.of_request("r") == []


def test_renew_moves_a_placement_to_a_new_epoch():
    table = PlacementTable()
    eid = table.add("r", 1)
    table.renew(eid, 3)
    assert table.get(eid).epoch == 3 and table.find("r", 3) == eid and table.find("r", 1) is None
    other = table.add("r", 4)
    with pytest.raises(InvalidRequest):
        table.renew(eid, 4)                  # held by another placement of the request
    with pytest.raises(InvalidRequest):
        table.add("r", 3)                    # the renewed placement holds epoch 3
    assert table.get(other).epoch == 4


def test_placing_undoes_a_placement_the_engine_refuses():
    table = PlacementTable()
    with pytest.raises(InvalidRequest):
        with table.placing("r", 1):
            raise InvalidRequest("prompt: empty")
    assert len(table) == 0
    with table.placing("r", 1) as eid:
        pass
    assert table.get(eid).request_id == "r"
