"""The shipped cluster configs load: every key they set is one the daemon knows."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdd.config import load_cluster_config

CONF = Path(__file__).resolve().parent.parent / "conf"


@pytest.mark.parametrize("path", sorted(CONF.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_cluster_config(path, env={})
    assert cfg.engine.async_scheduling is True
    assert cfg.worker.role in ("colocated", "prefill", "decode")


def test_shipped_configs_exist():
    assert {p.name for p in CONF.glob("*.toml")} >= {"colocated.toml", "disagg.toml"}
