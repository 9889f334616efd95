"""The model's architecture, read from a Hugging Face `config.json`.

Only what the decoder needs is kept; everything is validated up front so a
malformed checkpoint fails at load with a message naming the field, never
later with a shape error deep inside a forward pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pdd.model.errors import CheckpointError
from pdd.model.quant_config import Fp8Scheme, parse_quantization


# HF `architectures` entry -> our family name. The decoder is the same for all
# of them; the family only selects q/k/v bias and q/k RMSNorm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear" or "llama3"
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    dtype: str = "float32"          # the checkpoint's dtype name (this module avoids importing torch)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    quant: Fp8Scheme | None = None  # FP8 linear layers (quantization_config), None for a plain checkpoint

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        gen = Path(model_dir) / "generation_config.json"
        gen_raw = json.loads(gen.read_text()) if gen.is_file() else {}
        return cls.from_dict(raw, gen_raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object")
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"pdd serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str, kind=int):
            if key not in raw or raw[key] is None:
                raise CheckpointError(f"{source}: missing required field {key!r}")
            try:
                value = kind(raw[key])
            except (TypeError, ValueError):
                raise CheckpointError(f"{source}: field {key!r} must be {kind.__name__}, got {raw[key]!r}") from None
            if kind in (int, float) and value <= 0:
                raise CheckpointError(f"{source}: field {key!r} must be positive, got {raw[key]!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {kv_heads}")
        head_dim = int(raw.get("head_dim") or 0) or hidden // heads
        if raw.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise CheckpointError(f"{source}: unsupported dtype {dtype_name!r}")
        sliding = raw.get("sliding_window")
        if family == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None

        return cls(
            architecture=arch,
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope=_parse_rope(raw, source),
            dtype=dtype_name,
            eos_token_ids=_eos_ids(raw, generation or {}),
            sliding_window=int(sliding) if sliding else None,
            quant=parse_quantization(raw, source),
        )


def _parse_rope(raw: dict, source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise CheckpointError(f"{source}: rope scaling type {kind!r} is not supported "
                              "(supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
