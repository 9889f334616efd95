"""Build a `CausalLM` and fill it from a HF safetensors checkpoint (or at random).

The model is built on the meta device (no memory, no init cost), then
materialised on the target device and filled tensor by tensor, so an 8B model
never exists twice in host memory.
"""
from __future__ import annotations

import hashlib
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from pdd.model import fp8
from pdd.model.config import CheckpointError, ModelConfig
from pdd.model.kv_scale_tensors import is_kv_scale, read_kv_scales
from pdd.model.llama import PACKED_MODULES, CausalLM
from pdd.model.moe import EXPERT_PARAMS, Experts, expert_target, hf_expert_name, module_name
from pdd.model.quant_config import Fp8Scheme
from pdd.fp8_format import FP8_DTYPE

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the decoder recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    # The rotary tables are not in the checkpoint: RotaryEmbedding computed them
    # on the CPU in float32 (even under the meta device); kept so on the real device.
    rotary = model.model.rotary
    cos, sin = rotary.cos, rotary.sin
    # Module.to_empty, but by torch.empty: empty_like of a meta tensor is a Python
    # kernel whose first use imports sympy (~0.3 s of CPU in every process).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.to(dtype)
    rotary.cos, rotary.sin = cos.to(device), sin.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               load_format: str = "auto") -> CausalLM:
    if load_format not in ("auto", "safetensors", "dummy"):
        raise CheckpointError(f"unknown load_format {load_format!r} (use auto, safetensors or dummy)")
    model = build_model(cfg, device, dtype)
    if cfg.quant is not None:
        use_fp8_linears(model, cfg.quant, device, dtype)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_safetensors(model, Path(model_dir))
    fp8.finalize(model)
    return model


def use_fp8_linears(model: CausalLM, scheme: Fp8Scheme, device: torch.device, dtype: torch.dtype) -> None:
    """FP8 GEMMs where this engine has them: each linear `scheme` quantizes becomes an
    empty Fp8Linear (filled by Fp8Linear.load_shard); else nothing changes and the
    loader dequantizes (see pdd.model.fp8)."""
    why_not = fp8.fp8_gemm_unavailable(device, dtype, scheme)
    if why_not is not None:
        log.info("FP8 checkpoint (%s, %s weight scales): weights dequantized to %s at load: %s",
                 scheme.method, scheme.weight, model.config.dtype, why_not)
        return
    hf_names, shard_sizes = {}, {}
    # A sparse layer's router stays in the checkpoint's dtype (a [E, H] GEMV; published
    # FP8 MoE checkpoints keep it unquantized, and one that does not is dequantized).
    routers = {f"{name}.gate" for name, _ in model.named_modules() if name.endswith(".mlp")
               and hasattr(model.get_submodule(name), "experts")}
    for name, module in model.named_modules():
        packed = [(frag, shard) for frag, (p, shard) in PACKED_MODULES.items() if name.endswith("." + p)]
        if packed:
            prefix = name.rsplit(".", 1)[0]
            hf_names[name] = [f"{prefix}.{frag}" for frag, _ in sorted(packed, key=lambda x: x[1])]
            shard_sizes[name] = [shard_slice(model, name, s).stop - shard_slice(model, name, s).start
                                 for _, s in sorted(packed, key=lambda x: x[1])]
    n = fp8.swap_linears(model, scheme, hf_names, shard_sizes, device, dtype, skip=routers)
    log.info("FP8 checkpoint (%s, %s weight scales): %d linear layers run FP8 GEMMs",
             scheme.method, scheme.weight, n)
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]
    for name, module in experts:
        why_not = module.fp8_unsupported(scheme.block)
        if why_not is None and scheme.quantizes(f"{name}.0.gate_proj"):
            module.use_fp8()
        elif why_not is not None:
            log.info("%s: experts dequantized at load: %s", name, why_not)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (pdd loads safetensors checkpoints; "
                              "use --load-format dummy for random weights)")
    return files


def _target(name: str) -> tuple[str, int | tuple[int, int | None] | None]:
    """HF tensor name -> (our parameter name, shard index within a packed parameter;
    for an expert's tensor (expert index, shard of its rows))."""
    expert = expert_target(name)
    if expert is not None:
        param, e, shard = expert
        return param, (e, shard)
    name = module_name(name)
    for fragment, (packed, shard) in PACKED_MODULES.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard
    return name, None


def shard_slice(model: CausalLM, param_name: str, shard: int) -> slice:
    """The rows of packed parameter (or module) `param_name` that HF tensor `shard` fills."""
    cfg = model.config
    if "qkv_proj" in param_name:
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    elif ".experts." in param_name:
        sizes = [cfg.moe.intermediate_size, cfg.moe.intermediate_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")


def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    scheme = model.config.quant
    params = dict(model.named_parameters(remove_duplicate=False))
    # What must be filled: every parameter row range, tracked per (param, shard).
    # An Fp8Linear's scales come with its weight, so only the weight is tracked.
    expected = set()
    for name in params:
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith(_SCALE_SUFFIXES):
            continue
        if name.endswith(EXPERT_PARAMS):   # every expert's tensors, shard by shard
            shards = (0, 1) if name.endswith("gate_up_proj") else (None,)
            expected.update((name, (e, s)) for e in range(params[name].shape[0]) for s in shards)
        elif any(p in name for p in ("qkv_proj", "gate_up_proj")):
            shards = 3 if "qkv_proj" in name else 2
            expected.update((name, s) for s in range(shards))
        else:
            expected.add((name, None))

    loaded = set()
    with ExitStack() as stack:
        index = {}  # tensor name -> (file, open handle): a weight's scales may sit in another shard file
        for path in _checkpoint_files(model_dir):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
            f = stack.enter_context(handle)
            index.update((hf_name, (path, f)) for hf_name in f.keys())
        model.kv_scales = read_kv_scales(list(index), lambda n: (index[n][0], index[n][1].get_tensor(n)),
                                         model.config.num_layers, scheme.kv_cache if scheme else "", str(model_dir))
        for hf_name, (path, f) in index.items():
            if hf_name.endswith(_IGNORED_SUFFIXES) or is_kv_scale(hf_name):
                continue
            if scheme is not None and hf_name.endswith(_SCALE_SUFFIXES):
                if hf_name.rsplit(".", 1)[0] + ".weight" not in index:
                    raise CheckpointError(f"{path}: scale {hf_name!r} has no weight")
                continue  # read with its weight
            name, shard = _target(hf_name)
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if name not in params:
                raise CheckpointError(f"{path}: unexpected tensor {hf_name!r} for {model.config.architecture}")
            tensor = f.get_tensor(hf_name)
            dst, rows = _destination(model, params[name].data, name, shard)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise CheckpointError(f"{path}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {tuple(dst.shape)}")
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if tensor.dtype == FP8_DTYPE:
                if scheme is None:
                    raise CheckpointError(f"{path}: tensor {hf_name!r} is float8 but config.json has no "
                                          "quantization_config")
                scale, input_scale = _scales(index, hf_name, tensor, scheme)
                if isinstance(module, fp8.Fp8Linear):
                    module.load_shard(rows, tensor, scale, input_scale)
                    loaded.add((name, shard))
                    continue
                if isinstance(module, Experts) and module.fp8:
                    module.load_fp8(name.rsplit(".", 1)[1], shard[0], rows, tensor, scale)
                    loaded.add((name, shard))
                    continue
                # Rounded to the checkpoint's dtype: what a dequantized copy of it holds.
                tensor = fp8.dequantize(tensor, scale, scheme.block).to(getattr(torch, model.config.dtype))
            elif (isinstance(module, fp8.Fp8Linear) and name.endswith(".weight")) or (
                    isinstance(module, Experts) and module.fp8):
                raise CheckpointError(f"{path}: tensor {hf_name!r} is {tensor.dtype}, but quantization_config "
                                      "makes that layer FP8 (is it missing from the ignore list?)")
            dst.copy_(tensor)
            loaded.add((name, shard))
    missing = expected - loaded
    if missing:
        names = sorted(_missing_name(model, n, s) for n, s in missing)
        raise CheckpointError(f"{model_dir}: checkpoint lacks {len(names)} tensor(s), e.g. {names[:5]}")


def _destination(model: CausalLM, param: torch.Tensor, name: str, shard) -> tuple[torch.Tensor, slice]:
    """The part of parameter `name` that the tensor of `shard` (_target) fills, and its rows."""
    if isinstance(shard, tuple):   # (expert, its gate or up rows, or the whole expert)
        expert, rows = shard
        param = param[expert]
        shard = rows
    rows = shard_slice(model, name, shard) if shard is not None else slice(0, param.shape[0])
    return (param[rows] if shard is not None else param), rows


def _missing_name(model: CausalLM, name: str, shard) -> str:
    if isinstance(shard, tuple):   # the name the checkpoint should have used
        return hf_expert_name(model.config.family, name, *shard)
    return f"{name}[shard {shard}]" if shard is not None else name


def _scales(index: dict, hf_name: str, weight: torch.Tensor, scheme: Fp8Scheme
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight scale (shape checked against the scheme) and static input scale of an FP8 weight."""
    prefix = hf_name.rsplit(".", 1)[0]
    found = next((f"{prefix}.{s}" for s in scheme.weight_scale_names if f"{prefix}.{s}" in index), None)
    if found is None:
        raise CheckpointError(f"FP8 tensor {hf_name!r} has no scale "
                              f"({' or '.join(prefix + '.' + s for s in scheme.weight_scale_names)})")
    path, f = index[found]
    scale = f.get_tensor(found)
    n, k = weight.shape
    if scheme.block:
        bn, bk = scheme.block
        ok = tuple(scale.shape) == (-(-n // bn), -(-k // bk))
        want = f"[{-(-n // bn)}, {-(-k // bk)}] for {bn}x{bk} blocks"
    elif scheme.weight == "channel":
        ok, want = scale.numel() == n and scale.dim() <= 2, f"[{n}, 1] (one per output channel)"
    else:  # the fp8 method's scales are one per tensor, or one per channel
        ok, want = scale.numel() in (1, n) and scale.dim() <= 2, f"one value or [{n}, 1]"
    if not ok or not scale.dtype.is_floating_point:
        raise CheckpointError(f"{path}: scale {found!r} is {scale.dtype} {tuple(scale.shape)}, expected {want}")
    if not scheme.static_input:
        return scale, None
    found_in = next((f"{prefix}.{s}" for s in scheme.input_scale_names if f"{prefix}.{s}" in index), None)
    if found_in is None:
        raise CheckpointError(f"FP8 tensor {hf_name!r}: static activation scheme but no {prefix}.input_scale")
    path, f = index[found_in]
    input_scale = f.get_tensor(found_in)
    if input_scale.numel() != 1:
        raise CheckpointError(f"{path}: {found_in!r} has shape {tuple(input_scale.shape)}, expected one value")
    return scale, input_scale


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of a plausible scale (for benchmarks of real shapes without files)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dtype == FP8_DTYPE:  # FP8 values of a unit scale, times the 0.02 below
            p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, 1.0, generator=gen))
        elif name.endswith(_SCALE_SUFFIXES):
            p.fill_(0.02 if "weight" in name else 1.0)
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

