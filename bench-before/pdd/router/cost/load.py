"""What a worker has to do, and what the cluster is asked for: queues and demand.

Per worker: prompt tokens admitted and not computed (and of them the long
prompts', which its scheduler lets short ones pass), requests decoding, and
the prompt tokens its recent steps carried (and how deep in their prompts) —
from the last heartbeat, plus what the router placed there since. For the
cluster: the prefill demand, prompt tokens/s placed on prefill work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdd.protocol import messages as m


@dataclass
class WorkerLoad:
    pending: int = 0                  # from the last heartbeat ...
    pending_long: int = 0             #    of which long prompts' tokens
    long_prompts: int = 0             #    and how many long prompts
    decoding: int = 0
    placed: list[int] = field(default_factory=list)   # ... plus the prompts placed here since (tokens each)
    placed_decodes: int = 0
    prefill_per_step: float = 0.0     # prompt tokens per step, smoothed
    prefill_depth: float = 0.0        # query-key pairs per prompt token, smoothed

    @property
    def pending_tokens(self) -> int:
        return self.pending + sum(self.placed)

    def long_pending(self, threshold: int) -> tuple[int, int]:
        """Of pending_tokens, the tokens of prompts longer than `threshold` (the
        worker's; 0: none is long) and how many prompts they are."""
        if not threshold:
            return 0, 0
        placed = [tokens for tokens in self.placed if tokens > threshold]
        return self.pending_long + sum(placed), self.long_prompts + len(placed)

    def clear(self) -> None:
        """Nothing queued or decoding (the worker left; what it measured stays)."""
        self.pending = self.pending_long = self.long_prompts = self.decoding = self.placed_decodes = 0
        self.placed.clear()

    @property
    def decodes(self) -> int:
        return self.decoding + self.placed_decodes

    def observe(self, hb: m.Heartbeat, smooth: float) -> None:
        chunked = sum(sum(step.prefill_chunks) for step in hb.steps)
        recent = chunked / len(hb.steps) if hb.steps else 0.0     # an idle worker carries none
        self.prefill_per_step += smooth * (recent - self.prefill_per_step)
        prefill = sum(step.num_tokens - step.num_decodes for step in hb.steps)
        if prefill > 0:      # no prompt computed: the depth of its last ones stands
            self.prefill_depth += smooth * (sum(step.prefill_pairs for step in hb.steps) / prefill
                                            - self.prefill_depth)
        # The heartbeat counts what reached the worker before it; what was
        # placed since counts again from here (a placement in flight at that
        # moment is missed until the next one, 0.5 s later).
        self.pending, self.decoding = hb.prefill_tokens_pending, hb.decoding
        self.pending_long, self.long_prompts = hb.long_prefill_tokens_pending, hb.long_prefills_pending
        self.placed.clear()
        self.placed_decodes = 0


class Demand:
    """Prompt tokens/s placed, averaged with a `window_s` time constant (decays while none come)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._rate = 0.0                  # tokens/s at _at
        self._at: float | None = None

    def add(self, tokens: int, now: float) -> None:
        self._rate = self.rate(now) + tokens / self.window_s
        self._at = now

    def rate(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._at) / self.window_s)
