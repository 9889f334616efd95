from __future__ import annotations

import pytest

from pdd import LLM
from tests.e2e.cluster import UpCluster


@pytest.fixture(scope="session")
def offline(tiny_model):
    """The in-process engine on the same model: what the cluster must reproduce.
    On the CPU, as UpCluster's workers are (on a GPU host it would otherwise
    take the GPU's memory for the whole session and compute in another dtype)."""
    return LLM(str(tiny_model), device="cpu")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("up"), tiny_model, "--mode", "colocated", "--workers", "2") as c:
        yield c


# Both layouts of one worker each: a module's tests run once on each (its `layout` fixture).
LAYOUTS = {"colocated": ("--mode", "colocated", "--workers", "1"),
           "disagg": ("--mode", "disagg", "--prefill", "1", "--decode", "1")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory, tiny_model):
    """A cluster of each layout in turn, `.layout` naming it."""
    with UpCluster(tmp_path_factory.mktemp(request.param), tiny_model, *LAYOUTS[request.param]) as c:
        c.layout = request.param
        yield c
