"""One sender per backend a prefill worker offers, picked per request by the
backend the router chose for the pair (TransferTarget.backend).

With "auto" a worker offers cuda_ipc and tcp; if a decode worker's pool
cannot be opened through CUDA IPC from here (no peer path between the GPUs,
say), that request fails over to a local prefill and later requests to that
decode worker go over tcp.
"""
from __future__ import annotations

from pdd.transfer.base import KVSender, TransferResult, TransferTarget


class MultiSender(KVSender):
    def __init__(self, senders: dict[str, KVSender]):
        assert senders, "no sender"
        self.senders = senders
        self._chosen: dict[str, KVSender] = {}   # request id -> its sender

    def _pick(self, target: TransferTarget) -> KVSender:
        s = self._chosen.get(target.request_id)
        if s is None:
            backend = target.backend
            if backend not in self.senders:
                raise ValueError(f"KV transfer backend {backend!r} is not offered by this worker "
                                 f"(it offers {', '.join(self.senders)})")
            ipc = self.senders.get("cuda_ipc")
            if backend == "cuda_ipc" and "tcp" in self.senders and ipc.cannot_reach(target.dst_addr):
                backend = "tcp"
            s = self._chosen[target.request_id] = self.senders[backend]
        return s

    def prepare(self, target: TransferTarget) -> None:
        self._pick(target).prepare(target)

    def send_layer(self, target, layer, src_layer, src_block_ids, block_indices) -> None:
        self._pick(target).send_layer(target, layer, src_layer, src_block_ids, block_indices)

    def step_done(self) -> None:
        for s in self.senders.values():
            s.step_done()

    def finish(self, request_id: str, blocks_skipped: int = 0) -> None:
        # A request never prepared sent nothing: any sender reports that.
        s = self._chosen.pop(request_id, None) or next(iter(self.senders.values()))
        s.finish(request_id, blocks_skipped)

    def abort(self, request_id: str) -> None:
        s = self._chosen.pop(request_id, None)
        if s is not None:
            s.abort(request_id)

    def poll(self) -> list[TransferResult]:
        out = []
        for s in self.senders.values():
            out.extend(s.poll())
        return out

    def set_wakeup(self, fn) -> None:
        for s in self.senders.values():
            s.set_wakeup(fn)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
