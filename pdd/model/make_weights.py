"""The tensors of a made checkpoint: every parameter's shape and distribution in a
fixed order (dense MLPs, and the router and experts of the sparse families), drawn
from one seeded generator; FP8 ones quantized as make_fp8 says (pdd.model.make_model)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdd.model.make_fp8 import fp8_tensors

if TYPE_CHECKING:  # torch is imported only when weights are made: the router never pays for it
    import torch

TIED_EMBED_STD = 0.08
TIED_FINAL_NORM_GAIN = 4.0


def _param_specs(cfg: dict[str, Any], arch: str) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, shape, mean, std) for every tensor, in the fixed order they are drawn."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def linear(name: str, out_f: int, in_f: int) -> tuple[str, tuple[int, ...], float, float]:
        return (name, (out_f, in_f), 0.0, in_f ** -0.5)

    def norm(name: str, size: int) -> tuple[str, tuple[int, ...], float, float]:
        return (name, (size,), 1.0, 0.1)  # random, not ones, so a skipped norm shows up

    tied = cfg["tie_word_embeddings"]
    # A tied head scores token y by h . E[y], and h carries the current token's
    # own embedding: with a wide embedding the model only ever repeats its input.
    # A narrow embedding plus a large final-norm gain keeps outputs varied and
    # top-1 margins clear.
    embed_std = TIED_EMBED_STD if tied else 1.0
    specs = [("model.embed_tokens.weight", (cfg["vocab_size"], h), 0.0, embed_std)]
    for i in range(cfg["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn"
        for proj, out_f in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            specs.append(linear(f"{attn}.{proj}.weight", out_f, h))
            if arch == "qwen2":  # Qwen2 always has q/k/v bias (never o_proj bias)
                specs.append((f"{attn}.{proj}.bias", (out_f,), 0.0, 0.1))
        specs.append(linear(f"{attn}.o_proj.weight", h, q_out))
        if arch in ("qwen3", "qwen3_moe"):
            specs += [norm(f"{attn}.q_norm.weight", hd), norm(f"{attn}.k_norm.weight", hd)]
        specs += _mlp_specs(cfg, arch, i, linear)
        specs += [
            norm(f"model.layers.{i}.input_layernorm.weight", h),
            norm(f"model.layers.{i}.post_attention_layernorm.weight", h),
        ]
    specs.append(("model.norm.weight", (h,), TIED_FINAL_NORM_GAIN if tied else 1.0, 0.1))
    if not tied:
        # Wider than 1/sqrt(h): clear top-1 margins keep greedy decoding stable across implementations.
        specs.append(("lm_head.weight", (cfg["vocab_size"], h), 0.0, 3.0 * h ** -0.5))
    return specs


# The router's weights are wider than 1/sqrt(h): its logits spread over a few
# units, so the k-th and (k+1)-th experts of a token are never near a tie that
# float rounding could flip between implementations.
ROUTER_STD_GAIN = 3.0

# HF names of an expert's (gate, up, down) projections, by family.
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _mlp_specs(cfg: dict[str, Any], arch: str, layer: int, linear) -> list[tuple[str, tuple[int, ...], float, float]]:
    """A layer's dense MLP, or its router and experts under the family's published names."""
    h = cfg["hidden_size"]
    if not _is_sparse(cfg, arch, layer):
        mlp, inter = f"model.layers.{layer}.mlp", cfg["intermediate_size"]
        return [linear(f"{mlp}.gate_proj.weight", inter, h), linear(f"{mlp}.up_proj.weight", inter, h),
                linear(f"{mlp}.down_proj.weight", h, inter)]
    if arch == "mixtral":
        block = f"model.layers.{layer}.block_sparse_moe"
        experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    else:
        block = f"model.layers.{layer}.mlp"
        experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    gate, up, down = EXPERT_NAMES[arch]
    specs = [(f"{block}.gate.weight", (experts, h), 0.0, ROUTER_STD_GAIN * h ** -0.5)]
    for e in range(experts):
        expert = f"{block}.experts.{e}"
        specs += [linear(f"{expert}.{gate}.weight", inter, h), linear(f"{expert}.{up}.weight", inter, h),
                  linear(f"{expert}.{down}.weight", h, inter)]
    return specs


def _is_sparse(cfg: dict[str, Any], arch: str, layer: int) -> bool:
    if arch == "mixtral":
        return True
    if arch != "qwen3_moe":
        return False
    return layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0


def _quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 checkpoint stores this tensor in FP8: the linear layers' weights,
    experts' included; embeddings, norms and the router stay in bfloat16."""
    return len(shape) == 2 and (name.endswith("_proj.weight") or ".experts." in name)


def _normal(gen: torch.Generator, shape: tuple[int, ...], mean: float, std: float) -> torch.Tensor:
    # Draw in float64 and round: torch's float32 normal_ uses SIMD sin/log
    # approximations whose bits differ between CPU capabilities (AVX2 vs
    # default), while the float64 path is plain scalar libm on every machine.
    import torch

    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    return (x * std + mean).to(torch.float32)


def weights(cfg: dict[str, Any], arch: str, seed: int, fp8: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; with `fp8`, linear layers quantized (one at a time:
    an 8B model never exists in float32) and everything else in bfloat16."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, shape, mean, std in _param_specs(cfg, arch):
        w = _normal(gen, shape, mean, std)
        if fp8 is None:
            out[name] = w
        elif _quantized(name, shape):
            out.update(fp8_tensors(name, w, fp8))
        else:
            out[name] = w.to(torch.bfloat16)
    return out
