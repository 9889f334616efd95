"""Bad input to the engine or its config: a clear error naming the problem."""
from __future__ import annotations

import json
import shutil

import pytest

from pdd import LLM, SamplingParams
from pdd.config import ConfigError, EngineConfig, build
from pdd.engine.sampling_params import InvalidRequest
from pdd.model.config import CheckpointError
from tests.engine.helpers import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), max_model_len=256)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(seed="x"), "seed"),
    (dict(logprobs=99), "logprobs"),
])
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(**kwargs))


def test_bad_prompts(llm):
    with pytest.raises(InvalidRequest, match="at least one token"):
        llm.engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.engine.add_request("v", [1, 10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="maximum context length is 256"):
        llm.engine.add_request("l", [1] * 250, SamplingParams(max_tokens=10))
    # Nothing was admitted, and the engine still serves.
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown key.*blok_size"):
        build(EngineConfig, {"blok_size": 16}, "engine", env={})
    with pytest.raises(ConfigError, match="engine.block_size: expected int"):
        build(EngineConfig, {"block_size": "big"}, "engine", env={})
    with pytest.raises(ConfigError, match="power of two"):
        build(EngineConfig, {"block_size": 12}, "engine", env={})
    cfg = build(EngineConfig, {"block_size": 32}, "engine",
                env={"PDD_ENGINE__CHUNK_SIZE": "64", "PDD_ENGINE__ENABLE_PREFIX_CACHING": "false"})
    assert (cfg.block_size, cfg.chunk_size, cfg.enable_prefix_caching) == (32, 64, False)
    with pytest.raises(ConfigError, match="PDD_ENGINE__NOPE"):
        build(EngineConfig, {}, "engine", env={"PDD_ENGINE__NOPE": "1"})


def test_checkpoint_errors_name_the_problem(tiny_model, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path))
    bad = tmp_path / "m"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(CheckpointError, match="has shape"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(CheckpointError, match="lacks"):
        LLM(str(bad))
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(bad))


def test_dummy_load_format_needs_no_weights(tiny_model, tmp_path):
    d = tmp_path / "cfg-only"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, d / name)
    llm = LLM(str(d), load_format="dummy")
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
