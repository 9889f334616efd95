"""Block hashes: the identity of a full block of tokens in every worker's cache.

hash(block i) = H(hash(block i-1), tokens of block i). The chain makes a hash
stand for the whole prefix up to that block, so equal hashes mean equal KV on
any worker with the same model; the router computes the same chain to route by
prefix. blake2b (not Python's hash) so the value is identical in every process,
on every host and Python version.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH,
                 start: int = 0) -> list[int]:
    """Hashes of the full blocks of `tokens[start:]`, `start` on a block boundary
    and `parent` the hash of the block before it."""
    out = []
    for i in range(start, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[i:i + block_size])
        out.append(parent)
    return out
