"""An operator's config mistakes: each is one error naming the key and where the
value was set — the file, the PDD_* variable or the command line — since a fix
made in the file does nothing for a value the environment set."""
from __future__ import annotations

import pytest

from pdd.cli import _serve_config, build_parser
from pdd.config import ConfigError
from pdd.config_loader import load_cluster_config


@pytest.mark.parametrize("text, message", [
    ("[engine]\nblok_size = 16\n", r"\[engine\]: unknown key\(s\) \['blok_size'\]"),
    ("[engine]\nblock_size = \"sixteen\"\n", r"engine\.block_size: expected int, got 'sixteen'"),
    ("[engine]\nblock_size = 3\n", r"engine\.block_size: must be a power of two, got 3"),
    ("[router]\nport = 70000\n", r"router\.port: 70000 is not a TCP port"),
    ("[router.breakr]\nwindow_s = 1.0\n", r"\[router\]: unknown key\(s\) \['breakr'\]"),
    ("[router.breaker]\nwindow_s = \"x\"\n", r"router\.breaker\.window_s: expected float"),
    ("[router.breaker]\nwindow_s = -1.0\n", r"router\.breaker: window_s and cooldown_s must be > 0"),
    ("[router]\nbreaker = 3\n", r"router\.breaker: expected a table, got 3"),
    ("[tracing]\nqueue_size = 10\n", r"tracing\.queue_size: must be >= batch_size"),
])
def test_a_mistake_in_the_file_names_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "pdd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        load_cluster_config(path, env={})


@pytest.mark.parametrize("env, message", [
    ({"PDD_ENGINE__BLOCK_SIZE": "abc"}, r"PDD_ENGINE__BLOCK_SIZE: engine\.block_size: expected int"),
    ({"PDD_ENGINE__BLOCK_SIZE": "3"}, r"PDD_ENGINE__BLOCK_SIZE: engine\.block_size: must be a power of two"),
    ({"PDD_ENGINE__HOST_KV_CACHE_BYTES": "64GiB"},
     r"PDD_ENGINE__HOST_KV_CACHE_BYTES: engine\.host_kv_cache_bytes: expected int"),
    ({"PDD_ENGINE__HOST_KV_CACHE_BYTES": "-1"},
     r"PDD_ENGINE__HOST_KV_CACHE_BYTES: engine\.host_kv_cache_bytes: must be a number of bytes >= 0"),
    ({"PDD_ROUTER__BREAKER__WINDOW_S": "x"}, r"PDD_ROUTER__BREAKER__WINDOW_S: router\.breaker\.window_s"),
    ({"PDD_ROUTER__BREAKER__FAILURE_RATE": "2"}, r"PDD_ROUTER__BREAKER__FAILURE_RATE: router\.breaker\.failure_rate"),
    ({"PDD_ENGINE__BLOK": "1"}, r"PDD_ENGINE__BLOK: \[engine\]: unknown key\(s\) \['blok'\]"),
    ({"PDD_ENGIN__BLOCK_SIZE": "16"}, r"PDD_ENGIN__BLOCK_SIZE: no config table 'engin'"),
    ({"PDD_ROUTER__BREAKER": "5"}, r"PDD_ROUTER__BREAKER: router\.breaker is a table: set its keys, "
                                   r"PDD_ROUTER__BREAKER__<KEY>=value"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, r"OTEL_EXPORTER_OTLP_ENDPOINT: tracing\.otlp_endpoint"),
])
def test_a_bad_environment_variable_is_named_not_the_file(tmp_path, env, message):
    path = tmp_path / "pdd.toml"
    path.write_text("[engine]\nblock_size = 16\n[router.breaker]\nwindow_s = 30.0\n")
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_cluster_config(path, env=env)


def test_variables_that_are_not_config_tables_are_left_alone():
    cfg = load_cluster_config(env={"PDD_FAULTS": "seed=1", "PDD_ADMIN_TOKEN": "x", "PDD_LOG_LEVEL": "debug"})
    assert cfg.log.level == "debug"


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", "--role", "router", *argv])


def test_set_reaches_a_table_inside_a_table_and_keeps_the_files_other_keys(tmp_path):
    path = tmp_path / "pdd.toml"
    path.write_text("[router.breaker]\ncooldown_s = 20.0\n")
    cfg = _serve_config(_serve_args("--config", str(path), "--set", "router.breaker.window_s=5",
                                    "--set", "router.port=9000"))
    assert (cfg.router.breaker.window_s, cfg.router.breaker.cooldown_s, cfg.router.port) == (5.0, 20.0, 9000)


@pytest.mark.parametrize("item, message", [
    ("routr.port=1", r"^--set: unknown table\(s\) \['routr'\]"),
    ("router.breaker.window_s=x", r"^--set: router\.breaker\.window_s: expected float, got 'x'"),
    ("router..window_s=1", r"expected TABLE\.KEY=VALUE"),
    ("port=1", r"expected TABLE\.KEY=VALUE"),
])
def test_a_bad_set_is_refused_naming_it(item, message):
    with pytest.raises(ValueError, match=message):
        _serve_config(_serve_args("--set", item))
