"""A worker whose KV pages mean something else is refused at registration,
naming the field: an FP8 cache (and its scales) is part of the KV layout.
A real router, real ZeroMQ, real Register messages."""
from __future__ import annotations

import dataclasses

from pdd.kv.layout import KVLayout
from pdd.kv.scales import KVScales
from tests.router.test_connections import with_router

BF16 = KVLayout("m", "w", "bfloat16", 16, 4, 2, 32)
FP8 = dataclasses.replace(BF16, kv_cache_dtype="float8_e4m3fn", kv_scales=KVScales.unit(4).identity())


def register_pair(prefill_layout: KVLayout, decode_layout: dict):
    async def scenario(router, process):
        prefill = await process("prefill-0", role="prefill", layout=prefill_layout.to_dict()).register()
        decode = await process("decode-0", role="decode", layout=decode_layout).register()
        return prefill, decode, sorted(router.registry.workers)
    return with_router(scenario)


def test_a_bf16_kv_decode_worker_is_refused_beside_an_fp8_kv_prefill_worker():
    prefill, decode, workers = register_pair(FP8, BF16.to_dict())
    assert prefill.ok and not decode.ok
    assert "mismatch on kv_cache_dtype: 'float8_e4m3fn' vs 'bfloat16'" in decode.error
    assert workers == ["prefill-0"]


def test_fp8_kv_workers_with_other_scales_are_refused():
    other = KVScales.from_values([1.0, 0.5, 1.0, 1.0], [1.0] * 4)
    prefill, decode, workers = register_pair(FP8, dataclasses.replace(FP8, kv_scales=other.identity()).to_dict())
    assert prefill.ok and not decode.ok
    assert "mismatch on kv_scales: 'unit' vs 'b2:" in decode.error
    assert workers == ["prefill-0"]


def test_a_descriptor_without_kv_fields_is_a_cache_in_the_model_dtype():
    """A worker that does not say its KV dtype stores its model's: refused by an FP8 cluster."""
    old = {k: v for k, v in BF16.to_dict().items() if k not in ("kv_cache_dtype", "kv_scales")}
    assert KVLayout.from_dict(old) == BF16
    prefill, decode, _ = register_pair(FP8, old)
    assert not decode.ok and "kv_cache_dtype" in decode.error
    prefill, decode, workers = register_pair(BF16, old)
    assert prefill.ok and decode.ok and workers == ["decode-0", "prefill-0"]


def test_a_worker_on_a_checkpoint_with_kv_scales_refuses_one_with_unit_scales(tmp_path):
    """The scales' identity in a descriptor is what the engine loaded from the checkpoint."""
    from pdd import LLM
    from pdd.model.make_model import make_model

    scaled = make_model(tmp_path / "scaled", "tiny", "llama", fp8="compressed", kv_scales="random")
    identity = LLM(str(scaled), kv_cache_dtype="fp8_e4m3", num_blocks=16).engine.runner.kv_scales.identity()
    prefill, decode, workers = register_pair(dataclasses.replace(FP8, kv_scales=identity), FP8.to_dict())
    assert prefill.ok and not decode.ok
    assert f"mismatch on kv_scales: '{identity}' vs 'unit'" in decode.error and identity.startswith("b2:")
    assert workers == ["prefill-0"]
