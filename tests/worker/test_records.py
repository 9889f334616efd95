"""The worker's placement records: one request id under several epochs."""
from __future__ import annotations

import pytest

from pdd.api import InvalidRequest
from pdd.config import EngineConfig
from pdd.engine.engine import LLMEngine
from pdd.worker.records import PlacementState, PlacementTable, engine_id

RUNNING = PlacementState.RUNNING


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64))


def test_epochs_of_one_request_are_separate_placements(engine):
    table = PlacementTable(engine)
    a, b = table.add("r", 1, RUNNING), table.add("r", 2, RUNNING)
    assert (a.engine_id, b.engine_id) == (engine_id("r", 1), engine_id("r", 2)) and a is not b
    assert table.of_request("r") == [a, b]
    with pytest.raises(InvalidRequest, match="epoch 1 is already placed"):
        table.add("r", 1, RUNNING)
    assert table.release(a.engine_id).epoch == 1 and table.of_request("r") == [b]
    assert table.add("r", 1, RUNNING).engine_id == a.engine_id    # gone, so it may come back
    table.release(a.engine_id)
    table.release(b.engine_id)
    assert len(table) == 0 and table.of_request("r") == [] and table.release(b.engine_id) is None


def test_renew_moves_a_placement_to_a_new_epoch(engine):
    table = PlacementTable(engine)
    p = table.add("r", 1, RUNNING)
    table.renew(p, 3)
    assert p.epoch == 3 and table.find("r", 3) is p and table.find("r", 1) is None
    assert table.get(engine_id("r", 1)) is p          # the engine still knows it by its first epoch
    other = table.add("r", 4, RUNNING)
    with pytest.raises(InvalidRequest):
        table.renew(p, 4)                    # held by another placement of the request
    with pytest.raises(InvalidRequest):
        table.add("r", 3, RUNNING)           # the renewed placement holds epoch 3
    assert other.epoch == 4


def test_placing_undoes_a_placement_the_engine_refuses(engine):
    table = PlacementTable(engine)
    with pytest.raises(InvalidRequest):
        with table.placing("r", 1, RUNNING):
            raise InvalidRequest("prompt: empty")
    assert len(table) == 0
    with table.placing("r", 1, RUNNING) as p:
        pass
    assert table.get(p.engine_id) is p and p.request_id == "r"
