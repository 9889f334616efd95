"""Triton greedy argmax (pdd.ops.triton_sampling) against torch.argmax: the same
index, ties going to the lowest index and NaN counting as the maximum.
Interpreted on CPU, compiled on CUDA (plus vocabulary-sized rows)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.test_kernels import CUDA, DEVICE, _interpreter_env, tk  # noqa: F401  (the interpreter without a GPU)

from pdd.ops import triton_sampling as ts  # noqa: E402  (internals: the chunk size)


def logits(rows, vocab, seed=0, dtype=torch.float32):
    """Random rows with ties at the maximum (in different chunks too), -inf
    entries, and when there are rows enough one all -inf row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    x[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    top = x.max(dim=-1, keepdim=True).values
    for r in range(0, rows, 2):  # even rows: the maximum also at a few random columns
        cols = torch.randint(0, vocab, (3,), generator=g)
        x[r, cols] = top[r]
    if rows > 2:
        x[2] = float("-inf")
    return x.to(dtype).to(DEVICE)


def check(x, got):
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, want), f"rows differ: {(got != want).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 5003])
def test_argmax(rows, vocab):
    x = logits(rows, vocab, seed=rows * vocab)
    check(x, tk.argmax(x))


@pytest.mark.parametrize("vocab, chunk", [(1000, 64), (5003, 256), (7, 2), (1024, 1024)])
def test_argmax_chunked(vocab, chunk):
    # Small chunks: many per row, a ragged last one, ties across chunks.
    x = logits(5, vocab, seed=vocab)
    check(x, ts._argmax(x, chunk))


@pytest.mark.parametrize("chunk", [64, 4096])
def test_argmax_nan_is_the_maximum(chunk):
    x = logits(4, 3000, seed=1)
    x[0, 2500] = float("nan")      # NaN after the maximum, in another chunk
    x[1, [7, 2000]] = float("nan")  # two NaNs: the first wins
    x[2, 1500] = float("nan")      # NaN in an all -inf row
    x[3, 10] = float("inf")        # +inf without NaN
    assert x.argmax(dim=-1).tolist() == [2500, 7, 1500, 10]  # torch's rule, checked on this device
    check(x, ts._argmax(x, chunk))


def test_argmax_of_strided_and_bf16_rows():
    wide = logits(6, 2000, seed=2)
    check(wide[:, :1500], tk.argmax(wide[:, :1500]))  # row stride > vocab
    check(wide.t().contiguous().t(), tk.argmax(wide.t().contiguous().t()))  # column-major
    x = logits(3, 999, seed=3, dtype=torch.bfloat16)
    check(x, tk.argmax(x))


def test_argmax_no_rows():
    assert tk.argmax(torch.empty(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows, vocab", [(1, 128256), (7, 128256), (256, 128256), (64, 152064)])
def test_cuda_argmax_vocab_sized(rows, vocab):
    check(logits(rows, vocab, seed=rows), tk.argmax(logits(rows, vocab, seed=rows)))
