"""Block copies between the paged KV pool and a tier's storage, off the step.

On a GPU every copy runs on a copy stream of its own: it first waits for the
work already queued on the compute stream (a store reads blocks a launched
step wrote; a load writes blocks a launched step may still write, freed while
it ran), then gathers the blocks into a staging buffer on the device (one
kernel), and moves it over PCIe in runs of consecutive tier slots (one DMA a
run, not one a layer). Its end is an event: `CopyDone.done()` asks it without
waiting, so neither the step nor the host ever waits for a copy. On the CPU
the pool is host memory too and a copy is a plain one a block, done when it
returns (on the engine's thread, between steps).

Copies are batched by the caller (a step's newly full blocks in one store; a
prompt's hits in one load) and split here so a staging buffer stays within
_STAGING_BYTES of device memory (taken from the activations' reserve).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

_STAGING_BYTES = 256 * 2**20


class CopyDone:
    """The end of a copy."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class _EventDone(CopyDone):
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class BlockCopier:
    """Copies whole blocks of one pool (`kv`: [layer][k|v][block][slot][kv_head][head_dim])."""

    def __init__(self, kv: torch.Tensor):
        # As bytes: every element type (FP8 included) copies the same way.
        self.pool = kv.view(torch.uint8)
        self.device = kv.device
        layers, two, _, *rest = self.pool.shape
        self.block_shape = (layers, two, *rest)
        self.block_bytes = self.pool[:, :, 0].numel()
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None
        self._last: CopyDone = CopyDone()
        self._batch = max(1, _STAGING_BYTES // self.block_bytes)

    def to_tier(self, blocks: Sequence[int], storage: torch.Tensor, slots: Sequence[int]) -> CopyDone:
        if self.stream is None:
            # The CPU's index kernels on bytes crawl (1.6 s for 64 blocks where a
            # copy a block takes 35 ms): one copy a block, nothing staged.
            for b, s in zip(blocks, slots):
                storage[s].copy_(self.pool[:, :, b])
            return CopyDone()

        def copy() -> None:
            for a, b in _batches(len(blocks), self._batch):
                staged = self._gather(blocks[a:b])
                for i, j, s in _runs(slots[a:b]):
                    storage[s:s + j - i].copy_(staged[i:j], non_blocking=True)
        return self._run(copy)

    def to_pool(self, storage: torch.Tensor, slots: Sequence[int], blocks: Sequence[int]) -> CopyDone:
        if self.stream is None:
            # Into contiguous (layer, k|v) pieces: a strided destination copies
            # element by element on the CPU (0.03 GB/s).
            pieces = self.pool.flatten(0, 1)
            for b, s in zip(blocks, slots):
                for piece, part in zip(pieces, storage[s].flatten(0, 1)):
                    piece[b].copy_(part)
            return CopyDone()

        def copy() -> None:
            for a, b in _batches(len(blocks), self._batch):
                staged = torch.empty((b - a, *self.block_shape), dtype=torch.uint8, device=self.device)
                for i, j, s in _runs(slots[a:b]):
                    staged[i:j].copy_(storage[s:s + j - i], non_blocking=True)
                self.pool.index_copy_(2, self._ids(blocks[a:b]), staged.movedim(0, 2))
        return self._run(copy)

    def wait_all(self) -> None:
        """Every copy issued so far has ended (a closing tier frees its memory after)."""
        self._last.wait()

    def _gather(self, blocks: Sequence[int]) -> torch.Tensor:
        """[n][layer][k|v][slot][kv_head][head_dim] bytes of `blocks`, contiguous."""
        return self.pool.index_select(2, self._ids(blocks)).movedim(2, 0).contiguous()

    def _ids(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long).to(self.device, non_blocking=True)

    def _run(self, copy) -> CopyDone:
        """`copy` on the copy stream, after the work queued on the compute stream."""
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            copy()
            end = torch.cuda.Event()
            end.record(self.stream)
        self._last = _EventDone(end)
        return self._last


def _batches(n: int, size: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, size):
        yield a, min(n, a + size)


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(i, j, first slot) of each run slots[i:j] of consecutive slots."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j, slots[i]
        i = j
