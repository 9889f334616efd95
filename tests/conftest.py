"""Shared fixtures: tiny random-weight checkpoints built once per test session."""
from __future__ import annotations

import pytest

from pdd.model.make_model import make_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache = {}

    def get(arch: str = "llama", preset: str = "tiny"):
        key = (arch, preset)
        if key not in cache:
            cache[key] = make_model(tmp_path_factory.mktemp(f"{preset}-{arch}"), preset=preset, arch=arch)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_model(model_factory):
    return model_factory("llama")
