"""The sparse MLP of a mixture of experts (Qwen3-MoE, Mixtral).

A router (`gate`, [E, H]) scores each token against every expert; the token
goes to its top-k experts and their outputs are summed, weighted by the
softmax of the chosen scores (pdd.ops.route defines the weights). The experts
are stacked, not a ModuleList: `gate_up_proj` [E, 2*I, H] (each expert's gate
rows, then its up rows) and `down_proj` [E, H, I], so one grouped GEMM of each
covers every expert (pdd.ops.fused_moe; docs/design.md, "Mixture of experts").
The loader fills expert e's rows from the checkpoint's per-expert tensors
(EXPERT_TENSORS).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pdd import ops
from pdd.model.config import ModelConfig
from pdd.fp8_format import FP8_DTYPE

FP8_BLOCK = 128   # the block scales' tile the fused kernels take (pdd.ops.triton_moe)

# The checkpoint's expert tensors, by family: `...experts.{e}.{name}.weight` ->
# (our stacked parameter, the shard of its rows: 0 gate, 1 up, None the whole
# expert). Mixtral calls gate/up/down w1/w3/w2 and the block `block_sparse_moe`.
EXPERT_TENSORS = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
}
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
_EXPERT_NAME = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MIXTRAL_BLOCK = ".block_sparse_moe."


def expert_target(hf_name: str) -> tuple[str, int, int | None] | None:
    """HF expert tensor name -> (our stacked parameter, expert index, shard of its
    rows), or None for a tensor that is not one expert's."""
    m = _EXPERT_NAME.match(hf_name)
    if m is None or m.group(3) not in EXPERT_TENSORS:
        return None
    param, shard = EXPERT_TENSORS[m.group(3)]
    return f"{m.group(1)}.mlp.experts.{param}", int(m.group(2)), shard


def hf_expert_name(family: str, param: str, expert: int, shard: int | None) -> str:
    """The checkpoint's name of expert `expert`'s tensor that fills `shard` of our `param`."""
    layer = param.split(".mlp.experts.")[0]
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    wanted = (param.rsplit(".", 1)[1], shard)
    names = [n for n, target in EXPERT_TENSORS.items() if target == wanted]
    return f"{layer}.{block}.experts.{expert}.{names[1 if family == 'mixtral' else 0]}.weight"


def module_name(hf_name: str) -> str:
    """Mixtral's `block_sparse_moe` is our `mlp` (its router too)."""
    return hf_name.replace(_MIXTRAL_BLOCK, ".mlp.")


class Experts(nn.Module):
    """Every expert's weights stacked along dim 0, as the fused kernels read them.
    FP8 (use_fp8): the checkpoint's float8 weights as they are, with their 128x128
    block scales stacked the same way ([E, ceil(N/128), ceil(K/128)])."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.gate_up_weight_scale: nn.Parameter | None = None
        self.down_weight_scale: nn.Parameter | None = None

    def fp8_unsupported(self, block: tuple[int, int] | None) -> str | None:
        """Why the fused kernels cannot take these experts in FP8 (then the loader
        dequantizes them), or None."""
        if block != (FP8_BLOCK, FP8_BLOCK):
            return f"the fused expert kernels take 128x128 block scales, not {block or 'per-tensor/channel'}"
        if self.intermediate_size % FP8_BLOCK:
            return f"intermediate size {self.intermediate_size} is not a multiple of 128 (up rows mid-block)"
        return None

    def use_fp8(self) -> None:
        """Hold FP8 weights and block scales (filled by load_fp8)."""
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            e, n, k = w.shape
            setattr(self, name, nn.Parameter(torch.empty(e, n, k, dtype=FP8_DTYPE, device=w.device),
                                             requires_grad=False))
            scale = torch.ones(e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK), dtype=torch.float32, device=w.device)
            setattr(self, name.replace("_proj", "_weight_scale"), nn.Parameter(scale, requires_grad=False))

    @property
    def fp8(self) -> bool:
        return self.gate_up_weight_scale is not None

    @torch.no_grad()
    def load_fp8(self, param: str, expert: int, rows: slice, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Expert `expert`'s FP8 tensor of rows `rows` of `param` with its block scale."""
        getattr(self, param)[expert, rows].copy_(weight)
        scales = getattr(self, param.replace("_proj", "_weight_scale"))
        scales[expert, rows.start // FP8_BLOCK:-(-rows.stop // FP8_BLOCK)].copy_(scale)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = ops.linear(x, self.gate)  # [T, E]
        ex = self.experts
        return ops.fused_moe(x, router_logits, ex.gate_up_proj, ex.down_proj, self.top_k, self.renormalize,
                             ex.gate_up_weight_scale, ex.down_weight_scale)
