"""Prompt logprobs: how likely the model found each prompt token, given the
tokens before it (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`).

A step normally computes logits only where it samples. For a request that
asks, each prompt chunk the step computes also yields the logits of its
positions: the logits at position q score the prompt token at q + 1, so a
prompt of P tokens has P - 1 entries (the first token has no context), and
the logits at P - 1 are the sampling row as for any request. Chunks arrive in
order, each adding its positions; a recompute (preemption) writes its
positions again. Such a request skips the prefix cache: a cached block's
positions would have no logits.

Entries are (logprob of the prompt token, its rank in the vocabulary with 1
the likeliest, [(token id, logprob), ...] the top N), as the model computed
them: no penalty or temperature applies to a prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.engine.staging import Staging

# Prompt rows scored per pass: logits of a whole chunk at once are
# chunk x vocabulary floats (2048 x 152k = 1.2 GB), several times over.
ROWS_PER_PASS = 512


@dataclass
class PromptRows:
    """The rows of a step's hidden states whose logits score prompt tokens."""
    indices: torch.Tensor                 # [R] rows of the step's hidden states
    targets: torch.Tensor                 # [R] the prompt token each row scores
    num_top: int                          # the most top logprobs a row wants
    # (schedule index, first logits position, rows, top logprobs it wants), in row order
    spans: list[tuple[int, int, int, int]]


@dataclass
class PromptScores:
    logprobs: torch.Tensor                # [R]
    ranks: torch.Tensor                   # [R] int64
    top_logprobs: torch.Tensor | None     # [R, N]
    top_ids: torch.Tensor | None


def plan(chunks: list[tuple[int, object, int, int, int]], staging: Staging) -> PromptRows | None:
    """chunks: (schedule index, request, first row in the step, start position,
    tokens) of each scheduled prompt chunk; the rows of those whose request
    collects prompt logprobs, or None."""
    indices, targets, spans, num_top = [], [], [], 0
    for i, req, row0, start, n in chunks:
        if req.prompt_logprobs is None:
            continue
        end = min(start + n, req.num_prompt_tokens - 1)   # the prompt's last position samples instead
        if end <= start:
            continue
        indices.extend(range(row0, row0 + end - start))
        targets.extend(req.all_token_ids[start + 1:end + 1])
        spans.append((i, start, end - start, req.sampling.prompt_logprobs))
        num_top = max(num_top, req.sampling.prompt_logprobs)
    if not spans:
        return None
    indices_d, targets_d = staging.upload([indices, targets], torch.int64)
    return PromptRows(indices_d, targets_d, num_top, spans)


def score(compute_logits, hidden: torch.Tensor, rows: PromptRows) -> PromptScores:
    """Score the rows' prompt tokens from `hidden` (compute_logits: hidden -> float32 logits)."""
    parts = []
    for lo in range(0, len(rows.indices), ROWS_PER_PASS):
        logits = compute_logits(hidden[rows.indices[lo:lo + ROWS_PER_PASS]])
        parts.append(score_tokens(logits, rows.targets[lo:lo + ROWS_PER_PASS], rows.num_top))
    cat = (lambda ts: torch.cat(ts) if ts[0] is not None else None)
    return PromptScores(*(cat([p[k] for p in parts]) for k in range(4)))


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> tuple:
    """logits [R, V] and the token each row scores [R] -> (logprob [R], rank [R],
    top logprobs [R, N] | None, top ids [R, N] | None)."""
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, targets[:, None])
    rank = (logp > lp).sum(dim=-1) + 1
    top_lp, top_ids = logp.topk(num_top, dim=-1) if num_top else (None, None)
    return lp[:, 0], rank, top_lp, top_ids


def entries(scores: PromptScores, rows: PromptRows, num_scheduled: int) -> list[tuple[int, list] | None]:
    """Per schedule index: (first logits position, [entry per position]) or None.
    Waits for the device (call where the step's results are taken)."""
    lps, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    top_lp = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    top_ids = scores.top_ids.tolist() if scores.top_ids is not None else None
    out: list[tuple[int, list] | None] = [None] * num_scheduled
    row = 0
    for i, start, n, num_top in rows.spans:
        out[i] = (start, [(lps[r], ranks[r], list(zip(top_ids[r][:num_top], top_lp[r][:num_top])) if num_top else [])
                          for r in range(row, row + n)])
        row += n
    return out
