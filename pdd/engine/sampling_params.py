"""What a request asks of the sampler and of stopping."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the offending field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0          # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    # None: a random seed is drawn at admission, so the request's randomness is
    # still a function of (seed, position) and survives preemption or migration.
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings are matched on text, where text is made (router, offline API);
    # the engine only sees token ids.
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None   # top-N logprobs per sampled token; 0 = only the sampled one

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        def bad(field_name: str, why: str):
            raise InvalidRequest(f"{field_name}: {why}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs!r}")
        if self.seed is None:
            self.seed = random.getrandbits(63)
        # Keep the seed inside int64 so it fits a tensor on any device.
        self.seed &= (1 << 63) - 1
        return self
