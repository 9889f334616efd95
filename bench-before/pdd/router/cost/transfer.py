"""What moving a prompt's KV costs: the measured rate of each transfer backend."""
from __future__ import annotations

from pdd.kv.layout import KVLayout
from pdd.router.cost.constants import COSTS, CostModelConstants

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class TransferRates:
    """Bytes/s by backend: the prior until transfers finish, then their smoothed rate."""

    def __init__(self, costs: CostModelConstants = COSTS):
        self.smooth = costs.smooth
        self.rate = dict(costs.prior_transfer_rates)

    def observe(self, backend: str, stats: dict) -> None:
        """A finished transfer's bytes and seconds (PrefillDone). Its seconds span
        the prompt's compute too, so the rate errs low (safe)."""
        nbytes, seconds = float(stats.get("bytes", 0)), float(stats.get("seconds", 0.0))
        if backend and nbytes > 0 and seconds > 0:
            old = self.rate.get(backend, nbytes / seconds)
            self.rate[backend] = old + self.smooth * (nbytes / seconds - old)

    def seconds_per_token(self, layout: KVLayout | None) -> dict[str, float]:
        per_token = bytes_per_token(layout)
        return {b: per_token / rate for b, rate in self.rate.items()}


def bytes_per_token(layout: KVLayout | None) -> float:
    """K and V of every layer of one token, in the cache's dtype (FP8: half of bf16)."""
    if layout is None:
        return 0.0
    return 2.0 * layout.num_layers * layout.num_kv_heads * layout.head_dim * _DTYPE_BYTES.get(layout.kv_cache_dtype, 2)
