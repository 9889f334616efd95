"""Types that the engine, the workers, the router and the wire share.

They live here, not in engine/ (which imports torch) or protocol/, so that any
side can use them without importing another side's machinery: the router
never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepSample:
    """One engine step, as the engine measured it, a worker journals it and a
    heartbeat carries it to the router (histograms, and the step-cost model of
    pdd.router.estimator, which prices decode and prompt tokens apart and a
    chunk deep in its prompt by its query-key pairs)."""
    latency_s: float = 0.0
    num_tokens: int = 0                 # tokens computed: decodes + prompt-chunk tokens
    num_decodes: int = 0                # decode tokens among them (one per decoding request)
    prefill_chunks: list[int] = field(default_factory=list)   # tokens of each prompt chunk
    prefill_pairs: int = 0              # query-key pairs of its prompt chunks (pdd.engine.request.query_key_pairs)
