"""What a worker's engine step costs, fitted online from its heartbeats.

`step ≈ a + c·decodes + b·prefill tokens + e·prefill query-key pairs`: decodes
and prompt tokens cost differently (a decode reads its whole context, a prompt
token is matmul work), and a chunk deep in a long prompt attends to all of it
(the pairs term). Why each part is there: docs/design.md, "Adaptive
disaggregation".
"""
from __future__ import annotations

from collections.abc import Iterable

from pdd.api import StepSample
from pdd.router.cost.constants import COSTS, CostModelConstants

MEGA = 1e6   # pairs are fitted in millions: the features stay within a few orders of magnitude of each other


class StepFit:
    """Weighted least squares of y = a + c·decodes + b·prefill + e·pairs with
    exponential forgetting, held toward the prior by a ridge (CostModelConstants).
    A worker that only decodes fits a and c and keeps the prior b and e; one
    that only prefills keeps the prior c; prompts all at one depth leave e near
    its prior (held harder than the others): a slope is never invented from noise."""

    def __init__(self, costs: CostModelConstants = COSTS):
        self.costs = costs
        self.prior = (costs.prior_base_s, costs.prior_decode_s, costs.prior_token_s, costs.prior_pair_s * MEGA)
        w = costs.prior_weight
        self.ridge = (w, w * costs.prior_decodes_at ** 2, w * costs.prior_tokens_at ** 2,
                      costs.prior_pair_weight * costs.prior_mpairs_at ** 2)
        n = len(self.prior)
        self.xx = [[0.0] * n for _ in range(n)]     # Σw·x·xᵀ, x = (1, decodes, prefill, Mpairs)
        self.xy = [0.0] * n                          # Σw·x·y
        self.n = 0                                   # groups fitted
        self.group: list[tuple[int, int, int, float]] = []   # steps not yet a group

    @property
    def prefill_evidence(self) -> float:
        """Σw·prefill²: how much its prefill slopes rest on measurements."""
        return self.xx[2][2]

    def observe(self, steps: Iterable[StepSample]) -> None:
        """A heartbeat's steps, fitted `costs.group` at a time (a group is off by
        one step only at its edges, where one step's latency is not)."""
        size = self.costs.group
        for step in steps:
            self.group.append((step.num_decodes, step.num_tokens - step.num_decodes, step.prefill_pairs,
                               step.latency_s))
            if len(self.group) == size:
                self.add(*(sum(g[i] for g in self.group) / size for i in range(4)))
                self.group.clear()

    def predict(self, decodes: float, prefill: float, pairs: float = 0.0) -> float:
        a, c, b, e = self.solve()
        return a + c * decodes + b * prefill + e * pairs

    def add(self, decodes: float, prefill: float, pairs: float, y: float) -> None:
        y = min(y, self.costs.outlier * self.predict(decodes, prefill, pairs))
        x = (1.0, decodes, prefill, pairs / MEGA)
        forget = self.costs.forget
        for i in range(len(x)):
            self.xy[i] = self.xy[i] * forget + x[i] * y
            for j in range(len(x)):
                self.xx[i][j] = self.xx[i][j] * forget + x[i] * x[j]
        self.n += 1

    def solve(self) -> tuple[float, float, float, float]:
        """(a, c, b, e), e per pair."""
        n = len(self.prior)
        m = [row[:] + [self.xy[i] + self.ridge[i] * self.prior[i]] for i, row in enumerate(self.xx)]
        for i in range(n):
            m[i][i] += self.ridge[i]
        # Gaussian elimination; the ridge keeps the matrix positive definite.
        for i in range(n):
            for k in range(i + 1, n):
                f = m[k][i] / m[i][i]
                for j in range(i, n + 1):
                    m[k][j] -= f * m[i][j]
        sol = [0.0] * n
        for i in reversed(range(n)):
            sol[i] = (m[i][n] - sum(m[i][j] * sol[j] for j in range(i + 1, n))) / m[i][i]
        a, c, b, e = sol
        floor = self.costs.min_slope_share
        return (max(a, 0.0), max(c, self.costs.prior_decode_s * floor), max(b, self.costs.prior_token_s * floor),
                max(e / MEGA, self.costs.prior_pair_s * floor))
