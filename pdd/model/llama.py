"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3; Qwen3-MoE and
Mixtral with sparse MLPs, pdd.model.moe) over a paged KV cache.

The forward takes a flat batch: every new token of every sequence in one
[num_tokens] vector, prefill chunks and decodes mixed. Only attention knows
about sequences, through `AttentionMetadata`.

Weights are packed (q/k/v -> qkv_proj, gate/up -> gate_up_proj) so one matmul
does the work of several; `PACKED_MODULES` tells the loader how HF's separate
tensors map onto the packed ones.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdd import ops
from pdd.kv.scales import KVScales
from pdd.model.config import ModelConfig, RopeConfig
from pdd.model.moe import SparseMoeBlock
from pdd.ops.metadata import AttentionMetadata

# HF tensor name fragment -> (packed parameter fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """The precomputed cos/sin table of Neox-style rotary embedding; attention
    applies it (`ops.rotary_store_kv`, fused with the KV-cache write)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        # On the CPU whatever the default device: build_model's is meta, where
        # this arithmetic runs torch's Python meta kernels, whose first use
        # imports torch._dynamo (~1.5 s of CPU in every process that builds a model).
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(rope, head_dim)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5
        # Set by the model runner once the pool exists: [2, blocks, block_size, kv_heads, head_dim],
        # and for an FP8 pool this layer's (k_scale, v_scale) (pdd.kv.scales).
        self.kv_cache: torch.Tensor | None = None
        self.kv_scale: tuple[float, float] = (1.0, 1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = ops.linear(x, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # q/k norms (Qwen3), rotary and the KV-cache write in one op (one kernel launch
        # per layer on the GPU).
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = ops.rotary_store_kv(positions, q, k, v, self.rotary.cos, self.rotary.sin,
                                   self.kv_cache, meta.slot_mapping, self.kv_scale, qk_norm)
        out = ops.paged_attention(q, self.kv_cache, meta, self.scale, self.kv_scale)
        return ops.linear(out.reshape(-1, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At decode sizes on the GPU each is one GEMV launch, SiLU-and-mul fused into the first.
        return ops.linear(ops.linear_silu_mul(x, self.gate_up_proj), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = SparseMoeBlock(cfg) if cfg.moe is not None and cfg.moe.is_sparse(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        """(hidden, residual) in and out: each residual add is fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """`model.*` in HF naming: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        max_positions = cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        # Its tensor given, not drawn: the checkpoint fills it, and normal_ is one
        # of those Python meta kernels (RotaryEmbedding says why that costs).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The checkpoint's static FP8 KV-cache scales, when it has them (set by
        # the loader); an FP8 cache without them uses 1.0 (pdd.kv.scales).
        self.kv_scales: KVScales | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]. `layer_done(i)`
        runs once layer i's KV is written (queued on the stream): the KV connector
        ships those pages while the layers after it compute."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if layer_done is not None:
                layer_done(i)
        return self.model.norm(hidden, residual)[0]

    def gemv_sites(self):
        """(linear layer, whether SiLU-and-mul follows it) of every decoder layer:
        the GEMV variants a decode step launches (ops.warm_up_gemv). A sparse
        layer's router is one; its experts are the fused MoE kernels' (moe_layers)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            yield from ((attn.qkv_proj, False), (attn.o_proj, False))
            if isinstance(mlp, SparseMoeBlock):
                yield mlp.gate, False
            else:
                yield from ((mlp.gate_up_proj, True), (mlp.down_proj, False))

    def moe_layers(self) -> list[SparseMoeBlock]:
        """The sparse MLPs (ops.warm_up_moe compiles their kernels' variants)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_kv_cache(self, kv_cache: torch.Tensor, scales: KVScales | None = None) -> None:
        """kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim], one allocation;
        scales: an FP8 cache's (None: 1.0)."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = kv_cache[i]
            layer.self_attn.kv_scale = scales.layer(i) if scales is not None else (1.0, 1.0)
