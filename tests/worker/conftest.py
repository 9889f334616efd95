from __future__ import annotations

import pytest

from pdd import LLM


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The in-process engine on the same model: what a worker must reproduce."""
    return LLM(str(tiny_model))
