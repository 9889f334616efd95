"""The weight-only GEMV (pdd.ops.triton_gemv) against a float32 matmul of the
dequantized weight: interpreted on CPU at small shapes, compiled on CUDA at the
Llama-3-8B decode shapes; and the dispatch that sends decode-sized linears there
(only on CUDA, only for 1..GEMV_MAX_M rows, never on the CPU's path)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from tests.ops.interpreted import import_kernels
from tests.ops.test_kernels import CUDA, DEVICE, INTERPRET, _interpreter_env, triton  # noqa: F401

from pdd import ops  # noqa: E402
from pdd.model.fp8 import dequantize, quantize_weight  # noqa: E402
from pdd.ops import reference  # noqa: E402
from pdd.ops.limits import GEMV_BUCKETS  # noqa: E402

tg = import_kernels("pdd.ops.triton_gemv")

FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)


def rand(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def weights(kind: str, n: int, k: int, seed: int, dtype=torch.float32):
    """(weight, scale, block, float32 dequantized weight) on DEVICE; kind in
    plain (x's dtype), tensor, channel ([N]), channel-2d ([N, 1]), block (128x128)."""
    w = rand(n, k, scale=0.05, seed=seed)
    if kind == "plain":
        w = w.to(dtype)
        return w.to(DEVICE), None, None, w.float()
    block = (128, 128) if kind == "block" else None
    q, s = quantize_weight(w, "block" if block else ("tensor" if kind == "tensor" else "channel"), block)
    if kind == "channel":
        s = s.reshape(-1)
    s = s.float()
    return q.to(DEVICE), s.to(DEVICE), block, dequantize(q, s, block)


def expected(x, w_deq, bias=None, silu=False):
    """The float32 matmul, rounded to x's dtype; silu: as silu_and_mul of that output."""
    y = x.float().cpu() @ w_deq.t()
    if bias is not None:
        y = y + bias.float().cpu()
    y = y.to(x.dtype)
    return reference.silu_and_mul(y) if silu else y


def close(out, ref, dtype):
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    err = ((out.float().cpu() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, f"relative error {err:.2e} (tolerance {tol})"


XDTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kind", ["plain", "tensor", "channel", "channel-2d", "block"])
def test_gemv_matches_the_dequantized_matmul(kind, m, xdtype):
    n, k = 200, 320    # neither a multiple of 128: partial tiles and partial scale blocks
    w, s, block, w_deq = weights(kind, n, k, seed=1, dtype=xdtype)
    if kind == "channel-2d":
        s = s.reshape(-1, 1)
    x = rand(m, k, seed=2).to(xdtype).to(DEVICE)
    out = tg.gemv(x, w, s, block)
    assert out.shape == (m, n) and out.dtype == xdtype
    close(out, expected(x, w_deq), xdtype)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("kind", ["plain", "channel", "block"])
def test_gemv_adds_the_bias(kind, m):
    n, k = 96, 256
    w, s, block, w_deq = weights(kind, n, k, seed=3)
    x = rand(m, k, seed=4).to(DEVICE)
    bias = rand(n, seed=5).to(DEVICE)
    close(tg.gemv(x, w, s, block, bias), expected(x, w_deq, bias), torch.float32)


@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kind", ["plain", "channel", "block"])
def test_fused_silu_and_mul(kind, m, xdtype):
    # 2I = 192 rows: the up half starts inside a 128-row scale block.
    inter, k = 96, 320
    w, s, block, w_deq = weights(kind, 2 * inter, k, seed=6, dtype=xdtype)
    x = rand(m, k, seed=7).to(xdtype).to(DEVICE)
    out = tg.gemv(x, w, s, block, silu=True)
    assert out.shape == (m, inter)
    close(out, expected(x, w_deq, silu=True), xdtype)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("kind", ["plain", "block"])
@pytest.mark.parametrize("m", [1, 5])
def test_the_tile_configs_a_sweep_tries(kind, silu, m):
    # `python -m benchmarks.gemv --sweep` passes its own configs (row kernel at 1 row, dot kernel
    # at 2..16); K not a multiple of BLOCK_K where block scales allow it.
    n, k = 192, 320
    w, s, block, w_deq = weights(kind, n, k, seed=8, dtype=torch.bfloat16)
    x = rand(m, k, seed=9).to(torch.bfloat16).to(DEVICE)
    if m == 1:
        configs = (tg.GemvConfig(1, 4, 128, 8, 1), tg.GemvConfig(1, 16, 64, 4, 3))
    else:
        configs = (tg.GemvConfig(16, 32, 128, 4, 2), tg.GemvConfig(16, 16, 128 if block else 64, 8, 4))
    for cfg in configs:
        out = tg.gemv(x, w, s, block, silu=silu, config=cfg)
        close(out, expected(x, w_deq, silu=silu), torch.bfloat16)


def test_rows_of_one_bucket_share_a_config_and_bad_blocks_are_refused():
    x1 = torch.empty(1, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    plans = {tg._plan(torch.empty(m, 4096, dtype=torch.bfloat16), w, (128, 128), False) for m in range(2, 17)}
    assert len(plans) == 1 and tg._plan(x1, w, (128, 128), False) not in plans
    assert tg.supports(x1, w, (128, 128))
    assert not tg.supports(x1, w, (90, 128))              # no tile size fits a 90-row block
    assert tg.supports(torch.empty(17, 4096, dtype=torch.bfloat16), w)   # the skinny buckets (test_gemv_skinny.py)
    assert not tg.supports(torch.empty(257, 4096, dtype=torch.bfloat16), w)
    with pytest.raises(AssertionError, match="block scales must be"):
        tg.gemv(x1, w, torch.ones(3, 3), (128, 128))


# ---------------------------------------------------------------------------
# Dispatch (CPU: which path each linear takes)
# ---------------------------------------------------------------------------

def test_gemv_is_picked_only_on_cuda_where_it_measured_faster(monkeypatch):
    monkeypatch.delenv("PDD_GEMV", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
    assert ops.use_gemv(cuda, 2, bf16, bf16) and ops.use_gemv(cuda, ops.GEMV_MAX_M, fp16, fp16)
    assert ops.use_gemv(cuda, 1, bf16, bf16) and ops.use_gemv(cuda, 1, fp16, fp16)
    assert ops.use_gemv(cuda, 1, bf16, fp8)                               # one row of FP8 weights: W8A16
    assert not ops.use_gemv(cuda, 4, bf16, fp8)                           # more: the scaled_mm path
    assert not ops.use_gemv(cuda, ops.GEMV_MAX_M + 1, bf16, bf16)         # prefill sizes: cuBLAS
    assert not ops.use_gemv(cuda, 0, bf16, bf16)
    assert not ops.use_gemv(cuda, 2, torch.float32, torch.float32)        # fp32 engines: cuBLAS, as the CPU
    assert not ops.use_gemv(cpu, 2, bf16, bf16)
    monkeypatch.setenv("PDD_GEMV", "off")
    assert not ops.use_gemv(cuda, 2, bf16, bf16) and not ops.use_gemv(cuda, 1, bf16, fp8)


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_cpu_linears_are_exactly_the_layers_own(rows):
    torch.manual_seed(0)
    qkv, gate_up = torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(64, 2 * 48, bias=False)
    x = torch.randn(rows, 64)
    assert torch.equal(ops.linear(x, qkv), F.linear(x, qkv.weight, qkv.bias))
    assert torch.equal(ops.linear_silu_mul(x, gate_up), reference.silu_and_mul(F.linear(x, gate_up.weight)))
    assert ops.warm_up_gemv([(qkv, False), (gate_up, True)], torch.float32, torch.device("cpu")) == 0


# ---------------------------------------------------------------------------
# CUDA: the Llama-3-8B decode shapes
# ---------------------------------------------------------------------------

SHAPES_8B = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]
# bf16 output: one rounding (2^-8 relative) on top of fp32 accumulation in another order.
GPU_TOL = 1e-2


@functools.lru_cache(maxsize=1)   # the M cases of one weight run one after another
def weights_8b(kind: str, n: int, k: int):
    w = rand(n, k, scale=0.02, seed=n + k)
    if kind == "plain":
        w = w.to(torch.bfloat16).to(DEVICE)
        return w, None, None, w.float()
    block = (128, 128) if kind == "block" else None
    w, s = quantize_weight(w, kind, block)
    w, s = w.to(DEVICE), (s.float() if block else s.float().reshape(-1)).to(DEVICE)
    return w, s, block, dequantize(w, s, block)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 16, 17, 64, 100, 256])     # every bucket; 100 and 256: masked rows, two M tiles
@pytest.mark.parametrize("n, k, silu", SHAPES_8B)
@pytest.mark.parametrize("kind", ["plain", "channel", "block"])
def test_cuda_8b_shapes(kind, n, k, silu, m):
    if kind != "plain" and not FP8_GPU:
        pytest.skip("FP8 weights want compute capability >= 8.9")
    w, s, block, w_deq = weights_8b(kind, n, k)
    x = rand(m, k, seed=m).to(torch.bfloat16).to(DEVICE)
    out = tg.gemv(x, w, s, block, silu=silu)
    ref = x.float() @ w_deq.t()
    if silu:
        ref = reference.silu_and_mul(ref.to(torch.bfloat16)).float()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < GPU_TOL, f"relative error {err:.2e}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_nothing_compiles_after_warm_up_gemv():
    if not ops.report_compiles(lambda kernel: None):
        pytest.skip("this Triton has no compile hook")
    dev = torch.device("cuda")
    sites = []
    for n, k, silu in SHAPES_8B:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        sites.append((lin, silu))
    assert ops.warm_up_gemv(sites, torch.bfloat16, dev) > 0
    torch.cuda.synchronize()
    before = ops.compiles_reported()
    for lin, silu in sites:
        for m in range(1, ops.GEMV_MAX_M + 1):
            x = torch.randn(m, lin.in_features, device=dev, dtype=torch.bfloat16)
            (ops.linear_silu_mul if silu else ops.linear)(x, lin)
    torch.cuda.synchronize()
    assert ops.compiles_reported() == before


def _gemv_kernels_run(llm, prompts) -> int:
    from torch.profiler import ProfilerActivity, profile

    from tests.engine.helpers import greedy
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, greedy(4, ignore_eos=True))
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "_gemv_" in e.key)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_engine_steps_take_the_gemv_unless_turned_off(model_factory, monkeypatch):
    """Short prompts prefill eagerly at decode sizes: each linear is a GEMV
    launch; with PDD_GEMV=off (read when the engine's graphs are captured, so
    set before the engine starts) none is."""
    from pdd import LLM
    from tests.engine.helpers import random_prompts

    prompts = random_prompts([5, 9], seed=1)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_bytes=256 << 20)
    on = LLM(str(model_factory("llama")), **kw)
    assert _gemv_kernels_run(on, prompts) >= 4 * on.engine.model_config.num_layers
    del on
    monkeypatch.setenv("PDD_GEMV", "off")
    off = LLM(str(model_factory("llama")), **kw)
    assert _gemv_kernels_run(off, prompts) == 0


# Every variant the 8B shape's warm-up compiles, built for sm_90 in a process of
# its own (the kernels here are interpreted): Triton's own compiler and ptxas,
# no GPU needed. Prints each variant's stack bytes (register spills). A second
# argument, K slices: the dot buckets' tiles split over K instead, and the
# split's reduce kernel.
_SM90_BUILD = """
import glob, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pdd.ops import triton_gemv as tg
from pdd.ops.limits import GEMV_BUCKETS

POINTERS = ("x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr")
ALIGNED = set(POINTERS) | {"N", "K", "stride_wn", "stride_ym", "stride_xm"}   # as the 8B shapes specialize
cuobjdump = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))[0]
split = int(sys.argv[2]) if len(sys.argv) > 2 else 1
out = []


def build(fn, const, types, aligned, num_warps, num_stages, pdl=False):
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in sig}
    built = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(built.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return built, int(re.search(r"STACK:(\\d+)", usage).group(1))


for n, k, silu in json.loads(sys.argv[1]):
    for wty, scale, block in (("bf16", tg.NO_SCALE, None), ("fp8e4nv", tg.ROW_SCALE, None),
                              ("fp8e4nv", tg.BLOCK_SCALE, (128, 128))):
        for bucket in ((1, tg.GEMV_MAX_M) if wty == "bf16" else GEMV_BUCKETS):
            if split > 1 and bucket == 1:
                continue
            cfg = tg.gemv_config(bucket, n // 2 if silu else n, k, 2 if wty == "bf16" else 1, 2, silu, block, 132)
            cfg = cfg._replace(split_k=split) if bucket != 1 else cfg
            fn = tg._gemv_row_kernel if bucket == 1 else tg._gemv_dot_kernel
            const = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE=scale, SCALE_BN=block[0] if block else 1,
                         SCALE_BK=block[1] if block else 1, HAS_BIAS=False, SILU=silu, EVEN_K=k % cfg.block_k == 0)
            if bucket != 1:
                const.update(BLOCK_M=cfg.block_m, UPCAST=False, W8A8=False, SPLIT_K=cfg.split_k)
                if cfg.split_k == 1:
                    const.update(p_ptr=None)
            else:
                const.update(PDL=True)
            types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": f"*{wty}", "b_ptr": f"*{wty}",
                     "s_ptr": "*fp32" if scale else f"*{wty}", "p_ptr": "*fp32"}
            built, stack = build(fn, const, types, ALIGNED | {"p_ptr", "k_span"}, cfg.num_warps, cfg.num_stages,
                                 bucket == 1)
            out.append(dict(n=n, k=k, silu=silu, w=wty, scale=scale, bucket=bucket, stack=stack, cfg=list(cfg),
                            smem=built.metadata.shared,
                            pipelined="cp.async" in built.asm["ptx"],
                            waits="griddepcontrol.wait" in built.asm["ptx"]))
            if cfg.split_k > 1 and bucket in (tg.GEMV_MAX_M, GEMV_BUCKETS[-1]):
                rconst = dict(BLOCK_M=min(cfg.block_m, 64), BLOCK_N=tg._REDUCE_BLOCK_N, SPLIT_K=cfg.split_k,
                              SCALE=scale, HAS_BIAS=False, SILU=silu)
                built, stack = build(tg._gemv_reduce_kernel, rconst, types,
                                     {"p_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "stride_ym"}, 4, 1)
                out.append(dict(n=n, k=k, silu=silu, w=wty, scale=scale, bucket=bucket, stack=stack,
                                cfg=["reduce", cfg.split_k], smem=built.metadata.shared, pipelined=None, waits=False))
print("BUILT " + json.dumps(out))
"""


def test_the_8b_variants_build_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot show: each GEMV variant of the 8B shapes (FP8
    weights in every row bucket, bf16 in the two it takes) is
    accepted by Triton's GPU compiler (layouts, the tl.dot of FP8 tiles
    converted in registers, the cp.async pipeline of the dot kernel, the one-row
    kernel's wait for the previous kernel under PDL) and its tiles fit in registers. Built for sm_90 with the ptxas Triton ships; skipped
    where that is missing."""
    import glob
    import json
    import subprocess
    import sys

    import triton as real_triton
    if not glob.glob(os.path.join(os.path.dirname(real_triton.__file__), "backends/nvidia/bin/cuobjdump")):
        pytest.skip("this Triton ships no NVIDIA tools (ptxas, cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", _SM90_BUILD, json.dumps(SHAPES_8B)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("BUILT "))[len("BUILT "):])
    assert len(built) == len(SHAPES_8B) * (2 + 2 * len(GEMV_BUCKETS))
    assert [b for b in built if b["stack"]] == []
    assert [b for b in built if b["smem"] > 227 << 10] == []     # an H200 block's shared memory
    assert all(b["pipelined"] for b in built if b["bucket"] != 1)   # the dot kernel's W tiles stream via cp.async
    # The one-row kernel, launched with PDL, waits for its predecessor's results.
    assert all(b["waits"] == (b["bucket"] == 1) for b in built)


def test_the_split_k_variants_build_for_sm90_without_spills(tmp_path):
    """The dot buckets' tiles of the 8B shapes split over K (4 slices), and the
    reduce kernel: built for sm_90 as above, no register spills, W still
    streamed through cp.async."""
    import glob
    import json
    import subprocess
    import sys

    import triton as real_triton
    if not glob.glob(os.path.join(os.path.dirname(real_triton.__file__), "backends/nvidia/bin/cuobjdump")):
        pytest.skip("this Triton ships no NVIDIA tools (ptxas, cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    shapes = [SHAPES_8B[1], SHAPES_8B[2]]     # o_proj, gate_up_proj (silu)
    proc = subprocess.run([sys.executable, "-c", _SM90_BUILD, json.dumps(shapes), "4"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("BUILT "))[len("BUILT "):])
    dots = [b for b in built if b["cfg"][0] != "reduce"]
    assert len(dots) == len(shapes) * (1 + 2 * (len(GEMV_BUCKETS) - 1))
    assert len(built) - len(dots) == len(shapes) * (1 + 2 + 2)     # reduces: bf16 at 16 rows, FP8 at 16 and 256
    assert [b for b in built if b["stack"]] == []
    assert [b for b in built if b["smem"] > 227 << 10] == []
    assert all(b["pipelined"] for b in dots)
