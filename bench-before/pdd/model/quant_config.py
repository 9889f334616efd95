"""The `quantization_config` of a checkpoint's config.json: which FP8 scheme its
linear layers use, validated up front.

Two published formats are read:
- `quant_method: "fp8"` (transformers' FineGrainedFP8 / vLLM's Fp8Config, e.g.
  DeepSeek-V3, Qwen3-*-FP8): `weight_block_size` [bn, bk] with per-block scales
  `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], or without it one scale per
  tensor (`weight_scale_inv` or `weight_scale`; per output channel [N] / [N, 1]
  is read too); `activation_scheme` dynamic, or static with an `input_scale`
  (`activation_scale`) per layer. AutoFP8 marks a checkpoint with KV-cache
  scales `kv_cache_scheme: "static"`.
- `quant_method: "compressed-tensors"` (llm-compressor's FP8 checkpoints): one
  config group of `type: float, num_bits: 8` weights with strategy tensor,
  channel or block (`weight_scale`), and FP8 input activations, dynamic per
  token or static per tensor (`input_scale`); and optionally a `kv_cache_scheme`:
  FP8 K and V with one static scale per layer (strategy tensor).

A declared KV-cache scheme makes the checkpoint's KV scales required (the
tensors and their names: pdd.model.kv_scale_tensors).

Anything else is refused with the field and value named: serving a checkpoint
whose numbers mean something we do not compute is silent garbage. torch-free
(the router parses model configs too).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pdd.model.errors import CheckpointError

SCHEMES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str                          # "fp8" or "compressed-tensors"
    weight: str                          # "tensor", "channel" or "block": how weight scales are laid out
    block: tuple[int, int] | None        # (rows, cols) of a weight block, for "block"
    static_input: bool                   # activations quantized with the checkpoint's input_scale
    ignore: tuple[str, ...] = ()         # module names (or "re:" patterns) kept in high precision
    # The config's KV-cache scheme, when it declares one ("" when not): then
    # every layer must carry its K and V scales.
    kv_cache: str = ""

    @property
    def weight_scale_names(self) -> tuple[str, ...]:
        """Suffixes a layer's weight scale may carry, in the order looked for."""
        if self.method == "fp8":
            return ("weight_scale_inv", "weight_scale")
        return ("weight_scale",)

    @property
    def input_scale_names(self) -> tuple[str, ...]:
        return ("input_scale", "activation_scale") if self.method == "fp8" else ("input_scale",)

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (HF name, e.g. model.layers.0.mlp.up_proj) is FP8
        in the checkpoint. The LM head never is, in either library's default."""
        if module == "lm_head" or module.endswith(".lm_head"):
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True


def parse_quantization(raw: dict, source: str) -> Fp8Scheme | None:
    """The FP8 scheme of config.json's `quantization_config`, None when there is none."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc, source)
    if method == "compressed-tensors":
        return _parse_compressed(qc, source)
    raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                          "(pdd serves 'fp8' and 'compressed-tensors' FP8 checkpoints)")


def _field(source: str, path: str, value, supported: str) -> CheckpointError:
    return CheckpointError(f"{source}: quantization_config.{path} {value!r} is not supported ({supported})")


def _names(source: str, path: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field(source, path, value, "expected a list of module names")
    return tuple(value)


def _parse_fp8(qc: dict, source: str) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _field(source, "fmt", fmt, "only e4m3")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in (None, "float"):
        raise _field(source, "scale_fmt", scale_fmt, "only float scales")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _field(source, "activation_scheme", scheme, "dynamic or static")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise _field(source, "weight_block_size", block, "expected [rows, cols] of positive integers")
        if scheme == "static":
            # Per-block weights come with per-token-group activations; a per-tensor
            # static input scale is not a combination any library writes.
            raise _field(source, "activation_scheme", scheme, "block-wise weights need dynamic activations")
    ignore = _names(source, "modules_to_not_convert", qc.get("modules_to_not_convert"))
    ignore += _names(source, "ignored_layers", qc.get("ignored_layers"))
    kv_cache = qc.get("kv_cache_scheme")
    if kv_cache not in (None, "static"):
        raise _field(source, "kv_cache_scheme", kv_cache, "null or 'static' (per-layer K and V scales)")
    return Fp8Scheme(method="fp8", weight="block" if block else "tensor",
                     block=tuple(block) if block else None, static_input=scheme == "static", ignore=ignore,
                     kv_cache="quantization_config.kv_cache_scheme 'static'" if kv_cache else "")


def _parse_compressed(qc: dict, source: str) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _field(source, "format", fmt, "float-quantized or naive-quantized")
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise _field(source, "quantization_status", status, "compressed or frozen")
    if qc.get("sparsity_config"):
        raise _field(source, "sparsity_config", qc["sparsity_config"], "no sparsity")
    kv_cache = _kv_cache_scheme(qc.get("kv_cache_scheme"), source)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _field(source, "config_groups", groups, "exactly one group")
    (name, group), = groups.items()
    path = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _field(source, path, group, "expected an object")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _field(source, f"{path}.targets", targets, "only ['Linear']")
    if group.get("output_activations") is not None:
        raise _field(source, f"{path}.output_activations", group["output_activations"], "only null")

    w = _fp8_args(group.get("weights"), source, f"{path}.weights")
    strategy = w.get("strategy")
    if strategy not in SCHEMES:
        raise _field(source, f"{path}.weights.strategy", strategy, "tensor, channel or block")
    if w.get("dynamic", False) is not False:
        raise _field(source, f"{path}.weights.dynamic", w["dynamic"], "weights have stored scales")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise _field(source, f"{path}.weights.block_structure", bs, "expected [rows, cols]")
        block = tuple(bs)

    a = group.get("input_activations")
    if a is None:
        raise _field(source, f"{path}.input_activations", a,
                     "weight-only FP8 is not served; FP8 activations are required")
    a = _fp8_args(a, source, f"{path}.input_activations", group_size=block[1] if block else None)
    dynamic, a_strategy = a.get("dynamic"), a.get("strategy")
    if dynamic not in (True, False):
        raise _field(source, f"{path}.input_activations.dynamic", dynamic, "true or false")
    # Block weights pair with per-token groups of block[1] columns; tensor and
    # channel weights with per-token (dynamic) or per-tensor (static or dynamic) scales.
    allowed = ("group",) if block else ("token", "tensor") if dynamic else ("tensor",)
    if a_strategy not in allowed:
        raise _field(source, f"{path}.input_activations.strategy", a_strategy,
                     f"with {strategy} weights and dynamic={dynamic}: {', '.join(allowed)}")
    if block and not dynamic:
        raise _field(source, f"{path}.input_activations.dynamic", dynamic, "block weights need dynamic activations")
    return Fp8Scheme(method="compressed-tensors", weight=strategy, block=block, static_input=dynamic is False,
                     ignore=_names(source, "ignore", qc.get("ignore")), kv_cache=kv_cache)


def _kv_cache_scheme(args, source: str) -> str:
    """A compressed-tensors kv_cache_scheme pdd honours (FP8 e4m3 K and V, one
    static symmetric scale per layer, read into an FP8 KV cache's scales), as
    the reason its scales are required; "" when there is none."""
    if args is None:
        return ""
    _fp8_args(args, source, "kv_cache_scheme")
    # compressed-tensors reads a missing strategy without group size as "tensor".
    strategy = args.get("strategy", "tensor")
    if strategy != "tensor":
        raise _field(source, "kv_cache_scheme.strategy", strategy,
                     "only tensor: pdd's FP8 KV cache has one K and one V scale per layer")
    if args.get("dynamic", False) is not False:
        raise _field(source, "kv_cache_scheme.dynamic", args["dynamic"], "only false: static scales")
    return "quantization_config.kv_cache_scheme is set"


def _fp8_args(args, source: str, path: str, group_size: int | None = None) -> dict:
    """A compressed-tensors QuantizationArgs that is symmetric 8-bit float
    (grouped only in groups of `group_size`)."""
    if not isinstance(args, dict):
        raise _field(source, path, args, "expected an object")
    if args.get("type") != "float":
        raise _field(source, f"{path}.type", args.get("type"), "only float (FP8)")
    if args.get("num_bits") != 8:
        raise _field(source, f"{path}.num_bits", args.get("num_bits"), "only 8")
    if args.get("symmetric", True) is not True:
        raise _field(source, f"{path}.symmetric", args.get("symmetric"), "only symmetric")
    if args.get("group_size") not in (None, group_size):
        raise _field(source, f"{path}.group_size", args.get("group_size"),
                     f"only {group_size}" if group_size else "only null")
    if args.get("actorder") is not None:
        raise _field(source, f"{path}.actorder", args.get("actorder"), "only null")
    return args
