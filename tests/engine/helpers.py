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


def run_to_end(engine, prompt_lengths, max_tokens: int, vocab: int = 32000) -> list:
    """Random prompts of these lengths added to an LLMEngine, greedy with ignore_eos,
    stepped until all finish; their requests."""
    g = torch.Generator().manual_seed(0)
    reqs = [engine.add_request(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i, n in enumerate(prompt_lengths)]
    while engine.has_unfinished():
        engine.step()
    return reqs
