"""Bad input to the engine or its config: a clear error naming the problem."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from pdd import LLM, SamplingParams
from pdd.api import InvalidRequest
from pdd.config import ConfigError, EngineConfig
from pdd.config_loader import build
from pdd.engine import model_runner
from pdd.kv.hashing import block_hashes
from pdd.model.config import CheckpointError
from tests.engine.helpers import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), max_model_len=256)


# Poison values: each must be refused naming its field, before it reaches the sampler.
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2**64), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1e308), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(top_k=2**63), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(seed="x"), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(min_tokens=17), "min_tokens"),            # > max_tokens (16)
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logprobs=99), "logprobs"),
    (dict(logprobs=10**18), "logprobs"),
    (dict(stop=["x"] * 5000), "stop"),
    (dict(stop=["x" * 100_000]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop="\n"), "stop"),
    (dict(stop_token_ids=list(range(5000))), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[10**6]), "stop_token_ids"),  # beyond the vocabulary
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(InvalidRequest, match=f"^{match}:"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


def test_bad_request_fields(llm):
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=2**31))
    with pytest.raises(InvalidRequest, match="num_prior_output_tokens"):
        llm.engine.add_request("prior", [1, 2, 3], SamplingParams(), num_prior_output_tokens=3)
    with pytest.raises(InvalidRequest, match="num_prior_output_tokens"):
        llm.engine.add_request("prior", [1, 2, 3], SamplingParams(), num_prior_output_tokens=-1)
    with pytest.raises(InvalidRequest, match="prompt"):
        llm.engine.add_request("bool", [1, True], SamplingParams())
    with pytest.raises(InvalidRequest, match="^block_hashes: 1 hashes for a prompt of 3 tokens"):
        llm.engine.add_request("hashes", [1, 2, 3], SamplingParams(), block_hashes=[42])
    assert not llm.engine.has_unfinished()


def test_block_hashes_given_by_the_router_are_the_ones_the_engine_computes(llm):
    bs = llm.engine.cfg.block_size
    prompt = list(range(1, 2 * bs + 5))
    req = llm.engine.make_request("given", prompt, SamplingParams(), block_hashes=block_hashes(prompt, bs))
    own = llm.engine.make_request("own", prompt, SamplingParams())
    assert llm.engine.kv.update_hashes(req) == llm.engine.kv.update_hashes(own) == block_hashes(prompt, bs)


def _tokens(llm, **kw) -> list[int]:
    prompt = [5, 17, 99, 3, 250, 8]
    return llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **kw))[0].token_ids


def test_extreme_values_that_have_a_correct_answer(llm):
    greedy = _tokens(llm, temperature=0.0)
    # A temperature this small is greedy (dividing by it would overflow to garbage).
    assert _tokens(llm, temperature=1e-45, seed=1) == greedy
    # A vanishing top_p keeps only the likeliest token.
    assert _tokens(llm, temperature=1.0, top_p=1e-300, seed=1) == greedy
    vocab = llm.engine.model_config.vocab_size
    # top_k beyond the vocabulary keeps every token: the same as no top_k.
    assert _tokens(llm, temperature=1.0, top_k=vocab + 1000, seed=2) == _tokens(llm, temperature=1.0, seed=2)
    assert _tokens(llm, temperature=1.0, top_k=2**63 - 1, seed=2) == _tokens(llm, temperature=1.0, seed=2)
    # Seeds are taken modulo 2**63: any 64-bit seed is accepted, consistently.
    assert _tokens(llm, temperature=1.0, seed=2**64 - 1) == _tokens(llm, temperature=1.0, seed=2**63 - 1)
    assert _tokens(llm, temperature=1.0, seed=-1) == _tokens(llm, temperature=1.0, seed=2**63 - 1)
    assert_all_blocks_free(llm)


def test_validate_normalises_a_copy(llm):
    shared = SamplingParams(temperature=1e-9)
    req = llm.engine.make_request("c", [1, 2, 3], shared)
    assert req.sampling.temperature == 0.0 and req.sampling.seed is not None
    assert shared.temperature == 1e-9 and shared.seed is None   # the caller's object is untouched


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


POISON_SEED = 424242


def test_a_failed_step_aborts_its_batch_and_the_engine_serves_on(llm, monkeypatch):
    engine = llm.engine
    expected = _tokens(llm, temperature=0.0)
    real_sample = model_runner.sample

    def sample(logits, batch):  # a forced fault: a sampler bug that one request's values hit
        if bool((batch.seeds == POISON_SEED).any()):
            raise RuntimeError("forced fault")
        return real_sample(logits, batch)

    monkeypatch.setattr(model_runner, "sample", sample)
    engine.add_request("innocent", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.step()   # decoding now, one step in flight
    engine.add_request("poison", [1, 2, 3], SamplingParams(max_tokens=5, seed=POISON_SEED))
    with pytest.raises(RuntimeError, match="forced fault"):
        engine.step()
    # Both were in the failed step's batch: their KV and tokens are unknown.
    assert sorted(engine.abort_failed_step()) == ["innocent", "poison"]
    assert_all_blocks_free(llm)
    assert _tokens(llm, temperature=0.0) == expected


def test_a_failed_schedule_aborts_the_running_requests_only(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("running", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.add_request("waiting", [9, 10], SamplingParams(max_tokens=3, temperature=0.0))

    def schedule():  # a forced fault: a scheduler bug
        raise RuntimeError("forced fault")

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    with pytest.raises(RuntimeError):
        engine.step()
    monkeypatch.undo()
    assert engine.abort_failed_step() == ["running"]
    assert engine.scheduler.waiting[0].request_id == "waiting"   # never touched: still queued
    assert engine.abort_request("waiting")
    assert_all_blocks_free(llm)
