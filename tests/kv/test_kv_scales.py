"""The FP8 KV cache's pieces on the host: its scales and their identity, the
pool size (from bytes: FP8 holds twice bf16's tokens), the setting."""
from __future__ import annotations

import pytest
import torch

from pdd.config import ConfigError, EngineConfig
from pdd.kv.cache import KVCacheSpec, resolve_kv_cache_dtype
from pdd.kv.layout import KVLayout
from pdd.kv.scales import KVScales


def test_scales_identity_is_unit_or_a_hash_of_the_float32_values():
    assert KVScales.unit(32).identity() == "unit"
    a = KVScales.from_values([1.0, 0.5], [1.0, 1.0])
    assert a.identity().startswith("b2:") and len(a.identity()) == 15
    assert a.identity() == KVScales.from_values([1.0, 0.5], [1.0, 1.0]).identity()
    assert a.identity() != KVScales.from_values([1.0, 1.0], [1.0, 0.5]).identity()   # K and V are not swappable
    # Values that the kernels (float32 arguments) cannot tell apart have one identity.
    assert KVScales.from_values([0.1], [1.0]).identity() == KVScales.from_values([0.1 + 1e-12], [1.0]).identity()
    assert a.layer(1) == (0.5, 1.0)


@pytest.mark.parametrize("k, v, message", [([1.0], [1.0, 1.0], "1 K scales but 2 V scales"),
                                           ([1.0, 0.0], [1.0, 1.0], "layer 1 k_scale must be a finite number > 0"),
                                           ([1.0], [float("nan")], "layer 0 v_scale")])
def test_bad_scales_are_refused_naming_the_layer(k, v, message):
    with pytest.raises(ValueError, match=message):
        KVScales.from_values(k, v)


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bf16_one_in_the_same_bytes():
    cfg = EngineConfig(kv_cache_bytes=64 * 2**20)
    bf16 = KVCacheSpec(32, 8, 128, 16, resolve_kv_cache_dtype("auto", torch.bfloat16))
    fp8 = KVCacheSpec(32, 8, 128, 16, resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16))
    assert fp8.dtype == torch.float8_e4m3fn and bf16.dtype == torch.bfloat16
    assert bf16.bytes_per_token == 128 * 1024 and fp8.bytes_per_token == 64 * 1024   # Llama-3-8B's shape
    cpu = torch.device("cpu")
    assert fp8.num_blocks_for(cfg, cpu) == 2 * bf16.num_blocks_for(cfg, cpu) == 64


def test_the_setting_is_checked_naming_the_key():
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype: must be one of auto, fp8_e4m3, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def test_the_layout_names_the_kv_fields_it_differs_in():
    bf16 = KVLayout("m", "w", "bfloat16", 16, 4, 2, 32)
    assert bf16.kv_cache_dtype == "bfloat16" and bf16.kv_scales == ""
    fp8 = KVLayout("m", "w", "bfloat16", 16, 4, 2, 32, "float8_e4m3fn", "unit")
    assert fp8.mismatch(bf16) == "KV layout mismatch on kv_cache_dtype: 'float8_e4m3fn' vs 'bfloat16'"
    other = KVLayout("m", "w", "bfloat16", 16, 4, 2, 32, "float8_e4m3fn", "b2:0123456789ab")
    assert fp8.mismatch(other) == "KV layout mismatch on kv_scales: 'unit' vs 'b2:0123456789ab'"
    assert KVLayout.from_dict(fp8.to_dict()) == fp8
