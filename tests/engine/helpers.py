from __future__ import annotations

import torch

from pdd.api import SamplingParams


def random_prompts(lengths, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_all_blocks_free(llm) -> None:
    """After every request finished, no block may still be referenced."""
    pool = llm.engine.kv.pool
    assert not llm.engine.has_unfinished()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.ref_counts[1:] == [0] * (pool.num_blocks - 1)
