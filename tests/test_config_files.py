"""The shipped cluster configs load: every key they set is one the daemon knows."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdd.config_loader import load_cluster_config

CONF = Path(__file__).resolve().parent.parent / "conf"


@pytest.mark.parametrize("path", sorted(CONF.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_cluster_config(path, env={})
    assert cfg.engine.async_scheduling is True
    assert cfg.worker.role in ("colocated", "prefill", "decode")


def test_shipped_configs_exist():
    assert {p.name for p in CONF.glob("*.toml")} >= {"colocated.toml", "disagg.toml"}


@pytest.mark.parametrize("path", sorted(CONF.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_holds_no_secret_and_needs_keys(path):
    """The admin token comes from the environment file, never from a shipped
    file (a placeholder there would be a token everyone knows); keys are on."""
    cfg = load_cluster_config(path, env={})
    assert cfg.router.admin_token == ""
    assert cfg.security.keys_dir and not cfg.security.insecure and cfg.security.api_keys == ()
    assert "change-me" not in path.read_text()
