"""After its warm-up no worker compiles a Triton kernel in service, whatever
load comes: colocated workers (adaptive, so they also prefill for each other),
and 1 prefill + 1 decode worker over cuda_ipc, also when the prefill worker
runs requests whole (its decode worker drained). A kernel compiled in service
stalls every request on the worker (seconds on H200); each worker counts them
in its heartbeats (`kernels_compiled_in_service`, the router's
`pdd_kernels_compiled_in_service_total`) and logs which kernel it was.

The Llama-3-8B shape with dummy weights, every worker on the first GPU, a
fresh Triton cache. Runs only where CUDA is available (the lent H200 machines:
`scripts/device-check compiles`)."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest
import torch

from pdd import SamplingParams
from pdd.model.tokenizer import servable_copy
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg import complete, metric
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128_000
WARNING = "compiled in service"


def _hookable() -> None:
    import triton
    if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook: workers cannot count compiles")


def varied_load(seed: int, waves: list[int]) -> list[list[tuple[list[int], SamplingParams]]]:
    """Waves of concurrent requests (one wave per entry of `waves`, that many
    at once): prompts of 1..3000 tokens (lengths on and off the multiples of
    the block size, one block, many), a third of them extending a shared
    1,500-token prefix (prefix hits: a prompt's first computed block deep in
    it, only its tail sent), outputs of 1..300 tokens (decode contexts deep
    enough for split-K decode at every batch size)."""
    rng = random.Random(seed)
    shared = random_prompts([1500], seed=seed, vocab=VOCAB)[0]
    fixed = [1, 2, 15, 16, 17, 31, 100, 257, 700, 1025, 2000, 2049, 3000]
    out = []
    for i, size in enumerate(waves):
        wave = []
        for j in range(size):
            n = fixed[(i + j) % len(fixed)] if j % 2 else rng.randint(1, 3000)
            prompt = random_prompts([n], seed=seed * 1000 + i * 100 + j, vocab=VOCAB)[0]
            if j % 3 == 0:
                prompt = shared[:rng.randint(16, 1500)] + prompt[:1500]
            wave.append((prompt, SamplingParams(max_tokens=rng.choice([1, 2, 7, 64, 300]), temperature=0.0,
                                                ignore_eos=True)))
        out.append(wave)
    return out


def serve(cluster: UpCluster, waves) -> None:
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for wave in waves:
                results = await asyncio.gather(*(complete(session, cluster, p, sp) for p, sp in wave))
                assert all(reason == "length" for _, reason in results), results
    asyncio.run(main())


def assert_nothing_compiled(cluster: UpCluster) -> None:
    """Every worker's count, from a heartbeat sent after the load, is 0."""
    before = {wid: w["heartbeats"] for wid, w in cluster.workers().items()}
    _wait_for(lambda: all(w["heartbeats"] >= before[wid] + 2 for wid, w in cluster.workers().items()),
              timeout_s=60, what="heartbeats after the load")
    compiled = {wid: w["kernels_compiled_in_service"] for wid, w in cluster.workers().items()}
    lines = [line for log in sorted(cluster.run_dir.glob("*.log"))
             for line in log.read_text().splitlines() if WARNING in line]
    if compiled != dict.fromkeys(compiled, 0) or lines:
        # pytest.fail keeps the whole text: each line names the kernel and the
        # argument specialization that made the new variant
        pytest.fail(f"compiled in service: {compiled}\n" + "\n".join(lines)[-20000:], pytrace=False)
    for wid in compiled:   # the router exports it, per worker
        assert metric(cluster, "pdd_kernels_compiled_in_service_total", f'{{worker="{wid}"}}') == 0
    assert "pdd_kernels_compiled_in_service_total{" in http_util.get(cluster.url + "/metrics").body.decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return servable_copy(REPO / "conf/models/llama-3.1-8b", tmp_path_factory.mktemp("llama-3.1-8b"))


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    _hookable()
    # A fresh Triton cache: what a worker compiles shows, none of it found on disk
    # from an earlier run (a disk hit after the warm-up counts all the same).
    return {"PDD_ENGINE__LOAD_FORMAT": "dummy", "PDD_ENGINE__DTYPE": "bfloat16",
            "PDD_ENGINE__KV_CACHE_BYTES": str(6 << 30), "PDD_ENGINE__MAX_MODEL_LEN": "4096",
            "PDD_ENGINE__DEVICE": "cuda:0", "PDD_WORKER__TRANSFER_BACKEND": "cuda_ipc",
            "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))}


WAVES = [1, 3, 8, 17, 40, 2, 5, 11, 24, 1]


def test_colocated_workers_compile_nothing_in_service(tmp_path, model, env):
    c = UpCluster(tmp_path / "adaptive", model, "--mode", "colocated", "--workers", "2", "--adaptive",
                  env=env, start_timeout_s=600).start()
    try:
        serve(c, varied_load(1, WAVES))
        assert_nothing_compiled(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_prefill_and_decode_workers_compile_nothing_in_service(tmp_path, model, env):
    c = UpCluster(tmp_path / "disagg", model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env=env, start_timeout_s=600).start()
    try:
        serve(c, varied_load(2, WAVES))
        assert metric(c, "pdd_kv_transfer_blocks_sent_total") > 0       # pages went over cuda_ipc
        assert "through CUDA IPC" in c.logs(), c.logs()
        assert_nothing_compiled(c)
        # The decode worker drained, the prefill worker runs requests whole (the
        # router's last resort), decoding without CUDA graphs: one at a time over
        # deep contexts (the most key splits), then a few together.
        decode = next(wid for wid, w in c.workers().items() if w["role"] == "decode")
        c.admin("drain", decode)
        deep = [([(7 * i) % VOCAB for i in range(n)], SamplingParams(max_tokens=300, temperature=0.0,
                                                                      ignore_eos=True))
                for n in (3000, 1900, 900, 2500, 400)]
        serve(c, [[r] for r in deep] + varied_load(4, [9, 3]))
        assert metric(c, "pdd_placement_total", '{kind="colocated",reason="no_decode_worker"}') >= len(deep) + 12
        assert_nothing_compiled(c)
    finally:
        assert c.stop() == 0, c.logs()
