"""The names a model is served under, as vLLM does it: the model as given
(a checkpoint path is then a tokenizer reference a benchmark client can load),
or `router.served_model_name` / `--served-model-name` aliases; the KV layout's
model id stays what it was, so workers of one cluster still pair."""
from __future__ import annotations

import pytest

from pdd.cli import build_parser
from pdd.config import ConfigError
from pdd.config_loader import dump_toml, load_cluster_config
from pdd.launcher import build_cluster


def cfg_of(env: dict | None = None, **tables):
    return load_cluster_config(env=env or {}, overrides=tables)


def test_the_model_as_given_is_its_name():
    cfg = cfg_of(engine={"model": "models/Llama-3.1-8B/"})
    assert cfg.served_model_names("models/Llama-3.1-8B") == ("models/Llama-3.1-8B/",)   # verbatim, as vLLM
    assert cfg.model_root("models/Llama-3.1-8B") == "models/Llama-3.1-8B/"
    assert cfg.layout_model_id("models/Llama-3.1-8B") == "Llama-3.1-8B"


def test_the_built_in_model_is_served_under_its_directory_and_pdd_tiny():
    cfg = cfg_of()
    assert cfg.served_model_names("/cache/tiny-llama") == ("/cache/tiny-llama", "pdd-tiny")
    assert cfg.model_root("/cache/tiny-llama") == "/cache/tiny-llama"
    assert cfg.layout_model_id("/cache/tiny-llama") == "pdd-tiny"


def test_aliases_from_the_config_or_the_environment():
    cfg = cfg_of(env={"PDD_ROUTER__SERVED_MODEL_NAME": "llama, meta-llama/Llama-3.1-8B"},
                 engine={"model": "/srv/llama"})
    assert cfg.served_model_names("/srv/llama") == ("llama", "meta-llama/Llama-3.1-8B")
    assert cfg.model_root("/srv/llama") == "/srv/llama"        # the root stays the checkpoint
    assert cfg.layout_model_id("/srv/llama") == "llama"         # as before aliases: the configured name
    one = cfg_of(router={"served_model_name": "llama"})         # a TOML string: one name
    assert one.router.served_model_name == ("llama",)
    assert load_cluster_config(env={}, overrides={"router": {"served_model_name": ["a", "b"]}}).router \
        .served_model_name == ("a", "b")
    # What `pdd up` writes for its children reads back the same.
    assert "served_model_name = [\"llama\", \"meta-llama/Llama-3.1-8B\"]" in dump_toml(cfg)


@pytest.mark.parametrize("names, words", [
    (["a", "a"], ["router.served_model_name", "repeat"]),
    (["a", " "], ["router.served_model_name[1]", "non-empty"]),
    (["a\nb"], ["router.served_model_name[0]", "printable"]),
])
def test_bad_names_are_refused_naming_the_key(names, words):
    with pytest.raises(ConfigError) as info:
        cfg_of(router={"served_model_name": names})
    for w in words:
        assert w in str(info.value)


def test_pdd_up_takes_aliases(tmp_path):
    args = build_parser().parse_args(["up", "--model", str(tmp_path), "--served-model-name", "a", "b/c",
                                      "--run-dir", str(tmp_path / "run")])
    cfg = build_cluster(args).cfg
    assert cfg.router.served_model_name == ("a", "b/c") and cfg.engine.model == str(tmp_path)
    assert build_cluster(build_parser().parse_args(["up", "--run-dir", str(tmp_path / "run")])) \
        .cfg.router.served_model_name == ()
