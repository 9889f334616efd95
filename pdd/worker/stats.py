"""Per-step samples a worker reports to the router in its heartbeats."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdd.engine.engine import StepStats

_MAX_SAMPLES = 2048  # per heartbeat; older samples are dropped, not queued forever


@dataclass
class StepSamples:
    step_latencies: list[float] = field(default_factory=list)
    prefill_chunks: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)


class StepStatsBuffer:
    def __init__(self):
        self.samples = StepSamples()

    def record(self, step: StepStats) -> None:
        s = self.samples
        if step.num_tokens == 0 or len(s.step_latencies) >= _MAX_SAMPLES:
            return
        s.step_latencies.append(step.latency_s)
        s.prefill_chunks.extend(step.prefill_chunks)
        if step.num_decodes:
            s.decode_batches.append(step.num_decodes)

    def drain(self) -> StepSamples:
        out, self.samples = self.samples, StepSamples()
        return out
