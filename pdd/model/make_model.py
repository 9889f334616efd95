"""Tiny random-weight checkpoints in real Hugging Face format, built offline.

The output is byte-identical for the same (preset, arch, seed) on any machine:
the tokenizer is learned by our own deterministic BPE trainer over an
embedded corpus, every JSON file is written by us with a fixed key order, and
weights come from a seeded torch.Generator in a fixed parameter order.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from pdd.model.bpe import tokenizer_json, train_bpe
from pdd.model.make_fp8 import (FP8_FORMATS, KV_SCALE_NAMING, fp8_quantization_config, fp8_tensors,
                                kv_scale_tensors_for)

if TYPE_CHECKING:  # torch is imported only when weights are made: the router never pays for it
    import torch

PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tokenizer_vocab_size=1024,  # including the 3 special tokens
    ),
    "small": dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tokenizer_vocab_size=1024,
    ),
    # Llama-3.1-8B's shapes (its vocabulary size too; the tokenizer is still the
    # small one): for benchmarks of FP8 checkpoints without a download.
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tokenizer_vocab_size=1024,
        config=dict(vocab_size=128256, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ),
}

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    # Real Qwen3 sets head_dim explicitly and != hidden/heads; so do we.
    "head_dim": 48,
    "use_sliding_window": False,
    "sliding_window": None,
}

# Family-specific config.json keys, as real checkpoints of each family write them.
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        # Llama 3.x style scaling, so loaders exercise the llama3 rope path.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,  # 8x extended to the tiny preset's 4096
        },
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "qwen3": _QWEN3,
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    # Qwen3-30B-A3B's keys: top-k of many small experts, renormalized; layer 0
    # is dense (`mlp_only_layers`) so both kinds of layer are in every test.
    "qwen3_moe": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    # Mixtral-8x7B's keys: every layer sparse, top-2 of 8 experts of intermediate_size.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
    },
}

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # appended in this order after the BPE vocab

# ChatML. The '\\n' stays a backslash escape in the template; Jinja turns it into a newline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML for a reasoning model, DeepSeek-R1 style: the generation prompt opens
# <think> (unless chat_template_kwargs.enable_thinking is false), so the output
# starts inside the reasoning and ends it with </think>; a reasoning_effort the
# request gives is said in a system line (a template variable, as gpt-oss's).
THINKING_CHAT_TEMPLATE = (
    "{% if reasoning_effort is defined %}"
    "{{ '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "thinking": THINKING_CHAT_TEMPLATE}
# A reasoning checkpoint's markers are tokens of their own, as Qwen3's and
# DeepSeek-R1's are (added, not special: they decode as their text), after the
# tokenizer's other ids.
THINK_TOKENS = ("<think>", "</think>")

_CORPUS = Path(__file__).with_name("corpus.txt")
_VOCAB_ALIGN = 64  # embedding rows are padded to this, as real checkpoints do


# --------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=4)
def _learn_tokenizer(vocab_size: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """BPE vocab and merges for the embedded corpus (cached: it is arch/seed independent)."""
    # Read bytes and drop CRs so a Windows checkout with autocrlf learns the same merges.
    text = _CORPUS.read_bytes().decode("utf-8").replace("\r\n", "\n")
    vocab, merges = train_bpe(text, vocab_size - len(SPECIAL_TOKENS))
    return tuple(vocab), tuple(merges)


def _special_ids(preset: str) -> dict[str, int]:
    base = PRESETS[preset]["tokenizer_vocab_size"] - len(SPECIAL_TOKENS)
    return {tok: base + i for i, tok in enumerate(SPECIAL_TOKENS)}


def _text_token_ids(preset: str, chat_template: str) -> dict[str, int]:
    """The added tokens that are text (THINK_TOKENS for the thinking template), id -> past the others."""
    if chat_template != "thinking":
        return {}
    base = PRESETS[preset]["tokenizer_vocab_size"]
    return {tok: base + i for i, tok in enumerate(THINK_TOKENS)}


def _tokenizer_json(preset: str, chat_template: str = "chatml") -> dict[str, Any]:
    vocab, merges = _learn_tokenizer(PRESETS[preset]["tokenizer_vocab_size"])
    return tokenizer_json({tok: i for i, tok in enumerate(vocab)}, list(merges), _special_ids(preset),
                          _text_token_ids(preset, chat_template))


def _tokenizer_config(preset: str, chat_template: str = "chatml") -> dict[str, Any]:
    specials = _special_ids(preset)
    decoder = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": tok in specials}
        for tok, i in {**specials, **_text_token_ids(preset, chat_template)}.items()
    }
    return {
        "add_bos_token": False,  # Qwen-style: the BOS string exists but is never prepended
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATES[chat_template],
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": PRESETS[preset]["max_position_embeddings"],
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        # The generic class loads tokenizer.json as written rather than rebuilding
        # it from a family recipe. (transformers 5 still forces Qwen2Tokenizer on
        # model_type qwen2, hence Qwen2's text pipeline in bpe.py.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }


# --------------------------------------------------------------------------- config


def _padded_vocab(preset: str, extra_tokens: int = 0) -> int:
    n = PRESETS[preset]["tokenizer_vocab_size"] + extra_tokens
    return -(-n // _VOCAB_ALIGN) * _VOCAB_ALIGN


def model_config(preset: str = "tiny", arch: str = "llama", chat_template: str = "chatml") -> dict[str, Any]:
    """The config.json contents for (preset, arch); a thinking template's tokens get rows too."""
    _check(preset, arch)
    p, ids = PRESETS[preset], _special_ids(preset)
    cfg: dict[str, Any] = {
        key: p[key]
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")
    }
    cfg.update(
        vocab_size=_padded_vocab(preset, len(_text_token_ids(preset, chat_template))),
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        # Like Qwen: a BOS id is declared, but the tokenizer never prepends it.
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        dtype="float32",
        torch_dtype="float32",  # the pre-5.0 transformers spelling
    )
    cfg.update(_ARCH_CONFIG[arch])
    cfg.update(p.get("config", {}))
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["max_window_layers"] = p["num_hidden_layers"]
    return cfg


def _generation_config(preset: str) -> dict[str, Any]:
    ids = _special_ids(preset)
    return {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT]}


# --------------------------------------------------------------------------- weights


# Bump when the generator's output changes, so cached built-in models are rebuilt.
FORMAT_VERSION = 3

TIED_EMBED_STD = 0.08
TIED_FINAL_NORM_GAIN = 4.0


def _param_specs(cfg: dict[str, Any], arch: str) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, shape, mean, std) for every tensor, in the fixed order they are drawn."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
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
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
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


def _weights(cfg: dict[str, Any], arch: str, seed: int, fp8: str | None = None) -> dict[str, torch.Tensor]:
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


# --------------------------------------------------------------------------- public API


def _check(preset: str, arch: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def _json_bytes(obj: Any, sort_keys: bool = True) -> bytes:
    # Explicit UTF-8 and "\n" so the bytes don't depend on locale or platform.
    return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n").encode("utf-8")


def make_model(out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0,
               fp8: str | None = None, kv_scales: float | str | None = None,
               kv_scale_naming: str | None = None, chat_template: str = "chatml") -> Path:
    """Write a random-weight HF checkpoint for (preset, arch, seed) into out_dir and return it.
    `fp8` (one of FP8_FORMATS): the same weights as an FP8 checkpoint of that format, in
    bfloat16 apart from the quantized linear layers, as published FP8 checkpoints are.
    `kv_scales` (with `fp8`): also per-layer FP8 KV-cache scales, all this value or
    "random" (kv_scale_values), named as `kv_scale_naming` (default: KV_SCALE_NAMING).
    `chat_template`: "chatml", or "thinking" (a reasoning model's: CHAT_TEMPLATES)."""
    from pdd.model.kv_scale_tensors import NAMINGS

    _check(preset, arch)
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {chat_template!r}; choose from {tuple(CHAT_TEMPLATES)}")
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fp8!r}; choose from {FP8_FORMATS}")
    if kv_scales is not None:
        if fp8 is None:
            raise ValueError("KV scales are written into FP8 checkpoints only: give an FP8 format too")
        if kv_scales != "random" and not (isinstance(kv_scales, (int, float)) and 0 < kv_scales < float("inf")):
            raise ValueError(f"KV scales {kv_scales!r}: expected a finite number > 0 or 'random'")
        kv_scale_naming = kv_scale_naming or KV_SCALE_NAMING[fp8]
        if kv_scale_naming not in NAMINGS:
            raise ValueError(f"unknown KV scale naming {kv_scale_naming!r}; choose from {tuple(NAMINGS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(preset, arch, chat_template)
    if fp8 is not None:
        cfg.update(dtype="bfloat16", torch_dtype="bfloat16",
                   quantization_config=fp8_quantization_config(fp8, kv_scales is not None))

    # tokenizer.json keeps its own key order (the vocab must stay in id order).
    tok_json = _json_bytes(_tokenizer_json(preset, chat_template), sort_keys=False)
    Tokenizer.from_str(tok_json.decode("utf-8"))  # fail here, not in a loader, if the format is wrong
    files = {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": _json_bytes(_tokenizer_config(preset, chat_template)),
        "special_tokens_map.json": _json_bytes(_special_tokens_map()),
        "config.json": _json_bytes(cfg),
        "generation_config.json": _json_bytes(_generation_config(preset)),
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    from safetensors.torch import save_file

    tensors = _weights(cfg, arch, seed, fp8)
    if kv_scales is not None:
        tensors.update(kv_scale_tensors_for(cfg, fp8, kv_scales, kv_scale_naming, seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dequantized_copy(fp8_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the FP8 checkpoint in fp8_dir as a plain one in out_dir: each FP8 weight
    dequantized (pdd.model.fp8.dequantize) and rounded to the checkpoint's dtype,
    scales (KV-cache scales too) dropped, every other tensor and file as it is. pdd serving fp8_dir on the
    CPU computes what serving out_dir computes."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pdd.model.config import ModelConfig
    from pdd.model.fp8 import dequantize
    from pdd.model.kv_scale_tensors import is_kv_scale

    src, out = Path(fp8_dir), Path(out_dir)
    scheme = ModelConfig.from_dir(src).quant
    if scheme is None:
        raise ValueError(f"{src}: not an FP8 checkpoint (config.json has no quantization_config)")
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config")
    dtype = getattr(torch, raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, out / path.name)
    (out / "config.json").write_bytes(_json_bytes(raw))
    scale_names = scheme.weight_scale_names + scheme.input_scale_names
    files = sorted(src.glob("*.safetensors"))
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in files}
        where = {name: f for f in handles.values() for name in f.keys()}  # a scale may sit in another file
        for path, f in handles.items():
            tensors = {}
            for name in f.keys():
                if name.endswith(scale_names) or is_kv_scale(name):
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    prefix = name.rsplit(".", 1)[0]
                    scale = next(where[f"{prefix}.{s}"].get_tensor(f"{prefix}.{s}")
                                 for s in scheme.weight_scale_names if f"{prefix}.{s}" in where)
                    t = dequantize(t, scale, scheme.block).to(dtype)
                tensors[name] = t
            save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    return out


def default_model_dir(preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Cache location of a built-in model: $PDD_CACHE_DIR or ~/.cache/pdd, one subdir per model."""
    root = os.environ.get("PDD_CACHE_DIR") or Path.home() / ".cache" / "pdd"
    return Path(root).expanduser() / f"{preset}-{arch}-seed{seed}-v{FORMAT_VERSION}"


def resolve_model_dir(model: str | Path | None) -> Path:
    """A checkpoint directory as configured, or the built-in tiny model when none is."""
    return ensure_builtin_model() if model is None else Path(model)


def ensure_builtin_model(preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Build the model into the cache once and return its directory.

    Built in a sibling temp dir and renamed into place, so a reader never sees
    a half-written model and concurrent builders don't corrupt each other.
    """
    _check(preset, arch)
    final = default_model_dir(preset, arch, seed)
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_model(tmp, preset, arch, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race; its output is byte-identical to ours.
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
