"""The shipped cluster configs load: every key they set is one the daemon knows;
and the config reference (conf/disagg.toml, the README's and docs' `table.key`
names and defaults) is pdd.config's settings, both ways."""
from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest

from pdd.config import ClusterConfig
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


# --- The config reference: conf/disagg.toml lists every setting, the docs name only real ones.

ROOT = CONF.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md"]
# `table.key`-shaped names in the docs that are files, not settings (README, "Keys"; `pdd up`'s logs).
FILE_NAMES = {"router.key", "router.key_secret", "worker.key", "worker.key_secret", "router.log"}
TABLES = tuple(f.name for f in dataclasses.fields(ClusterConfig))


def config_keys(cls=ClusterConfig, prefix: str = "") -> dict[str, object]:
    """Every setting as "table.key" (a table inside one: "router.breaker.window_s") -> its default."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(config_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default
    return out


def reference_keys(text: str) -> set[str]:
    """The settings a TOML example lists: `key = ...` lines, set or commented out,
    and `# key: ...` lines (a secret or a per-process value, said where it goes instead)."""
    keys, table = set(), None
    for line in text.splitlines():
        if m := re.match(r"\s*\[([a-z_.]+)\]", line):
            table = m.group(1)
        elif table and (m := re.match(r"\s*#?\s*([a-z_]+)\s*=|\s*#\s*([a-z_]+):\s", line)):
            keys.add(f"{table}.{m.group(1) or m.group(2)}")
    return keys


def test_the_disagg_example_lists_every_setting_and_only_settings():
    listed = reference_keys((CONF / "disagg.toml").read_text())
    known = set(config_keys())
    assert known - listed == set(), "settings conf/disagg.toml does not list"
    # `# auto: ...` explains a value; anything else named like a setting must be one.
    assert {k for k in listed - known if not k.endswith((".auto", ".nixl"))} == set()


@pytest.mark.parametrize("path", DOCS + sorted(CONF.glob("*.toml")), ids=lambda p: p.name)
def test_every_setting_the_docs_name_exists(path):
    known = set(config_keys())
    tables = {k.rpartition(".")[0] for k in known} | set(TABLES)
    named = set(re.findall(rf"`((?:{'|'.join(TABLES)})\.[a-z_.]*[a-z_])", path.read_text()))
    unknown = {n for n in named - FILE_NAMES if n not in known and n not in tables}
    assert unknown == set(), f"{path.name} names settings pdd.config does not have"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_default_the_docs_give_is_the_default(path):
    """`table.key` (N) and `table.key` (N s): the docs' way of giving a default."""
    defaults = config_keys()
    given = re.findall(rf"`((?:{'|'.join(TABLES)})\.[a-z_.]*[a-z_])`,?\s+\(?([0-9][0-9,.]*)( s)?[);]", path.read_text())
    checked = [(key, _number(value), defaults[key]) for key, value, _ in given if key in defaults]
    assert [c for c in checked if c[1] != c[2]] == []
    if path.name == "README.md":
        assert len(checked) >= 10, checked   # the pattern still finds the README's defaults


def test_the_readmes_tracing_table_is_tracing_config():
    """README's [tracing] table: every key of TracingConfig with its default, and no other."""
    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\s*\| `([a-z_]+)` \| `([^`]*)` \|", text.split("Settings in `[tracing]`")[1], re.M))
    defaults = {k.partition(".")[2]: v for k, v in config_keys().items() if k.startswith("tracing.")}
    assert set(rows) == set(defaults)
    for key, shown in rows.items():
        assert tomllib.loads(f"v = {shown}")["v"] == (list(defaults[key]) if isinstance(defaults[key], tuple)
                                                     else defaults[key]), key
