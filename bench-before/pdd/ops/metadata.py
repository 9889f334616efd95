"""What the attention ops need to know about one step's batch.

The runner builds one `AttentionMetadata` per step and passes it down the
model; layers other than attention never look at it. Sequences are ordered
decodes first (query length 1), then prefill chunks, so kernels can treat the
two groups separately without a gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: where each new token's K/V goes in the flat
    # (block * block_size + offset) slot space. Padding tokens point at the
    # null block 0, whose contents are never read.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: token offsets of each sequence's queries.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step.
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks] int32: block ids of each sequence (0-padded).
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
