"""Random interleavings on one engine (tests/engine/fuzz.py): every request's
tokens equal its own run alone, aborted requests say nothing more, and every
block is free at the end. A few fixed seeds here, each with preemptions and
aborts, async scheduling on and off, prefix caching off once; in 1027 and
1058 a reservation prefilled here waits holding blocks that the requests
ahead of it need. `python -m tests.engine.fuzz FIRST COUNT` runs many more."""
from __future__ import annotations

import pytest

from tests.engine import fuzz

SEEDS = (1, 3, 43, 1013, 1014, 1027, 1058)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return fuzz.Reference(str(tiny_model))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleaving_equals_solo_runs(tiny_model, reference, seed):
    summary = fuzz.run(str(tiny_model), seed, reference)
    assert summary["preemptions"] > 0 and summary["aborted"] > 0
