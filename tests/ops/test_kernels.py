"""Triton KV-cache kernels against the torch reference (`pdd.ops.reference`).

Without CUDA the kernels run on CPU tensors through the Triton interpreter, at
small shapes. With CUDA they are compiled and run on the GPU: the same small
cases, plus Llama-3-8B attention shapes in bf16 and a dispatcher check.

The interpreter is chosen when a `@triton.jit` function is decorated (and
triton.language's own jit functions must be interpreted too), so
TRITON_INTERPRET=1 is set before triton is first imported here and while this
module's tests run, and is removed again in between so that it does not leak
into other test modules of the same pytest process.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

CUDA = torch.cuda.is_available()
INTERPRET = not CUDA
_ENV = "TRITON_INTERPRET"


def _import_kernels():
    saved = os.environ.get(_ENV)
    if INTERPRET:
        if "triton" in sys.modules:
            import triton.language.standard as std
            if type(std.sum).__name__ != "InterpretedFunction":
                pytest.skip("triton was imported before TRITON_INTERPRET could be set; "
                            "run tests/ops in a pytest process of its own", allow_module_level=True)
        os.environ[_ENV] = "1"
    try:
        triton = pytest.importorskip("triton")
        if "pdd.ops.triton_ops" in sys.modules:
            mod = importlib.reload(sys.modules["pdd.ops.triton_ops"])
        else:
            mod = importlib.import_module("pdd.ops.triton_ops")
        return triton, mod
    finally:
        if saved is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = saved


triton, tk = _import_kernels()

from pdd.ops import reference  # noqa: E402
from pdd.ops import triton_attention as ta  # noqa: E402  (internals: split counts, tile configs)
from pdd.ops import triton_common as tc  # noqa: E402
from pdd.ops.metadata import AttentionMetadata  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    # Triton reads the variable again at launch time (lazy imports of its own jit code).
    if INTERPRET:
        monkeypatch.setenv(_ENV, "1")
    yield


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------

def make_kv(num_blocks, block_size, kv_heads, head_dim, dtype, seed=0):
    """Random KV layer, never zero (|x| >= 0.1): a page left unwritten shows."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g, device=DEVICE)
    x = torch.where(x.abs() < 0.1, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def make_batch(seqs, *, block_size, kv_heads, heads, head_dim, dtype, seed=0, extra_blocks=3):
    """seqs: [(q_len, seq_len)], decodes (q_len 1) first. Blocks are a random
    permutation of 1..num_blocks-1 (scattered, unordered); rows padded with 0."""
    g = torch.Generator().manual_seed(seed)
    need = [triton.cdiv(s, block_size) for _, s in seqs]
    num_blocks = 1 + sum(need) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(need) + 1  # one padding column at least
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    q_lens = torch.tensor([ql for ql, _ in seqs])
    seq_lens = torch.tensor([s for _, s in seqs])
    assert (q_lens <= seq_lens).all() and (q_lens >= 1).all()
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(q_lens, 0)
    seq_of_tok = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    pos = torch.arange(int(cu[-1])) - cu[:-1][seq_of_tok] + (seq_lens - q_lens)[seq_of_tok]
    slots = table[seq_of_tok, pos // block_size].long() * block_size + pos % block_size
    nd = 0
    while nd < len(seqs) and seqs[nd][0] == 1:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=slots.to(DEVICE), query_start_loc=cu.to(torch.int32).to(DEVICE),
        seq_lens=seq_lens.to(torch.int32).to(DEVICE), block_tables=table.to(DEVICE),
        num_decodes=nd, max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
    kv = make_kv(num_blocks, block_size, kv_heads, head_dim, dtype, seed + 1)
    gd = torch.Generator(DEVICE).manual_seed(seed + 2)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gd, device=DEVICE).to(dtype)
    return q, kv, meta


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def check_attention(q, kv, meta, dtype, scale=None):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = tk.paged_attention(q, kv, meta, scale)
    ref = reference.paged_attention(q, kv, meta, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    # Every token individually too (a wrong row hides in a global norm).
    row_err = ((out.float() - ref.float()).flatten(1).norm(dim=1)
               / ref.float().flatten(1).norm(dim=1)).max().item()
    assert row_err < 4 * tol, f"worst token's relative error {row_err:.2e}"
    return out


DTYPES = [torch.float32, torch.bfloat16]

# (heads, kv_heads): GQA ratios 1, 2, 4
GQA = [(4, 4), (4, 2), (8, 2)]


# ---------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 48])
def test_store_kv(dtype, head_dim):
    seqs = [(1, 5), (1, 33), (20, 20), (9, 40)]
    q, kv, meta = make_batch(seqs, block_size=8, kv_heads=2, heads=4, head_dim=head_dim, dtype=dtype)
    t = q.shape[0]
    g = torch.Generator().manual_seed(7)
    # K from a strided view (as the model's qkv split gives), V contiguous, fp32
    # source into a bf16 cache converts like the reference. Plus 3 padding
    # tokens pointing into the null block 0.
    qkv = torch.randn(t + 3, 3, 2, head_dim, generator=g).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2].contiguous().to(dtype)
    slots = torch.cat([meta.slot_mapping, torch.tensor([0, 1, 2], device=DEVICE)])
    a, b = kv.clone(), kv.clone()
    tk.store_kv(key, value, a, slots)
    reference.store_kv(key, value, b, slots)
    assert torch.equal(a, b)
    assert not torch.equal(a, kv)


def test_store_kv_empty():
    kv = make_kv(4, 16, 2, 32, torch.float32)
    before = kv.clone()
    tk.store_kv(torch.empty(0, 2, 32, device=DEVICE), torch.empty(0, 2, 32, device=DEVICE), kv,
                torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kv, before)


def test_store_kv_rejects_bad_shapes():
    kv = make_kv(4, 16, 2, 32, torch.float32)
    with pytest.raises(AssertionError, match="key must be"):
        tk.store_kv(torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE), kv,
                    torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(AssertionError, match="slot_mapping has"):
        tk.store_kv(torch.randn(3, 2, 32, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE), kv,
                    torch.zeros(2, dtype=torch.int64, device=DEVICE))


# ---------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_only(dtype, heads, kv_heads):
    seqs = [(1, 1), (1, 17), (1, 40), (1, 64), (1, 100)]
    q, kv, meta = make_batch(seqs, block_size=16, kv_heads=kv_heads, heads=heads, head_dim=32, dtype=dtype)
    assert meta.num_decodes == 5
    check_attention(q, kv, meta, dtype)


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_decode_split_counts(monkeypatch, splits):
    """Forced split counts, including more splits than a short sequence has tiles
    (empty splits must weigh nothing in the merge)."""
    monkeypatch.setattr(ta, "_decode_num_splits", lambda *a: splits)
    seqs = [(1, 3), (1, 50), (1, 130)]
    q, kv, meta = make_batch(seqs, block_size=4, kv_heads=2, heads=8, head_dim=32, dtype=torch.float32)
    check_attention(q, kv, meta, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_only(dtype, heads, kv_heads):
    # Fresh prompts, a chunk over a cached prefix (seq_len > q_len), a one-token
    # chunk among the prefills, a chunk ending in the middle of a block.
    seqs = [(7, 7), (33, 33), (20, 50), (1, 30), (16, 16)]
    q, kv, meta = make_batch(seqs, block_size=16, kv_heads=kv_heads, heads=heads, head_dim=32, dtype=dtype)
    meta.num_decodes = 0
    check_attention(q, kv, meta, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("block_size", [4, 32])
def test_mixed_batch(dtype, head_dim, block_size):
    seqs = [(1, 9), (1, 70), (1, 33), (24, 24), (17, 81), (40, 45)]
    q, kv, meta = make_batch(seqs, block_size=block_size, kv_heads=2, heads=4, head_dim=head_dim,
                             dtype=dtype, seed=3)
    assert meta.num_decodes == 3
    check_attention(q, kv, meta, dtype)


def test_chunked_prefill_long_context():
    """A late chunk over a cached prefix of many blocks: most key tiles run
    unmasked, the diagonal ones masked."""
    seqs = [(1, 150), (37, 200), (5, 123)]
    q, kv, meta = make_batch(seqs, block_size=4, kv_heads=2, heads=8, head_dim=48, dtype=torch.float32,
                             seed=5)
    check_attention(q, kv, meta, torch.float32)


@pytest.mark.slow   # deep contexts split many ways: the interpreter's costliest case
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_prefill_split_counts(monkeypatch, splits):
    """Chunks over a deep cached context with their keys split across programs
    (as beside decodes on a GPU): splits with no keys, a chunk whose first row
    sees no key of its diagonal tiles (first + 1 a multiple of the key tile: the
    diagonal must stay with split 0), decodes in the same batch. The interpreter
    runs each program in turn, so the grid is kept small: two query tiles (the
    last one partial), 4 heads on 2 KV heads."""
    monkeypatch.setattr(ta, "_prefill_num_splits", lambda *a: splits)
    cfg = ta._prefill_config(48, torch.float32, False)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    seqs = [(1, 150), (1, 7), (bm + 13, 200), (5, 123), (20, 4 * bn - 1 + 20), (3, 3), (bm + 14, bm + 15)]
    q, kv, meta = make_batch(seqs, block_size=4, kv_heads=2, heads=4, head_dim=48, dtype=torch.float32,
                             seed=splits)
    assert triton.cdiv(meta.max_query_len, bm) == 2
    check_attention(q, kv, meta, torch.float32)


def test_prefill_splits_only_when_the_grid_is_short():
    cpu = torch.device("cpu")   # the interpreter counts 4 "SMs"
    assert ta._prefill_num_splits(5, 100_000, 32, cpu) == 1          # more programs than SMs: not split
    assert ta._prefill_num_splits(4, 100_000, 32, cpu) == 2          # fill the SMs twice
    assert ta._prefill_num_splits(1, 100_000, 32, cpu) == 8
    assert ta._prefill_num_splits(1, 1_000, 32, cpu) == 1            # too few keys to be worth it
    assert ta._prefill_num_splits(1, 10**7, 32, cpu) == 8
    assert ta._prefill_num_splits(3, 100_000, 32, cpu) == 2          # a power of two: 3 wanted, 2 taken
    assert ta._prefill_num_splits(1, 3 * 16 * 32, 32, cpu) == 2      # ... as many as its keys allow, rounded down


def test_strided_query():
    """q as a view of the fused qkv projection (token stride > heads * head_dim)."""
    seqs = [(1, 20), (1, 7), (12, 30)]
    _, kv, meta = make_batch(seqs, block_size=8, kv_heads=2, heads=4, head_dim=32, dtype=torch.float32)
    qkv = torch.randn(14, 4 * 32 + 2 * 2 * 32, device=DEVICE)
    q = qkv[:, :128].view(14, 4, 32)
    assert not q.is_contiguous()
    check_attention(q, kv, meta, torch.float32, scale=0.3)


def test_padding_and_unused_blocks_are_not_read():
    """Block 0 (padding of the block tables) and blocks no sequence owns hold
    huge values: any read of them past seq_len would show in the output."""
    seqs = [(1, 5), (1, 21), (9, 19)]
    q, kv, meta = make_batch(seqs, block_size=8, kv_heads=2, heads=4, head_dim=32, dtype=torch.float32)
    used = set(meta.block_tables.flatten().tolist()) - {0}
    poison = torch.ones(kv.shape[1], dtype=torch.bool)
    poison[list(used)] = False
    kv[:, poison.to(DEVICE)] = 1e4
    # Slots past each seq_len inside the sequences' own last blocks too.
    table = meta.block_tables.cpu()
    for i, s in enumerate(meta.seq_lens.tolist()):
        last, off = table[i, (s - 1) // 8].item(), (s - 1) % 8
        kv[:, last, off + 1:] = 1e4
    check_attention(q, kv, meta, torch.float32)


def test_attention_rejects_bad_inputs():
    seqs = [(1, 5), (3, 9)]
    q, kv, meta = make_batch(seqs, block_size=8, kv_heads=2, heads=4, head_dim=32, dtype=torch.float32)
    with pytest.raises(AssertionError, match="not a multiple"):
        tk.paged_attention(q[:, :3], kv, meta, 1.0)
    bad = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.long()})
    with pytest.raises(AssertionError, match="seq_lens must be int32"):
        tk.paged_attention(q, kv, bad, 1.0)
    with pytest.raises(AssertionError, match="page .* must be contiguous"):
        tk.paged_attention(q, kv.transpose(3, 4), meta, 1.0)


# ---------------------------------------------------------------------------
# page copies
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [(16, 2, 32), (4, 3, 48)])  # 48 * 3 * 4: not a power of two
def test_gather_scatter(dtype, page):
    kv = make_kv(20, *page, dtype)
    ids = torch.tensor([7, 0, 19, 3, 3, 11], device=DEVICE)
    got = tk.gather_blocks(kv, ids)
    assert torch.equal(got, reference.gather_blocks(kv, ids))
    assert got.is_contiguous()

    dst_ids = torch.tensor([2, 15, 4, 9], device=DEVICE, dtype=torch.int32)
    pages = make_kv(4, *page, torch.float32, seed=9)  # fp32 pages into a bf16 pool convert
    a, b = kv.clone(), kv.clone()
    tk.scatter_blocks(a, dst_ids, pages)
    reference.scatter_blocks(b, dst_ids, pages)
    assert torch.equal(a, b)
    # Non-contiguous pages (a strided view) are accepted too.
    a2 = kv.clone()
    strided = pages.to(dtype).transpose(3, 4).contiguous().transpose(3, 4)
    assert not strided.is_contiguous()
    tk.scatter_blocks(a2, dst_ids, strided)
    b2 = kv.clone()
    reference.scatter_blocks(b2, dst_ids, pages.to(dtype))
    assert torch.equal(a2, b2)


def test_gather_empty():
    kv = make_kv(4, 16, 2, 32, torch.float32)
    got = tk.gather_blocks(kv, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert got.shape == (2, 0, 16, 2, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype):
    src = make_kv(30, 16, 2, 32, dtype, seed=1)
    dst = make_kv(12, 16, 2, 32, dtype, seed=2)  # pools of different sizes, same page layout
    src_ids = torch.tensor([29, 4, 17, 0, 8], device=DEVICE)
    dst_ids = torch.tensor([3, 11, 0, 7, 5], device=DEVICE, dtype=torch.int32)
    a, b = dst.clone(), dst.clone()
    tk.copy_blocks(src, a, src_ids, dst_ids)
    reference.copy_blocks(src, b, src_ids, dst_ids)
    assert torch.equal(a, b)
    # Within one pool (disjoint id sets), and with a layer that is a slice of a
    # bigger [layers, 2, ...] allocation, as the engine's pool is.
    pool = torch.stack([make_kv(10, 16, 2, 32, dtype, seed=s) for s in (3, 4)])
    ref = pool.clone()
    tk.copy_blocks(pool[1], pool[1], torch.tensor([1, 2], device=DEVICE), torch.tensor([8, 5], device=DEVICE))
    reference.copy_blocks(ref[1], ref[1], torch.tensor([1, 2], device=DEVICE), torch.tensor([8, 5], device=DEVICE))
    assert torch.equal(pool, ref)


def test_copy_blocks_over_a_run_of_layers():
    """One launch copies the pages of several layers (the cuda_ipc sender's grouping)."""
    from pdd.ops.triton_pages import copy_blocks_unchecked
    src = torch.stack([make_kv(9, 16, 2, 32, torch.float32, seed=s) for s in range(5)])
    dst = torch.stack([make_kv(7, 16, 2, 32, torch.float32, seed=10 + s) for s in range(5)])
    src_ids = torch.tensor([8, 0, 3], device=DEVICE)
    dst_ids = torch.tensor([2, 6, 1], device=DEVICE)
    want = dst.clone()
    for layer in (1, 2, 3):
        reference.copy_blocks(src[layer], want[layer], src_ids, dst_ids)
    copy_blocks_unchecked(src[1:4], dst[1:4], src_ids, dst_ids)
    assert torch.equal(dst, want)
    # The same with a few programs looping over the pages.
    dst2 = torch.stack([make_kv(7, 16, 2, 32, torch.float32, seed=10 + s) for s in range(5)])
    copy_blocks_unchecked(src[1:4], dst2[1:4], src_ids, dst_ids, max_ctas=5)
    assert torch.equal(dst2, want)


# ---------------------------------------------------------------------------
# compiled variants: what a worker's warm-up must cover (a kernel compiled in
# service stalls every request on the worker)
# ---------------------------------------------------------------------------

class _Launches:
    """Records each launch of a kernel (its arguments) and makes it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch

    def variants(self) -> set:
        """The compiled variants these launches need: Triton's specialization
        of each launch's arguments (types, alignment, divisibility, constexprs)."""
        jit_mod = pytest.importorskip("triton.runtime.jit")
        compiler = pytest.importorskip("triton.backends.compiler")
        make_binder = getattr(jit_mod, "create_function_from_signature", None)
        if make_binder is None:
            pytest.skip("this Triton has no create_function_from_signature")
        jit = self.kernel if isinstance(self.kernel, jit_mod.JITFunction) else \
            jit_mod.JITFunction(self.kernel.fn, **self.kernel.kwargs)
        binder = make_binder(jit.signature, jit.params, compiler.BaseBackend)
        return {(str(binder(*a, **kw)[1]), str(sorted(kw.items()))) for a, kw in self.calls}


def make_pool(layers, num_blocks, seed=0, layer_stride=None):
    """A [layers, 2, blocks, 16, 2, 32] pool; `layer_stride` (one layer only):
    that of a pool of over 2**31 elements a layer, without its memory."""
    pool = torch.stack([make_kv(num_blocks, 16, 2, 32, torch.float32, seed=seed + i) for i in range(layers)])
    if layer_stride is not None:
        assert layers == 1
        pool = pool.as_strided(pool.shape, (layer_stride, *pool.stride()[1:]))
    return pool


def test_page_copies_compile_one_variant_per_direction(monkeypatch):
    """A gather, a scatter and a copy between pools each compile once, whatever
    the number of pages and the pools' sizes (a cuda_ipc sender writes into
    peers' pools of any size; the warm-up copies within its own pool)."""
    from pdd.ops import triton_pages as tp
    launches = _Launches(tp._copy_pages_kernel)
    monkeypatch.setattr(tp, "_copy_pages_kernel", launches)
    big = 2**31   # a layer of 2**31 elements: its stride no longer fits an int32
    pools = [make_pool(1, 3), make_pool(1, 40, seed=3), make_pool(1, 3, seed=5, layer_stride=big)]
    variants = {}
    for name, run in (
            ("gather", lambda pool, ids: tk.gather_blocks(pool[0], ids)),
            ("scatter", lambda pool, ids: tk.scatter_blocks(pool[0], ids, make_kv(len(ids), 16, 2, 32,
                                                                                    torch.float32))),
            ("copy", lambda pool, ids: tp.copy_blocks_unchecked(pools[1], pool, ids, ids.flip(0))),
            ("copy", lambda pool, ids: tp.copy_blocks_unchecked(pool, pools[1][:1], ids, ids.flip(0)))):
        launches.calls.clear()
        for pool in pools:
            for n in (1, 2, 3):
                run(pool, torch.arange(n, device=DEVICE))
        variants.setdefault(name, set()).update(launches.variants())
    assert {name: len(v) for name, v in variants.items()} == {"gather": 1, "scatter": 1, "copy": 1}


def test_few_program_page_copies_compile_once(monkeypatch):
    """With max_ctas the copy loops over the pages: their count only bounds the
    loop, and no count compiles a variant of its own."""
    from pdd.ops import triton_pages as tp
    launches = _Launches(tp._copy_pages_few_ctas_kernel)
    monkeypatch.setattr(tp, "_copy_pages_few_ctas_kernel", launches)
    for layers in (1, 3):
        src, dst = make_pool(layers, 20), make_pool(layers, 33, seed=7)
        for n in (1, 2, 16, 17):
            ids = torch.arange(n, device=DEVICE)
            tp.copy_blocks_unchecked(src, dst, ids, ids.flip(0), max_ctas=5)
    assert len(launches.variants()) == 1


@pytest.mark.parametrize("kv_heads,max_seq_len", [(1, 5000), (2, 100_000), (8, 300), (1, 60)])
def test_merge_warm_up_covers_every_split_count_decode_picks(kv_heads, max_seq_len):
    """Every split count the decode can pick, for any batch and context up to
    max_seq_len, merges with a split axis the warm-up compiled (the interpreter
    counts 4 "SMs": fewer splits than an H200 picks, the same rule)."""
    cpu = torch.device("cpu")
    block_n = 16
    picked = {ta._decode_num_splits(nd, kv_heads, seq_len, block_n, cpu)
              for nd in range(1, 9) for seq_len in range(1, max_seq_len + 1, 7)} | \
             {ta._decode_num_splits(1, kv_heads, max_seq_len, block_n, cpu)}
    pads = {ta._pow2(s) for s in picked if s > 1}
    assert set(ta.decode_split_pads(kv_heads, max_seq_len, block_n, cpu)) == pads


def test_merge_warm_up_launches_each_split_axis(monkeypatch):
    launches = _Launches(ta._merge_splits_kernel)
    monkeypatch.setattr(ta, "_merge_splits_kernel", launches)
    dev = torch.device("cuda" if CUDA else "cpu")
    n = ta.warm_up_merges(8, 1, 32, torch.float32, 10_000, dev)
    bn = ta._decode_config(32, torch.float32, CUDA)["BLOCK_N"]
    pads = sorted({*ta.decode_split_pads(1, 10_000, bn, dev), ta.PREFILL_MAX_SPLITS})
    assert n == len(pads)
    # Each with one row and with two: a one-token step launches the merge under PDL.
    assert sorted(kw["S_PAD"] for _, kw in launches.calls) == sorted(pads * 2)
    assert sorted({kw["PDL"] for _, kw in launches.calls}) == ([False, True] if tc.pdl_launch(dev) else [False])
    # one compiled variant each, the decode's and the prefill's (twice under PDL)
    assert len(launches.variants()) == n * (2 if tc.pdl_launch(dev) else 1)


# ---------------------------------------------------------------------------
# CUDA only: realistic shapes (Llama-3-8B attention: 32 q heads, 8 kv heads, 128)
# ---------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
L3 = dict(heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("case", ["b128_ctx4k", "b4_ctx16k", "b1_ctx16k"])
def test_cuda_decode_llama3(case):
    g = torch.Generator().manual_seed(11)
    if case == "b128_ctx4k":
        lens = torch.randint(1, 4097, (128,), generator=g).tolist()
    elif case == "b4_ctx16k":
        lens = [16384, 9000, 123, 16001]
    else:
        lens = [16384]
    q, kv, meta = make_batch([(1, s) for s in lens], **L3)
    check_attention(q, kv, meta, torch.bfloat16)


@cuda_only
def test_cuda_mixed_llama3():
    g = torch.Generator().manual_seed(12)
    decodes = [(1, s) for s in torch.randint(1, 8193, (16,), generator=g).tolist()]
    prefills = [(2048, 8192), (1000, 1000), (513, 3000), (1, 77)]
    q, kv, meta = make_batch(decodes + prefills, **L3)
    assert meta.num_decodes == 16
    check_attention(q, kv, meta, torch.bfloat16)


@cuda_only
def test_cuda_prefill_long_context_llama3():
    q, kv, meta = make_batch([(1024, 16384)], **L3)
    meta.num_decodes = 0
    check_attention(q, kv, meta, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 256])
def test_cuda_other_head_dims(head_dim):
    seqs = [(1, 300), (1, 4000), (700, 700), (100, 2000)]
    q, kv, meta = make_batch(seqs, block_size=16, kv_heads=4, heads=16, head_dim=head_dim,
                             dtype=torch.bfloat16)
    check_attention(q, kv, meta, torch.bfloat16)


@cuda_only
def test_cuda_copies_llama3_pages():
    kv = make_kv(4096, 16, 8, 128, torch.bfloat16)
    g = torch.Generator().manual_seed(13)
    ids = torch.randperm(4096, generator=g)[:2048].to(DEVICE)
    pages = tk.gather_blocks(kv, ids)
    assert torch.equal(pages, reference.gather_blocks(kv, ids))
    dst = torch.zeros_like(kv)
    tk.scatter_blocks(dst, ids, pages)
    ref = torch.zeros_like(kv)
    reference.scatter_blocks(ref, ids, pages)
    assert torch.equal(dst, ref)
    other = torch.zeros_like(kv)
    tk.copy_blocks(kv, other, ids, ids.flip(0))
    assert torch.equal(other[:, ids.flip(0)], kv[:, ids])


@cuda_only
def test_dispatcher_uses_triton_on_cuda(monkeypatch):
    import pdd.ops as ops

    monkeypatch.delenv("PDD_OPS", raising=False)
    monkeypatch.setattr(ops, "_triton_checked", False)
    monkeypatch.setattr(ops, "_triton", None)
    q, kv, meta = make_batch([(1, 40), (5, 20)], block_size=16, kv_heads=2, heads=4, head_dim=32,
                             dtype=torch.bfloat16)
    assert ops.backend_for(q) is sys.modules["pdd.ops.triton_ops"]
    calls = []
    real = tk.paged_attention
    monkeypatch.setattr(tk, "paged_attention", lambda *a: calls.append(1) or real(*a))
    out = ops.paged_attention(q, kv, meta, 0.2)
    assert calls == [1]
    assert rel_err(out, reference.paged_attention(q, kv, meta, 0.2)) < 1e-2
    assert ops.backend_for(q.cpu()) is reference


def test_split_prefill_warm_up_compiles_the_variant_a_deep_chunk_needs(monkeypatch):
    """A short chunk deep in its prompt splits its keys; the warm-up compiles
    that variant directly, whatever its steps reach (max_model_len below the
    step budget leaves no deep tail step there)."""
    launches = _Launches(ta._prefill_kernel)
    monkeypatch.setattr(ta, "_prefill_kernel", launches)
    block_n = ta._prefill_config(32, torch.float32, CUDA)["BLOCK_N"]
    deep = 16 * 47 if INTERPRET else 2 * 16 * block_n + 15     # deep enough to split on this device
    q, kv, meta = make_batch([(17, deep)], block_size=16, kv_heads=1, heads=2, head_dim=32, dtype=torch.float32)
    if CUDA:   # the runner's block tables on a GPU: 16-column multiples (their stride is specialized)
        meta.block_tables = torch.nn.functional.pad(meta.block_tables, (0, -meta.block_tables.shape[1] % 16))
    ta.paged_attention(q, kv, meta, 0.1)
    assert launches.calls[-1][1]["SPLIT"]
    service = launches.variants()
    launches.calls.clear()
    assert ta.warm_up_split_prefill(2, kv, torch.float32, 8192) == 1
    assert [kw["SPLIT"] for _, kw in launches.calls] == [True]
    assert launches.variants() == service
    launches.calls.clear()
    assert ta.warm_up_split_prefill(2, kv, torch.float32, 64) == 0 and not launches.calls   # nothing that short splits
