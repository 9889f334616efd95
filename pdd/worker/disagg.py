"""What a worker does in a disaggregated cluster, by role.

DecodeSide (decode and colocated workers): reserve blocks under a lease, run
the KV receiver, start decoding on KVReady, fall back to a local prefill on
PrefillLocally, and expire leases whose KV never came. A lease closed while a
one-sided (cuda_ipc) writer may still store into its blocks keeps them held
until the writer ends (pdd.transfer.leases).

PrefillSide (prefill workers): run prompts as prefill-only requests, ship
their KV layer by layer through the connector, and report PrefillDone with
the first token once every page is acknowledged.

Both are driven from the worker's engine loop between steps, so they touch
the engine only while no step runs. Invariant on the decode side: a lease is
revoked before its blocks are freed or start being used, so a late page can
never land in blocks that belong to another request.
"""
from __future__ import annotations

import logging

from pdd.engine.sampling_params import InvalidRequest, SamplingParams
from pdd.protocol import messages as m
from pdd.transfer import make_receiver, make_sender, offered_backends
from pdd.transfer.base import TransferTarget
from pdd.transfer.connector import PrefillConnector
from pdd.transfer.leases import LeaseTable
from pdd.transfer.multi import MultiSender

log = logging.getLogger(__name__)


class DecodeSide:
    def __init__(self, worker, layout):
        self.worker = worker
        self.engine = worker.engine
        wc = worker.cfg.worker
        self.leases = LeaseTable()
        # One socket at data_addr takes tcp pages and cuda_ipc control messages;
        # the local backend (tests) has its own addresses.
        local = wc.transfer_backend == "local"
        self.receiver = make_receiver("local" if local else "tcp", self.engine.runner.kv_cache, layout,
                                      self.leases, None if local else wc.data_addr)
        self.receiver.start()
        self.lease_of: dict[str, str] = {}
        self.held: dict[str, list[int]] = {}   # closed leases whose writer may still store

    @property
    def data_addr(self) -> str:
        return self.receiver.address

    def handle(self, msg: m.Message) -> list[m.Message]:
        wid = self.worker.worker_id
        if isinstance(msg, m.Reserve):
            return [self._reserve(msg)]
        if isinstance(msg, m.KVReady):
            if not self._release_lease(msg.request_id, msg.lease_id):
                return [m.RequestFailed(wid, msg.request_id, "no reservation for this request (lease expired?)",
                                        retriable=True)]
            return self._ended(self.engine.kv_ready(msg.request_id, msg.first_token))
        if isinstance(msg, m.PrefillLocally):
            if not self._release_lease(msg.request_id, msg.lease_id):
                return [m.RequestFailed(wid, msg.request_id, "no reservation to prefill locally", retriable=True)]
            return self._ended(self.engine.prefill_locally(msg.request_id, msg.first_token))
        return []

    def _ended(self, out) -> list[m.Message]:
        """The first token already ended the request: say so (no tokens to add)."""
        if out is None:
            return []
        return [m.TokenBatch(self.worker.worker_id, [[out.request_id, [], True, out.finish_reason, None,
                                                     out.num_cached_tokens]])]

    def _reserve(self, msg: m.Reserve) -> m.Reserved:
        wid = self.worker.worker_id
        try:
            reserved = self.engine.reserve(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.sampling))
        except (InvalidRequest, TypeError, ValueError) as e:
            return m.Reserved(wid, msg.request_id, ok=False, error=str(e))
        if reserved is None:
            return m.Reserved(wid, msg.request_id, ok=False, error="no free KV blocks on this decode worker")
        blocks, num_cached = reserved
        skip = num_cached // self.engine.cfg.block_size
        # Only the blocks the transfer may write are leased; cached prefix blocks
        # may be shared with other requests and must never be written.
        lease = self.leases.grant(msg.request_id, blocks[skip:], msg.lease_ttl_s)
        self.lease_of[msg.request_id] = lease
        return m.Reserved(wid, msg.request_id, ok=True, lease_id=lease, block_ids=blocks,
                          num_cached_tokens=num_cached)

    def _release_lease(self, request_id: str, lease_id: str) -> bool:
        """Close the lease (no page may land after this) if it is the request's live one."""
        if self.lease_of.get(request_id) != lease_id or request_id not in self.engine.scheduler.waiting_for_kv:
            return False
        self._close(self.lease_of.pop(request_id))
        return True

    def _close(self, lease_id: str) -> None:
        """Revoke a lease; if a one-sided writer may still store into its blocks,
        hold them (beyond their request's life) until the writer ends."""
        lease = self.leases.get(lease_id)
        if self.leases.close(lease_id) == "held" and lease is not None:
            blocks = sorted(lease.block_ids)
            self.engine.kv.hold(blocks)
            self.held[lease_id] = blocks

    def abort(self, request_id: str) -> None:
        lease = self.lease_of.pop(request_id, None)
        if lease is not None:
            self._close(lease)

    def expire(self) -> list[m.Message]:
        """Reservations whose KV did not come in time: free them, tell the router.
        Blocks held for writers that have since ended go back to the pool."""
        for lease in self.leases.released():
            blocks = self.held.pop(lease, None)
            if blocks:
                self.engine.kv.release(blocks)
        replies = []
        for lease, rid in self.leases.expired():
            self._close(lease)
            if self.lease_of.get(rid) == lease:
                del self.lease_of[rid]
                self.engine.abort_request(rid)
                log.warning("KV lease of %s expired; its blocks are freed", rid)
                replies.append(m.RequestFailed(self.worker.worker_id, rid, "KV lease expired before the KV arrived",
                                               retriable=True))
        return replies

    def stats(self) -> dict:
        st = self.receiver.stats
        ipc = getattr(self.receiver, "ipc", None)  # the local (test) receiver takes no cuda_ipc writers
        return {"received_messages": st.messages, "received_bytes": st.bytes, "rejected": st.rejected,
                "last_rejection": st.last_error, "leases": len(self.leases), "held_leases": len(self.held),
                "ipc_writers": ipc.num_writers if ipc else 0}

    def close(self) -> None:
        self.receiver.close()


class PrefillSide:
    def __init__(self, worker, layout):
        self.worker = worker
        self.engine = worker.engine
        wc = worker.cfg.worker
        device = self.engine.device
        ipc = {"device": device, "layer_group": wc.ipc_layers_per_copy}
        self.sender = MultiSender({
            b: make_sender(b, layout, timeout_s=wc.transfer_timeout_s, **(ipc if b == "cuda_ipc" else {}))
            for b in offered_backends(wc.transfer_backend, device)})
        self.sender.set_wakeup(worker.wake_threadsafe)
        self.connector = PrefillConnector(self.sender, self.engine.runner.kv_cache, self.engine.cfg.block_size)
        self.engine.attach_connector(self.connector)
        # Prompts computed, pages in flight: (first token, logprobs, own cache hits).
        self.first_tokens: dict[str, tuple[int, list | None, int]] = {}

    def handle(self, msg: m.Message) -> list[m.Message]:
        if not isinstance(msg, m.Prefill):
            return []
        wid = self.worker.worker_id
        if msg.transfer_backend not in self.sender.senders:
            return [m.PrefillFailed(wid, msg.request_id, f"KV transfer backend {msg.transfer_backend!r} is not "
                                    f"offered by this worker ({', '.join(self.sender.senders)})")]
        try:
            sampling = SamplingParams(**msg.sampling)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, sampling, prefill_only=True)
        except (InvalidRequest, TypeError, ValueError) as e:
            return [m.PrefillFailed(wid, msg.request_id, str(e))]
        self.connector.add(TransferTarget(msg.request_id, msg.lease_id, msg.dst_worker, msg.dst_addr,
                                          tuple(msg.dst_block_ids), msg.skip_blocks, msg.transfer_backend))
        return []

    def on_outputs(self, outputs) -> list[m.Message]:
        """The step sampled first tokens: those prompts are done, their pages all
        handed over. The tokens go to the router now, ahead of the pages."""
        wid = self.worker.worker_id
        replies = []
        for o in outputs:
            first = self.first_tokens[o.request_id] = (o.new_token_ids[0], o.logprobs or None, o.num_cached_tokens)
            self.connector.finish(o.request_id)
            replies.append(m.FirstToken(wid, o.request_id, *first))
        return replies

    def poll(self) -> list[m.Message]:
        replies = []
        wid = self.worker.worker_id
        for r in self.sender.poll():
            first = self.first_tokens.pop(r.request_id, None)
            if first is None:
                if not r.ok and self.engine.abort_request(r.request_id):
                    # Failed while the prompt still computes: stop computing it,
                    # the decode worker prefills it instead.
                    self.connector.abort(r.request_id)
                    log.warning("KV transfer of %s failed mid-prefill: %s", r.request_id, r.error)
                    replies.append(m.PrefillFailed(wid, r.request_id, f"KV transfer failed: {r.error}"))
                continue  # else: aborted meanwhile
            if r.ok:
                stats = {"bytes": r.bytes, "seconds": r.seconds, "blocks_sent": r.blocks_sent,
                         "blocks_skipped": r.blocks_skipped}
                replies.append(m.PrefillDone(wid, r.request_id, first[0], first[1], first[2], stats))
            else:
                log.warning("KV transfer of %s failed: %s", r.request_id, r.error)
                replies.append(m.PrefillFailed(wid, r.request_id, f"KV transfer failed: {r.error}"))
        return replies

    def abort(self, request_id: str) -> None:
        self.connector.abort(request_id)
        self.first_tokens.pop(request_id, None)

    def close(self) -> None:
        self.sender.close()
