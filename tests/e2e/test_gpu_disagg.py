"""1 prefill + 1 decode worker over cuda_ipc (and the 8B shape over nixl too)
on the GPUs (one each when there are two, both on one otherwise) produce what a
colocated cluster produces, token for token: the built-in tiny model, and the
Llama-3-8B shape with dummy weights. Runs only where CUDA is available (the
lent H200 machines)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from pdd import SamplingParams
from pdd.model.tokenizer import servable_copy
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable
from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import complete, metric, mixed_workload, run_all
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]


LAYOUTS = {"disagg": ["--mode", "disagg", "--prefill", "1", "--decode", "1"],
           "colocated": ["--mode", "colocated", "--workers", "1"],
           "adaptive": ["--mode", "colocated", "--workers", "2", "--adaptive"]}


def up(tmp: Path, model: Path, mode: str, env: dict) -> UpCluster:
    return UpCluster(tmp / mode, model, *LAYOUTS[mode], env=env, start_timeout_s=600).start()


def run_in_order(cluster, prompts, params) -> list[tuple[str, str]]:
    """One request at a time: every step has the same batch in both clusters,
    so bf16 results are bitwise comparable."""
    async def main():
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for p, sp in zip(prompts, params):
                out.append(await complete(session, cluster, p, sp))
        return out
    return asyncio.run(main())


def compare(tmp: Path, model: Path, env: dict, workload, layouts=("disagg", "colocated"),
            backend: str = "cuda_ipc") -> None:
    """Each layout's outputs equal the last one's (colocated); the
    disaggregated one's pages over `backend`."""
    results = {}
    for mode in layouts:
        c = up(tmp, model, mode, {**env, "PDD_WORKER__TRANSFER_BACKEND": backend})
        try:
            results[mode] = workload(c)
            if mode == "disagg":
                assert metric(c, "pdd_kv_transfer_blocks_sent_total") > 0
                assert metric(c, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}') == 0
                workers = c.wait_idle(timeout_s=10)
                if backend == "cuda_ipc":
                    assert "through CUDA IPC" in c.logs(), c.logs()
                else:
                    assert workers["prefill-0"]["transfer_to"]["decode-0"]["backend"] == backend, workers
                assert all(w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers
        finally:
            assert c.stop() == 0, c.logs()
    for mode in layouts[:-1]:
        for i, (got, want) in enumerate(zip(results[mode], results[layouts[-1]])):
            assert got == want, (mode, i, got, want)


def test_tiny_model_over_cuda_ipc_matches_colocated(tmp_path, tiny_model):
    prompts, params = mixed_workload(40, seed=5)
    # fp32 so that concurrent batches (which differ between the two clusters) agree too.
    env = {"PDD_ENGINE__DTYPE": "float32", "PDD_ENGINE__KV_CACHE_BYTES": str(1 << 30)}
    compare(tmp_path, tiny_model, env, lambda c: run_all(c, prompts, params))


def test_llama_8b_shape_over_cuda_ipc_matches_colocated(tmp_path):
    # Config only (dummy weights) plus a word tokenizer: text maps 1:1 to token ids.
    model = servable_copy(REPO / "conf/models/llama-3.1-8b", tmp_path / "llama-3.1-8b")
    prompts = random_prompts([700, 1500, 33, 4000], seed=8, vocab=128000)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    env = {"PDD_ENGINE__LOAD_FORMAT": "dummy", "PDD_ENGINE__DTYPE": "bfloat16",
           "PDD_ENGINE__KV_CACHE_BYTES": str(8 << 30), "PDD_ENGINE__MAX_MODEL_LEN": "8192"}
    compare(tmp_path, model, env, lambda c: run_in_order(c, prompts, params))


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_llama_8b_shape_over_nixl_matches_colocated(tmp_path):
    """The same over nixl (UCX between the two processes; through the decode
    worker's landing region, transfer_backend nixl keeping it on loopback)."""
    model = servable_copy(REPO / "conf/models/llama-3.1-8b", tmp_path / "llama-3.1-8b")
    prompts = random_prompts([700, 1500, 33, 4000], seed=10, vocab=128000)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    env = {"PDD_ENGINE__LOAD_FORMAT": "dummy", "PDD_ENGINE__DTYPE": "bfloat16",
           "PDD_ENGINE__KV_CACHE_BYTES": str(8 << 30), "PDD_ENGINE__MAX_MODEL_LEN": "8192"}
    compare(tmp_path, model, env, lambda c: run_in_order(c, prompts, params), backend="nixl")


def compare_8b(tmp: Path, checkpoint: str, seed: int, layouts=("disagg", "colocated")) -> None:
    """The 8B shape (dummy weights) with an FP8 KV cache, one request at a time."""
    model = servable_copy(REPO / "conf/models" / checkpoint, tmp / checkpoint)
    prompts = random_prompts([700, 1500, 33, 4000], seed=seed, vocab=128000)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    env = {"PDD_ENGINE__LOAD_FORMAT": "dummy", "PDD_ENGINE__DTYPE": "bfloat16",
           "PDD_ENGINE__KV_CACHE_DTYPE": "fp8_e4m3",
           "PDD_ENGINE__KV_CACHE_BYTES": str(4 << 30), "PDD_ENGINE__MAX_MODEL_LEN": "8192"}
    compare(tmp, model, env, lambda c: run_in_order(c, prompts, params), layouts)


def test_llama_8b_shape_with_fp8_kv_over_cuda_ipc_matches_colocated(tmp_path):
    """FP8 pages (half the bytes) cross CUDA IPC and decode as colocated FP8 KV does."""
    compare_8b(tmp_path, "llama-3.1-8b", seed=9)


def test_llama_8b_fp8_checkpoint_with_fp8_kv_serves_alike_in_every_layout(tmp_path):
    """FP8 weights (128x128 block scales, FP8 GEMMs) and an FP8 KV cache through
    `pdd up`: 1 prefill + 1 decode over cuda_ipc, two adaptive colocated workers
    (one prefilling for the other), one colocated worker, token for token."""
    compare_8b(tmp_path, "llama-3.1-8b-fp8-block", seed=10, layouts=("disagg", "adaptive", "colocated"))
