"""Which worker gets a request.

A worker's cost is its load (requests in flight vs its sequence slots, KV
blocks in use) minus a bonus for the share of the prompt's blocks it already
caches: a long shared prefix is worth some queueing, but not unbounded.
"""
from __future__ import annotations

from pdd.router.registry import WorkerInfo

PREFIX_WEIGHT = 0.5


def load_of(w: WorkerInfo) -> float:
    seq_load = w.inflight / max(1, w.max_num_seqs)
    kv_load = 1.0 - w.free_blocks / max(1, w.num_blocks)
    return seq_load + kv_load


def pick_worker(candidates: list[WorkerInfo], block_hashes: list[int]) -> WorkerInfo | None:
    if not candidates:
        return None

    def cost(w: WorkerInfo) -> tuple[float, str]:
        affinity = w.prefix_match(block_hashes) / len(block_hashes) if block_hashes else 0.0
        return load_of(w) - PREFIX_WEIGHT * affinity, w.worker_id

    return min(candidates, key=cost)
