"""Repetition, frequency and presence penalties, as vLLM defines them.

For each token of the vocabulary, on the logits before temperature, top-k and
the rest of sampling (and after tokens a request may not sample are masked):

    repetition  the token is in the prompt or the output so far: a positive
                logit is divided by the penalty, a negative one multiplied
                (Hugging Face's RepetitionPenaltyLogitsProcessor is the same)
    frequency   minus penalty x the times the token is in the output so far
    presence    minus penalty if the token is in the output at all

"Output" is what the request sampled, wherever that was: a request resumed
on another worker carries its earlier output as the tail of its prompt
(Request.output_start says where it begins), and a decode worker has the
first token the prefill worker sampled. So every layout penalizes alike.

The tensors are built per step, for the rows that have a penalty only (none
when no row has one: nothing is built and `sample` skips this). They are
made on the device from uploaded token lists; a token the step in flight
samples (async scheduling) is counted from the device, so the host never
waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdd.engine.staging import Staging


@dataclass
class PenaltyRow:
    """What one sampled row's penalties need, read from its request on the host."""
    prompt_ids: np.ndarray        # distinct ids of the request's prompt (not its earlier output)
    output_ids: list[int]         # its output tokens known on the host, earlier output included
    repetition: float
    frequency: float
    presence: float
    # Row of the step in flight's sampled tokens holding one more output token
    # (the input of this step the host does not have yet); None: none.
    in_flight_row: int | None = None


@dataclass
class Penalties:
    """Per-step penalty tensors for rows `rows` of the logits."""
    rows: torch.Tensor            # [P] int64: rows of the batch with a penalty
    repetition: torch.Tensor      # [P, 1] float32
    frequency: torch.Tensor       # [P, 1] float32
    presence: torch.Tensor        # [P, 1] float32
    output_counts: torch.Tensor   # [P, V] float32: times each token was sampled so far
    prompt_seen: torch.Tensor     # [P, V] bool: the token is in the prompt

    @classmethod
    def build(cls, rows: dict[int, PenaltyRow], vocab: int, device: torch.device, staging: Staging,
              in_flight_tokens: torch.Tensor | None = None) -> Penalties | None:
        """rows: batch row -> its PenaltyRow, for the rows with a penalty; None
        when there is none. in_flight_tokens: the step in flight's sampled
        tokens on the device (needed when a row has an in_flight_row)."""
        if not rows:
            return None
        items = list(rows.items())
        prompt_p = np.concatenate([np.full(len(r.prompt_ids), p) for p, (_, r) in enumerate(items)])
        prompt_t = np.concatenate([r.prompt_ids for _, r in items])
        out_p = np.concatenate([np.full(len(r.output_ids), p) for p, (_, r) in enumerate(items)])
        out_t = np.concatenate([np.asarray(r.output_ids, dtype=np.int64) for _, r in items])
        flying = [(p, r.in_flight_row) for p, (_, r) in enumerate(items) if r.in_flight_row is not None]
        ints = staging.upload([[row for row, _ in items], prompt_p, prompt_t, out_p, out_t,
                               [p for p, _ in flying], [f for _, f in flying]], torch.int64)
        batch_rows, prompt_p, prompt_t, out_p, out_t, fly_p, fly_rows = ints
        rep, freq, pres = staging.upload([[r.repetition for _, r in items], [r.frequency for _, r in items],
                                          [r.presence for _, r in items]], torch.float32)
        n = len(items)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        seen[prompt_p, prompt_t] = True
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        ones = counts.new_ones(())
        counts.index_put_((out_p, out_t), ones.expand(out_t.shape), accumulate=True)
        if flying:
            counts.index_put_((fly_p, in_flight_tokens[fly_rows]), ones.expand(fly_p.shape), accumulate=True)
        return cls(batch_rows, rep[:, None], freq[:, None], pres[:, None], counts, seen)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """logits [B, V] float32 -> the penalized logits (a new tensor; rows without a penalty unchanged)."""
    x = logits[pen.rows]
    in_output = pen.output_counts > 0
    repeated = pen.prompt_seen | in_output
    x = torch.where(repeated, torch.where(x > 0, x / pen.repetition, x * pen.repetition), x)
    x = x - pen.frequency * pen.output_counts - pen.presence * in_output
    return logits.index_copy(0, pen.rows, x)


def penalty_row(req, position: int, in_flight_row: int | None) -> PenaltyRow | None:
    """The penalty inputs of `req` sampling the token at `position`, or None
    when its penalties are neutral. The tokens before `position` are its
    all_token_ids, plus the one in flight when `in_flight_row` is set."""
    sp = req.sampling
    if not sp.penalized:
        return None
    return PenaltyRow(req.distinct_prompt_ids(), req.all_token_ids[req.output_start:position],
                      sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, in_flight_row)
