"""Build a `CausalLM` and fill it from a HF safetensors checkpoint (or at random).

The model is built on the meta device (no memory, no init cost), then
materialised on the target device and filled tensor by tensor, so an 8B model
never exists twice in host memory.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pdd.model.config import CheckpointError, ModelConfig
from pdd.model.llama import PACKED_MODULES, CausalLM

# Tensors some checkpoints carry that the decoder recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    # Buffers are not in the checkpoint: recompute them on the real device, in float32.
    rotary = model.model.rotary
    fresh = type(rotary)(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
    rotary.cos, rotary.sin = fresh.cos.to(device), fresh.sin.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               load_format: str = "auto") -> CausalLM:
    model = build_model(cfg, device, dtype)
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format in ("auto", "safetensors"):
        load_safetensors(model, Path(model_dir))
    else:
        raise CheckpointError(f"unknown load_format {load_format!r} (use auto, safetensors or dummy)")
    return model


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (pdd loads safetensors checkpoints; "
                              "use --load-format dummy for random weights)")
    return files


def _target(name: str) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, shard index within a packed parameter)."""
    for fragment, (packed, shard) in PACKED_MODULES.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard
    return name, None


def _shard_slice(model: CausalLM, param_name: str, shard: int) -> slice:
    cfg = model.config
    if "qkv_proj" in param_name:
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    # What must be filled: every parameter row range, tracked per (param, shard).
    expected = set()
    for name in params:
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if any(p in name for p in ("qkv_proj", "gate_up_proj")):
            shards = 3 if "qkv_proj" in name else 2
            expected.update((name, s) for s in range(shards))
        else:
            expected.add((name, None))

    loaded = set()
    for path in _checkpoint_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
        with handle as f:
            for hf_name in f.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                name, shard = _target(hf_name)
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if name not in params:
                    raise CheckpointError(f"{path}: unexpected tensor {hf_name!r} for {model.config.architecture}")
                tensor = f.get_tensor(hf_name)
                dst = params[name].data
                if shard is not None:
                    dst = dst[_shard_slice(model, name, shard)]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise CheckpointError(f"{path}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                          f"config.json implies {tuple(dst.shape)}")
                dst.copy_(tensor)
                loaded.add((name, shard))
    missing = expected - loaded
    if missing:
        names = sorted(f"{n}[shard {s}]" if s is not None else n for n, s in missing)
        raise CheckpointError(f"{model_dir}: checkpoint lacks {len(names)} tensor(s), e.g. {names[:5]}")


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of a plausible scale (for benchmarks of real shapes without files)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def weights_fingerprint(model_dir: str | Path, load_format: str = "auto") -> str:
    """A cheap identity of the weights for the KV layout descriptor: hash of the
    config and of each safetensors file's name, size and header (not the data).
    Workers that disagree on it must not exchange KV."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    h.update(load_format.encode())
    if load_format != "dummy":
        for path in _checkpoint_files(model_dir):
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                h.update(path.name.encode())
                h.update(str(path.stat().st_size).encode())
                h.update(f.read(min(header_len, 1 << 24)))
    return h.hexdigest()[:16]

