"""The cost model's fixed numbers, each with the reason for its value.

Settings an operator tunes are in pdd.config ([router.adaptive],
[router.threshold]); these are not settings: they are priors and rates of the
online fit, and fallbacks for what a worker does not report. Where a value was
decided by a measurement, docs/benchmarks.md has the run ("Approaches tried
and replaced").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModelConstants:
    # The step-time prior `a + c·decodes + b·prefill tokens + e·pairs`, before a worker is measured:
    prior_base_s: float = 0.01        # a: a GPU-class step; the fit moves off it within a few heartbeats of work
    prior_decode_s: float = 5e-5      # c: a decode (its attention reads the request's whole context)
    prior_token_s: float = 5e-5       # b: a prompt token, twice an H200's measured cost (a worker's own is unknown)
    prior_pair_s: float = 2e-9        # e: a query-key pair (H200, Llama-3.1-8B shape: "A prompt chunk beside decodes")
    # The ridge: how many measured step groups the prior weighs, and at what size of each feature.
    prior_weight: float = 0.1         # a, b, c: a tenth of a group, so a few groups of work override it
    prior_pair_weight: float = 3.0    # e: 3 groups; at 0.1 the fit traded e for b (2 ps and 41 us on H200 mixed steps)
    prior_decodes_at: int = 64        # ... c held at 64 decodes, a typical decode batch
    prior_tokens_at: int = 512        # ... b at 512 prompt tokens, one engine chunk
    prior_mpairs_at: float = 2.0      # ... e at 2M pairs: a 512-token chunk 4k deep in its prompt
    min_slope_share: float = 1e-3     # no fitted slope below this share of its prior: noise must not make work free
    # A worker's model scales the priors (m.StepLimits; a mixture of experts computes and reads only its active
    # experts): b by its prompt token's FLOPs against the model b was measured on, c up by its expert bytes per decode.
    prior_flops_per_token: float = 2 * 8.03e9   # Llama-3.1-8B, the shape of prior_token_s and prior_pair_s
    prior_hbm_bytes_s: float = 4.26e12          # DESIGN.md's measured H200 HBM copy: what reading weights costs
    # Fitting the heartbeats' step samples:
    group: int = 4                    # steps per sample: with async scheduling one step's latency is its predecessor's
    forget: float = 0.99              # weight kept per new group: the fit follows the last few hundred groups
    outlier: float = 3.0              # a group counts at most this many times its prediction (kernels compiling)
    shared_evidence: float = 0.1      # below this share of a same-device peer's prefill evidence, use its b and e
    smooth: float = 0.3               # heartbeat-to-heartbeat smoothing of prompt tokens per step and their depth
    # KV transfer rates (bytes/s) until transfers are measured:
    prior_cuda_ipc_bytes_s: float = 3e11   # docs/design.md's measured cross-process IPC copy, rounded down
    prior_tcp_bytes_s: float = 1e9         # a conservative loopback figure
    prior_local_bytes_s: float = 1e10      # two engines of one process (tests)
    # Host KV tier -> GPU (pdd.kv.tier): the tier's batched block copies of an
    # 8k-token Llama-3.1-8B conversation measured 46.8 GB/s on the H200 (85% of
    # a plain pinned copy; docs/benchmarks.md, "Host KV tier copies"), rounded down.
    host_load_bytes_s: float = 4.0e10
    # What a worker that reports no step limits is taken to have (m.StepLimits zeros):
    unreported_budget: int = 2048     # the engine's max_num_batched_tokens on the CPU
    unreported_chunk: int = 512       # the engine's default chunk_size
    # The role balance (cost/balance.py), which has a choice only with three or more colocated
    # workers that prefill for others (or two beside a decode worker); not measured:
    prefill_utilization: float = 0.7  # demand a prefill-leaning worker carries, of its measured prefill rate
    hysteresis: float = 0.2           # how far the demand falls below that before one stops leaning (no flapping)
    demand_window_s: float = 10.0     # time constant of the measured prefill demand (tokens/s)
    # Placement:
    prefix_weight: float = 0.5        # a fully cached prompt is worth this much load (pick_worker's affinity bonus)
    local_chunk_step: int = 64        # a local prefill's own chunk is a multiple of this (and never smaller)

    @property
    def prior_transfer_rates(self) -> dict[str, float]:
        """Bytes/s by backend."""
        return {"cuda_ipc": self.prior_cuda_ipc_bytes_s, "tcp": self.prior_tcp_bytes_s,
                "local": self.prior_local_bytes_s}


COSTS = CostModelConstants()
