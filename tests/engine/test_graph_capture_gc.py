"""No garbage collection inside a CUDA graph capture (pdd.engine.cuda_graphs):
an unreachable older engine's graphs are destroyed before a capture begins,
never during it, where destroying one invalidates the capture."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pdd.config import EngineConfig
from pdd.engine.cuda_graphs import DecodeGraphs, _no_collection
from pdd.engine.engine import LLMEngine


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_dead_cycle_is_collected_on_entry_and_none_inside():
    died = []
    dead = _Cycle()
    weakref.finalize(dead, died.append, "before")
    del dead
    threshold = gc.get_threshold()
    gc.set_threshold(1)   # left on, a collection would run at nearly every allocation below
    try:
        with _no_collection():
            assert died == ["before"] and not gc.isenabled()
            inside = _Cycle()
            weakref.finalize(inside, died.append, "inside")
            del inside
            garbage = [_Cycle() for _ in range(1000)]
            del garbage
            assert died == ["before"]
        assert gc.isenabled()
        gc.collect()
        assert died == ["before", "inside"]
    finally:
        gc.set_threshold(*threshold)


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with _no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_unreachable_engines_graphs_never_die_inside_a_new_capture(tiny_model, monkeypatch):
    """What made tests/engine/test_warm_up.py fail once on an H200: an earlier
    engine, unreachable but in a reference cycle, collected while the next one
    captured. The fault is forced (a patch, said so): during the capture the
    collector's thresholds ask for a full collection at nearly every
    allocation, which would meet the old engine's graphs if they still lived."""
    cfg = EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", kv_cache_bytes=64 << 20,
                       max_num_seqs=16)
    old = LLMEngine(cfg)
    graphs_gone = []
    weakref.finalize(old.runner.graphs, graphs_gone.append, True)
    old.cycle = old   # only a collection frees it
    del old

    capture = DecodeGraphs._capture

    def capture_with_collections_due(self):
        threshold = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            capture(self)
        finally:
            gc.set_threshold(*threshold)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture_with_collections_due)
    during_capture = []

    def on_collection(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during_capture.append(info["generation"])

    gc.callbacks.append(on_collection)
    try:
        new = LLMEngine(cfg)
    finally:
        gc.callbacks.remove(on_collection)
    assert graphs_gone == [True] and during_capture == [] and new.runner.graphs.graphs
