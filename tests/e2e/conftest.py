from __future__ import annotations

import pytest

from pdd import LLM
from tests.e2e.cluster import UpCluster


@pytest.fixture(scope="session")
def offline(tiny_model):
    """The in-process engine on the same model: what the cluster must reproduce."""
    return LLM(str(tiny_model))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("up"), tiny_model, "--mode", "colocated", "--workers", "2") as c:
        yield c
