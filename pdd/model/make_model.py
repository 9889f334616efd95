"""Tiny random-weight checkpoints in real Hugging Face format, built offline.

The output is byte-identical for the same (preset, arch, seed) on any machine:
the tokenizer is learned by our own deterministic BPE trainer over an
embedded corpus, every JSON file is written by us with a fixed key order, and
weights come from a seeded torch.Generator in a fixed parameter order.

Its parts: make_presets (the presets and architectures), make_tokenizer (the
tokenizer files), make_weights (the tensors), make_fp8 (what an FP8 checkpoint
stores). This module writes them as one checkpoint, and keeps the built-in model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pdd.model.make_fp8 import FP8_FORMATS, KV_SCALE_NAMING, fp8_quantization_config, kv_scale_tensors_for
from pdd.model.make_presets import ARCH_CONFIG, PRESETS, check_preset
from pdd.model.make_tokenizer import (CHAT_TEMPLATES, ENDOFTEXT, IM_END, special_ids, special_tokens_map,
                                      text_token_ids, tokenizer_config, tokenizer_json_for)
from pdd.model.make_weights import weights

_VOCAB_ALIGN = 64  # embedding rows are padded to this, as real checkpoints do

# Bump when the generator's output changes, so cached built-in models are rebuilt.
FORMAT_VERSION = 3


# --------------------------------------------------------------------------- config


def _padded_vocab(preset: str, extra_tokens: int = 0) -> int:
    n = PRESETS[preset]["tokenizer_vocab_size"] + extra_tokens
    return -(-n // _VOCAB_ALIGN) * _VOCAB_ALIGN


def model_config(preset: str = "tiny", arch: str = "llama", chat_template: str = "chatml") -> dict[str, Any]:
    """The config.json contents for (preset, arch); a thinking template's tokens get rows too."""
    check_preset(preset, arch)
    p, ids = PRESETS[preset], special_ids(preset)
    cfg: dict[str, Any] = {
        key: p[key]
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")
    }
    cfg.update(
        vocab_size=_padded_vocab(preset, len(text_token_ids(preset, chat_template))),
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
    cfg.update(ARCH_CONFIG[arch])
    cfg.update(p.get("config", {}))
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["max_window_layers"] = p["num_hidden_layers"]
    return cfg


def _generation_config(preset: str) -> dict[str, Any]:
    ids = special_ids(preset)
    return {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT]}


# --------------------------------------------------------------------------- public API


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

    check_preset(preset, arch)
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
    tok_json = _json_bytes(tokenizer_json_for(preset, chat_template), sort_keys=False)
    Tokenizer.from_str(tok_json.decode("utf-8"))  # fail here, not in a loader, if the format is wrong
    files = {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": _json_bytes(tokenizer_config(preset, chat_template)),
        "special_tokens_map.json": _json_bytes(special_tokens_map()),
        "config.json": _json_bytes(cfg),
        "generation_config.json": _json_bytes(_generation_config(preset)),
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    from safetensors.torch import save_file

    tensors = weights(cfg, arch, seed, fp8)
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
    check_preset(preset, arch)
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
