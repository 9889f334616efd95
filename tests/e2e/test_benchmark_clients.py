"""What benchmark and evaluation clients do against `pdd up` with no flag but
the model, in their request shapes (scripts/bench-clients runs the clients
themselves where they are installed):

- `vllm bench serve` without --model: the first model's `id` and `root`, a
  tokenizer loaded from `root`, /tokenize + /detokenize to align prompts, then
  streamed completions;
- aiperf --reset-kv-cache: a bodiless POST /reset_prefix_cache, answered once
  every worker (prefill and decode) has dropped its cache; `pdd admin cache
  flush` the same;
- lm-eval local-completions with a batch size: a list of prompts, one choice each.

A disaggregated cluster (1 prefill + 1 decode worker) of real processes."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from pdd import SamplingParams
from tests.e2e import http_util as rq
from tests.e2e.cluster import UpCluster

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench-clients"
PROMPTS = ["Hello there", "The quick brown fox jumps over", "café naïve 日本語"]
LONG = "the quick brown fox jumps over the lazy dog " * 8     # whole blocks for the prefix cache


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("up"), tiny_model) as c:
        yield c


def bodiless_post(url: str) -> rq.Reply:
    """As curl -X POST or requests.post(url) send it: no body, no Content-Type."""
    return rq._send(urllib.request.Request(url, method="POST"))


def test_vllm_bench_serve_without_model_or_tokenizer(cluster, tiny_model):
    models = rq.get(cluster.url + "/v1/models").json()["data"]
    model_id, root = models[0]["id"], models[0]["root"]
    assert model_id == root == str(tiny_model) and models[0]["parent"] is None
    tokenizer = AutoTokenizer.from_pretrained(root)                   # the name is a tokenizer reference
    prompt = " ".join(["hello world"] * 40)
    local = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    served = rq.post(cluster.url + "/tokenize", {"model": model_id, "prompt": prompt, "add_special_tokens": False})
    assert served.status == 200 and served.json()["tokens"] == local
    assert served.json()["max_model_len"] == models[0]["max_model_len"]
    cut = rq.post(cluster.url + "/detokenize", {"model": model_id, "tokens": local[:17]})
    assert cut.status == 200 and cut.json()["prompt"] == tokenizer.decode(local[:17])
    stream = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=model_id, prompt=cut.json()["prompt"], max_tokens=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == len(tokenizer(cut.json()["prompt"])["input_ids"])
    assert chunks[-1].usage.completion_tokens == 5
    assert rq.get(cluster.url + "/version").json()["version"]


def cached_tokens(cluster) -> int:
    reply = rq.post(cluster.url + "/v1/completions", {"prompt": LONG, "max_tokens": 1})
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def all_blocks_free(cluster) -> None:
    """Blocks a request still holds (a prefill worker's, until its pages have
    landed) stay cached through a reset: the reset is tested on an idle cluster."""
    workers = cluster.wait_idle(timeout_s=60)
    assert all(w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers


def test_a_prefix_cache_reset_reaches_every_worker(cluster):
    cached_tokens(cluster)
    assert cached_tokens(cluster) > 0
    all_blocks_free(cluster)
    reply = bodiless_post(cluster.url + "/reset_prefix_cache")
    assert reply.status == 200, reply.body
    assert set(reply.json()["reset"]) == {"prefill-0", "decode-0"} and reply.json()["no_answer"] == []
    assert cached_tokens(cluster) == 0                    # computed again, on either worker
    assert cached_tokens(cluster) > 0
    all_blocks_free(cluster)
    flushed = cluster.admin("cache", "flush")
    assert set(flushed["reset"]) == {"prefill-0", "decode-0"} and sum(flushed["reset"].values()) > 0
    assert cached_tokens(cluster) == 0


def test_lm_eval_batches_are_one_choice_per_prompt(cluster, offline):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    args = dict(model=cluster.model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=PROMPTS, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, batch.choices):
        alone = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert choice.text == alone.text and choice.finish_reason == "length"
    assert batch.usage.completion_tokens == 3 * 6
    assert batch.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    # Streamed: every chunk names its choice; each choice's text comes whole and in order.
    texts = {0: "", 1: "", 2: ""}
    finished = []
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
    assert [texts[i] for i in range(3)] == [c.text for c in batch.choices] and sorted(finished) == [0, 1, 2]
    # max_tokens 0: the prompts alone (evaluation clients score them), nothing generated.
    zero = rq.post(cluster.url + "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 0}).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in zero["choices"]] == [(0, "", "length"),
                                                                                       (1, "", "length")]
    assert zero["usage"]["prompt_tokens"] == 5 and zero["usage"]["completion_tokens"] == 0


def test_newer_openai_fields_are_accepted_and_named(cluster):
    body = {"model": cluster.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "store": True, "metadata": {"run": "1"}, "service_tier": "auto", "reasoning_effort": "low"}
    req = urllib.request.Request(cluster.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        # (reasoning_effort is read: a template variable, for the templates that take it)
        assert r.headers["X-Pdd-Ignored-Fields"] == "store, metadata, service_tier"
    assert "is not one pdd knows" in (cluster.run_dir / "router.log").read_text()


def test_the_client_script_reads_the_model_and_skips_clients_not_installed(cluster, tmp_path):
    """scripts/bench-clients where none of the clients is installed (CI): it
    finds the served name as a client would, runs nothing, and fails nothing."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    out = subprocess.run([str(SCRIPT), cluster.url + "/v1"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{cluster.url} serves {cluster.model_name}" in out.stdout
    for client in ("vllm", "aiperf", "guidellm", "lm_eval"):
        assert f"== {client}: not installed, skipped" in out.stdout
