"""Random weights shaped like a trained LLM's, for measuring what quantization does
without a trained checkpoint (benchmarks.fp8_error).

I.i.d. Gaussian weights are the easy case for any quantizer: every row and column
has the same range, nothing sticks out. Trained Llama-family weights do not look
like that, and `llm-like` draws these features of them, each a knob below:
- heavy tails: each element is z * exp(s * z' - s^2), a Gaussian scale mixture
  (kurtosis 3 * exp(4 s^2): 6.7 at s = 0.45, where a Gaussian has 3);
- spread between channels: each output row and each input column has a
  log-normal scale, so one per-tensor scale is set by the widest rows;
- outlier weights: a few elements in 10,000 at 10-20 times the layer's std;
- outlier key channels: in k_proj, 2 channels of every KV head 8 times wider,
  the channels that make keys hard for a per-layer KV scale;
- outlier activation channels: the pre-attention and pre-MLP RMSNorm gains of a
  few hidden dimensions 20 times the others, so the inputs of the linears carry
  the few large channels trained models have ("massive activations").
The embedding is narrow next to the layers' outputs, so a token's own embedding
does not decide its logits (pdd.model.make_model explains why a random model
otherwise only repeats its input). These are random numbers with these traits,
not a trained model: no claim that their numeric errors equal a trained model's.
"""
from __future__ import annotations

import torch

from pdd.model.llama import PACKED_MODULES, CausalLM
from pdd.model.loader import shard_slice
from pdd.model.make_weights import TIED_EMBED_STD

DISTRIBUTIONS = ("llm-like", "gaussian", "checkpoint")

ELEMENT_TAIL = 0.45       # s of the scale mixture
CHANNEL_SPREAD = 0.4      # sigma of log(row scale), log(column scale)
OUTLIER_WEIGHTS = 1e-4    # share of elements that are outliers
OUTLIER_WEIGHT_SIZE = (10.0, 20.0)
KEY_OUTLIER_CHANNELS = 2  # per KV head
KEY_OUTLIER_SIZE = 8.0
ACT_OUTLIER_DIMS = 1 / 512  # share of hidden dims (at least one)
ACT_OUTLIER_GAIN = 20.0


@torch.no_grad()
def fill(model: CausalLM, distribution: str, seed: int = 0) -> None:
    """Overwrite every parameter of `model` with `distribution`'s random weights
    (`checkpoint`: leave them). The same (model shape, distribution, seed, device)
    gives the same weights."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown weight distribution {distribution!r}; choose from {DISTRIBUTIONS}")
    if distribution == "checkpoint":
        return
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    llm_like = distribution == "llm-like"
    cfg = model.config
    for name, p in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if name == "model.embed_tokens.weight":
            w = _elements(p.shape, gen, device, llm_like) * TIED_EMBED_STD
        elif name == "lm_head.weight":
            w = _elements(p.shape, gen, device, llm_like) * cfg.hidden_size ** -0.5
        elif p.dim() == 1:
            w = _norm_gain(name, p.shape[0], gen, device, llm_like) if "norm" in name else \
                0.1 * torch.randn(p.shape, generator=gen, device=device)
        else:
            w = torch.empty(p.shape, device=device)
            for hf_name, rows in shards(model, module_name):
                w[rows] = _linear(hf_name, rows.stop - rows.start, p.shape[1], cfg.head_dim, gen, device, llm_like)
        p.copy_(w)


def shards(model: CausalLM, module_name: str) -> list[tuple[str, slice]]:
    """(HF module name, rows) of each tensor packed into linear `module_name`."""
    prefix, _, attr = module_name.rpartition(".")
    packed = sorted((shard, frag) for frag, (p, shard) in PACKED_MODULES.items() if p == attr)
    if not packed:
        return [(module_name, slice(0, model.get_submodule(module_name).out_features))]
    return [(f"{prefix}.{frag}", shard_slice(model, module_name, shard)) for shard, frag in packed]


def _elements(shape, gen: torch.Generator, device, llm_like: bool) -> torch.Tensor:
    """Unit-variance elements: Gaussian, or the heavy-tailed scale mixture."""
    z = torch.randn(shape, generator=gen, device=device)
    if not llm_like:
        return z
    # E[exp(2 s z' - 2 s^2)] = 1: the mixture keeps unit variance.
    return z * torch.exp(ELEMENT_TAIL * torch.randn(shape, generator=gen, device=device) - ELEMENT_TAIL ** 2)


def _log_normal(n: int, sigma: float, gen: torch.Generator, device) -> torch.Tensor:
    return torch.exp(sigma * torch.randn(n, generator=gen, device=device) - sigma ** 2 / 2)


def _linear(hf_name: str, n: int, k: int, head_dim: int, gen: torch.Generator, device,
            llm_like: bool) -> torch.Tensor:
    """One HF weight [n, k], scaled to the std of a Gaussian init (k^-0.5)."""
    w = _elements((n, k), gen, device, llm_like)
    if llm_like:
        w *= _log_normal(n, CHANNEL_SPREAD, gen, device)[:, None]
        w *= _log_normal(k, CHANNEL_SPREAD, gen, device)[None, :]
        if hf_name.endswith("k_proj"):
            heads = torch.arange(0, n, head_dim, device=device)
            picks = torch.randint(0, head_dim, (heads.numel(), KEY_OUTLIER_CHANNELS), generator=gen, device=device)
            w[(heads[:, None] + picks).reshape(-1)] *= KEY_OUTLIER_SIZE
        w = w / w.std()
        lo, hi = OUTLIER_WEIGHT_SIZE
        mask = torch.rand((n, k), generator=gen, device=device) < OUTLIER_WEIGHTS
        size = lo + (hi - lo) * torch.rand((n, k), generator=gen, device=device)
        w = torch.where(mask, torch.sign(w) * size, w)
    return w * k ** -0.5


def _norm_gain(name: str, n: int, gen: torch.Generator, device, llm_like: bool) -> torch.Tensor:
    if not llm_like:
        return torch.ones(n, device=device)
    gain = _log_normal(n, 0.2, gen, device)
    if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
        dims = torch.randperm(n, generator=gen, device=device)[:max(1, int(n * ACT_OUTLIER_DIMS))]
        gain[dims] *= ACT_OUTLIER_GAIN
    return gain
