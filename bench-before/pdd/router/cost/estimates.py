"""One frozen snapshot of what the cost model predicts, as placement reads it.

`Estimator.estimates()` builds it from the step fit, the load and the
transfer rates; placement prices its options with these methods and changes
nothing. Times in seconds, work in tokens.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdd.api import query_key_pairs
from pdd.router.cost.constants import COSTS

LEAN_PREFILL, LEAN_DECODE = "prefill", "decode"


@dataclass(frozen=True)
class WorkerEstimate:
    """One worker as placement sees it; times in seconds, work in tokens."""
    step_base_s: float              # a: a step's cost whatever it holds
    step_token_s: float             # b: each prefill token it computes
    step_decode_s: float = COSTS.prior_decode_s   # c: each request it decodes
    step_pair_s: float = COSTS.prior_pair_s       # e: each query-key pair of its prompt chunks
    pending_tokens: int = 0         # prompt tokens admitted here and not computed yet
    pending_long_tokens: int = 0    # ... of them long prompts' (more than long_threshold left to compute)
    pending_long: int = 0           # ... and how many long prompts those are
    decoding: int = 0               # requests decoding here (each a decode token per step)
    prefill_per_step: float = 0.0   # prefill tokens its recent steps carried, on average
    prefill_depth: float = 0.0      # query-key pairs per prefill token of its recent steps
    budget: int = COSTS.unreported_budget   # max_num_batched_tokens
    chunk: int = COSTS.unreported_chunk     # the most prompt tokens of one request per step
    beside: int = 0                 # the most prompt tokens per step beside decodes (0: the budget)
    chunk_alone: bool = False       # a prompt gets `chunk` even in a step where nothing decodes
    long_threshold: int = 0         # short prompts pass longer ones (0: first come, first served)
    long_partial: int = 1           # long prompts in partial prefill at once
    long_share: float = 0.0         # of a step's prompt tokens, what those are sure of together
    leaning: str = LEAN_DECODE      # which work the router steers here first
    samples: int = 0                # step groups measured so far

    def step_s(self, decodes: float, prefill: float = 0.0, pairs: float = 0.0) -> float:
        return self.step_base_s + self.step_decode_s * decodes + self.step_token_s * prefill + self.step_pair_s * pairs

    def prefill_s(self, tokens: int, behind: int = 0, for_others: bool = False, cached: int = 0,
                  chunk: int = 0, queued: bool = False) -> float:
        """Until `tokens` more prompt tokens are computed here, after `cached`
        ones of the same prompt, behind `behind` others and, when `queued`,
        behind the prompts pending here that its scheduler computes first
        (ahead_of); the running decodes ride in every step, prompts ahead at
        the depth this worker's prompts lately had. `for_others`: prompts
        computed for other workers, which the engine schedules as if nothing
        decoded here. `chunk`: the request's own chunk beside decodes (0: the worker's)."""
        beside = self.decoding and not for_others
        room = max(1, self.prefill_room if beside else self.budget - self.decoding)   # prefill tokens a step takes
        # ... of one request: a chunk beside decodes; alone, the whole step
        # (EngineConfig.chunk_only_beside_decodes) unless the worker chunks always
        whole = max(1, min(self.chunk, room) if beside or self.chunk_alone else room)
        if queued:
            behind += self.ahead_of(tokens, room, whole)
        if tokens <= 0 and behind <= 0:
            return 0.0
        own = max(1, min(self.chunk, chunk, room)) if chunk and beside else whole
        steps = math.ceil(behind / room) + math.ceil(tokens / own)
        pairs = behind * self.prefill_depth + query_key_pairs(cached, tokens)
        return steps * self.step_s(self.decoding) + self.step_token_s * (behind + tokens) + self.step_pair_s * pairs

    def ahead_of(self, tokens: int, room: int, chunk: int) -> int:
        """Of the prompt tokens pending here, those computed before a new
        prompt of `tokens` to compute is done, in steps of `room` prompt tokens
        and at most `chunk` of one prompt. First come, first served
        (long_threshold 0), and for a long prompt: all of them (short prompts
        that come later pass it too, which this leaves out). A short prompt
        passes the long ones: the short tokens, its own included, go first in
        each step, less the floors set aside for the long prompts in partial
        prefill, so they take s = ⌈(short + tokens) / (room − floors)⌉ steps;
        the long prompts take what the short ones leave of those steps (at
        least their floors, at most a chunk each a step and all they have).
        Approximate as the FIFO model is: every prompt pending is ready in
        the first of those steps, and blocks and sequence slots do not bind."""
        if not self.long_threshold or tokens > self.long_threshold:
            return self.pending_tokens
        short, long = self.pending_tokens - self.pending_long_tokens, self.pending_long_tokens
        partial = min(self.long_partial, self.pending_long)
        steps = math.ceil((short + tokens) / max(1, room - partial * self.long_floor))
        return short + min(long, steps * room - short - tokens, steps * partial * max(chunk, self.long_floor))

    @property
    def long_floor(self) -> int:
        """Prompt tokens each long prompt in partial prefill is sure of in a
        step: its part of long_share of the prompt tokens a step allows."""
        allowed = self.beside if self.beside and self.decoding else self.budget
        return max(1, int(self.long_share * allowed / max(1, self.long_partial)))

    @property
    def prefill_room(self) -> int:
        """Prompt tokens one of its steps can take beside its decodes."""
        room = self.budget - self.decoding
        return min(room, self.beside) if self.beside and self.decoding else room

    @property
    def riding(self) -> float:
        """Prefill tokens its steps carry now: lately, or a chunk of what is pending."""
        return min(max(self.prefill_per_step, min(self.pending_tokens, self.chunk)),
                   max(0, self.prefill_room))

    def harm_s(self, tokens: int, cached: int = 0) -> float:
        """Request-seconds that computing `tokens` prompt tokens (after `cached`
        ones) here adds to the requests decoding here."""
        return self.decoding * (self.step_token_s * tokens + self.step_pair_s * query_key_pairs(cached, tokens))

    def chunk_step_s(self, chunk: int = 0, start: int = 0) -> float:
        """A step that carries one more prefill chunk (`chunk` tokens, 0: the
        worker's; `start` tokens of its prompt before it) beside this worker's
        decodes and the prefill already riding: the gap its running requests see."""
        room = max(0, self.prefill_room)
        riding = self.riding
        own = max(0, min(room, riding + max(1, min(chunk or self.chunk, room))) - riding)
        return self.step_s(self.decoding, riding + own,
                           riding * self.prefill_depth + query_key_pairs(start, int(own)))

    def tpot_s(self) -> float:
        """A step of this worker with one more request decoding, beside the prefill it carries."""
        return self.step_s(self.decoding + 1, self.riding, self.riding * self.prefill_depth)

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second in full prefill steps (at the depth its
        prompts lately had, or a whole-budget prompt's)."""
        depth = max(self.prefill_depth, query_key_pairs(0, self.budget) / self.budget)
        return self.budget / self.step_s(0, self.budget, self.budget * depth)


@dataclass(frozen=True)
class Estimates:
    workers: Mapping[str, WorkerEstimate]
    transfer_s_per_token: Mapping[str, float]     # by backend
    demand_tokens_s: float = 0.0

    def transfer_s(self, backend: str, tokens: int) -> float:
        return tokens * self.transfer_s_per_token.get(backend, 0.0)
