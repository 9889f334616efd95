"""What a worker does with the router's commands, by role.

Every role can run a request whole (Admit: prefill and decode here): the
router sends one to a prefill worker only when no decode-capable worker is
left, so that no request is lost.

DecodeSide (decode and colocated workers): reserve blocks under a lease, run
the KV receiver, start decoding when the data plane reports the last page
landed (with the first token: no relay through the router), fall back to a
local prefill on PrefillLocally, and expire leases whose KV never came. A
lease closed while a one-sided (cuda_ipc, nixl) writer may still store into its
blocks keeps them held until the writer ends (pdd.transfer.leases).

PrefillSide (prefill workers, and colocated workers with
worker.prefill_for_others beside their DecodeSide): run prompts as
prefill-only requests, ship their KV layer by layer through the connector,
send the first token to the router as soon as it is sampled (FirstToken) and
in the transfer's last message to the decode worker, and report PrefillDone
once the decode worker accepted that message.

Both live on the worker's engine thread and are driven between steps, so
they touch the engine only while no step runs. They are handlers over the
worker's placement records (pdd.worker.records): what they know of a
placement is on its record, its state says where it stands, and each frees
what it holds for one when the table releases it. The engine knows each
request by its placement's engine id; every reply carries the request id and
epoch of that placement. Invariant on the decode side: a lease is revoked
before its blocks are freed or start being used, so a late page can never
land in blocks that belong to another request.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from pdd import faults
from pdd.api import InvalidRequest
from pdd.config import WorkerConfig
from pdd.engine.engine import EngineOutput, LLMEngine
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.security import Curve
from pdd.tracing import placements as spans
from pdd.transfer import MultiSender, make_receiver, make_sender, offered_backends
from pdd.transfer.base import Handoff, Landed, TransferTarget
from pdd.transfer.connector import PrefillConnector
from pdd.transfer.leases import LeaseTable
from pdd.worker.records import PlacementState, PlacementTable, WorkerPlacement

log = logging.getLogger(__name__)

RESERVED, LANDED, RUNNING = PlacementState.RESERVED, PlacementState.LANDED, PlacementState.RUNNING
COMPUTING, SHIPPING, DONE = PlacementState.COMPUTING, PlacementState.SHIPPING, PlacementState.DONE


def admit(engine: LLMEngine, worker_id: str, placements: PlacementTable, msg: m.Admit) -> list[m.Message]:
    """Run a request whole here: prompt (+ tokens streamed elsewhere before) and decode."""
    try:
        with placements.placing(msg.request_id, msg.epoch, RUNNING) as p:
            engine.add_request(p.engine_id, msg.prompt_token_ids, msg.sampling,
                               num_prior_output_tokens=msg.num_prior_output_tokens, block_hashes=msg.block_hashes,
                               prefill_chunk=msg.prefill_chunk)
    except InvalidRequest as e:
        return [m.RequestFailed(worker_id, msg.request_id, msg.epoch, str(e), retriable=False, invalid=True)]
    spans.begin(p, "prefill", msg.traceparent, **{"pdd.prompt_tokens": len(msg.prompt_token_ids)})
    return []


def token_batch(worker_id: str, placements: PlacementTable, outputs: list[EngineOutput]) -> list[m.Message]:
    """A step's tokens (or requests the first token ended): one TokenBatch.
    A finished request's placement ends here."""
    items = []
    for o in outputs:
        p = placements.get(o.request_id)
        spans.tokens(p, len(o.new_token_ids), o.finish_reason)
        if o.finished:
            placements.release(o.request_id)
        items.append(m.TokenItem(p.request_id, p.epoch, o.position, o.new_token_ids, o.finished,
                                 o.finish_reason, o.logprobs or None, o.num_cached_tokens, o.prompt_logprobs))
    return [m.TokenBatch(worker_id, items)] if items else []


def step_messages(worker_id: str, placements: PlacementTable, prefill_side: PrefillSide | None,
                  outputs: list[EngineOutput]) -> list[m.Message]:
    """What a step's outputs tell the router. Prompts computed for other
    workers end in a first token to ship; the requests running here (on a
    prefill worker: whole, the last resort) stream their tokens."""
    failed = []
    for o in outputs:
        if o.error:   # ended in error (its grammar failed): whatever its role here, it fails
            p = placements.release(o.request_id)
            if p is not None:
                failed.append(m.RequestFailed(worker_id, p.request_id, p.epoch, o.error, retriable=False,
                                              invalid=o.invalid))
    outputs = [o for o in outputs if not o.error]
    computed = {o.request_id for o in outputs if placements.state_of(o.request_id) is COMPUTING}
    replies = prefill_side.on_outputs([o for o in outputs if o.request_id in computed]) if computed else []
    return failed + replies + token_batch(worker_id, placements, [o for o in outputs if o.request_id not in computed])


class DecodeSide:
    def __init__(self, engine: LLMEngine, worker_id: str, wc: WorkerConfig, layout: KVLayout,
                 placements: PlacementTable, wakeup: Callable[[], None], security: Curve | None = None,
                 backends: list[str] | None = None, landing_bytes: int = 0):
        """wakeup: called from the receiver's thread when a request's KV landed.
        security: the data socket's (pdd.security.data_security; None: plaintext).
        backends: those the worker offers (pdd.transfer.offered_backends; None: of wc).
        landing_bytes: nixl's landing region, where nixl is offered (worker.nixl_landing_bytes)."""
        self.engine = engine
        self.worker_id = worker_id
        self.placements = placements
        placements.add_holder(self)
        # The data plane's view of the reservations: which blocks a sender may
        # write until when, and blocks a one-sided writer may still store into
        # after their placement ended. A reserved placement holds its lease id.
        self.leases = LeaseTable(on_landed=wakeup)
        # One socket at data_addr takes tcp pages and the one-sided writers'
        # control messages (cuda_ipc; nixl, its pool registered, where offered).
        if backends is None:
            backends = offered_backends(wc.transfer_backend, engine.device)
        self.receiver = make_receiver("nixl" if "nixl" in backends else wc.transfer_backend, engine.runner.kv_cache,
                                      layout, self.leases, wc.data_addr, security=security,
                                      nixl_landing_bytes=landing_bytes)
        self.receiver.start()

    @property
    def data_addr(self) -> str:
        return self.receiver.address

    def handle(self, msg: m.Message) -> list[m.Message]:
        if isinstance(msg, m.Reserve):
            return [self._reserve(msg)]
        if isinstance(msg, m.PrefillLocally):
            return self._prefill_locally(msg)
        raise TypeError(f"DecodeSide does not take {msg.TYPE} messages")

    def _reserve(self, msg: m.Reserve) -> m.Reserved:
        wid = self.worker_id
        try:
            with self.placements.placing(msg.request_id, msg.epoch, RESERVED) as p:
                reserved = self.engine.reserve(p.engine_id, msg.prompt_token_ids, msg.sampling, msg.block_hashes)
        except InvalidRequest as e:
            return m.Reserved(wid, msg.request_id, msg.epoch, ok=False, error=str(e))
        if reserved is None:
            self.placements.release(p.engine_id)
            return m.Reserved(wid, msg.request_id, msg.epoch, ok=False, error="no free KV blocks on this decode worker")
        blocks, num_cached = reserved
        skip = num_cached // self.engine.cfg.block_size
        # Only the blocks the transfer may write are leased; cached prefix blocks
        # may be shared with other requests and must never be written.
        p.lease_id = self.leases.grant(p.engine_id, blocks[skip:], msg.lease_ttl_s)
        spans.begin(p, "kv_wait", msg.traceparent, **{"pdd.blocks": len(blocks), "pdd.cached_tokens": num_cached})
        return m.Reserved(wid, msg.request_id, msg.epoch, ok=True, lease_id=p.lease_id, block_ids=blocks,
                          num_cached_tokens=num_cached)

    def _prefill_locally(self, msg: m.PrefillLocally) -> list[m.Message]:
        """The KV will not come (as the router sees it): the reservation under
        msg.lease_id computes its prompt here. The router may have re-placed it
        under a new epoch: replies carry the message's epoch from now on."""
        p = next((p for p in self.placements.of_request(msg.request_id)
                  if p.lease_id == msg.lease_id and p.state in (RESERVED, LANDED)), None)
        if p is None:
            return [m.RequestFailed(self.worker_id, msg.request_id, msg.epoch,
                                    "no reservation for this request (lease expired?)", retriable=True)]
        if p.state is LANDED:
            # It started on its KV meanwhile (the data plane was faster than the
            # router heard): it runs, nothing to redo.
            return self._run_as(p, msg.epoch, lambda: None)
        # Revoked before the blocks are used (or freed): no page may land after this.
        self._end_lease(p, RUNNING)
        spans.begin(p, "prefill", msg.traceparent, ends="kv_wait", **{"pdd.local_fallback": True})
        return self._run_as(p, msg.epoch, lambda: self.engine.prefill_locally(p.engine_id, msg.first_token))

    def _run_as(self, p: WorkerPlacement, epoch: int, start: Callable[[], EngineOutput | None]) -> list[m.Message]:
        """Hold the placement under `epoch` from now on and `start` it; its
        output if the first token ends it."""
        try:
            self.placements.renew(p, epoch)
            out = start()
        except InvalidRequest as e:
            return self._failed(p, epoch, str(e))
        return token_batch(self.worker_id, self.placements, [out]) if out is not None else []

    def _failed(self, p: WorkerPlacement, epoch: int, error: str) -> list[m.Message]:
        self.placements.release(p.engine_id)
        return [m.RequestFailed(self.worker_id, p.request_id, epoch, error, retriable=False)]

    def _landed(self, landed: Landed) -> list[m.Message]:
        """The data plane says every page of a reservation landed: it starts now,
        and the first token goes to the router from here too (position 0; the
        router keeps one copy). A lease no longer live here is dropped: the
        request was aborted, or its lease expired (the router hears of that)."""
        p = self.placements.get(landed.request_id)
        if p is None or p.state is not RESERVED or p.lease_id != landed.lease_id:
            log.debug("KV landed for %s under lease %s, which is not live here: dropped", landed.request_id,
                      landed.lease_id)
            return []
        self._end_lease(p, LANDED)
        spans.begin(p, "decode", ends="kv_wait")
        h = landed.handoff
        try:
            out = self.engine.kv_ready(p.engine_id, h.first_token)
        except InvalidRequest as e:   # e.g. a first token outside the vocabulary
            return self._failed(p, p.epoch, str(e))
        if out is not None:
            self.placements.release(p.engine_id)
        item = m.TokenItem(p.request_id, p.epoch, 0, [h.first_token], out is not None,
                           out.finish_reason if out is not None else None, h.logprobs, h.num_cached_tokens)
        return [m.TokenBatch(self.worker_id, [item])]

    def _end_lease(self, p: WorkerPlacement, state: PlacementState) -> None:
        """A reservation moves on to `state`: its lease is revoked first."""
        self._close(p.lease_id)
        p.state = state

    def _close(self, lease_id: str) -> None:
        """Revoke a lease; if a one-sided writer may still store into its blocks,
        hold them (beyond their request's life) until the writer ends."""
        lease = self.leases.get(lease_id)
        if self.leases.close(lease_id) == "held" and lease is not None:
            self.engine.kv.hold(sorted(lease.block_ids))

    def release(self, p: WorkerPlacement) -> None:
        """(PlacementTable.release) A reservation's lease is revoked before the
        engine frees its blocks; other states hold nothing here."""
        if p.state is RESERVED and p.lease_id:
            self._close(p.lease_id)

    def poll(self) -> list[m.Message]:
        """Between steps: start the reservations whose KV landed, then expire
        those whose KV did not come in time (in that order: a request that
        landed in time is not expired for having waited for this pass)."""
        replies = []
        for landed in self.leases.landed():
            replies += self._landed(landed)
        return replies + self.expire()

    def expire(self) -> list[m.Message]:
        """Reservations whose KV did not come in time: free them, tell the router.
        Blocks held for writers that have since ended go back to the pool."""
        for lease in self.leases.released():
            self.engine.kv.release(sorted(lease.block_ids))
        replies = []
        for lease_id, eid in self.leases.expired():
            p = self.placements.get(eid)
            if p is None or p.state is not RESERVED or p.lease_id != lease_id:
                self._close(lease_id)   # no reservation holds it any more
                continue
            self.placements.release(eid)
            log.warning("KV lease of %s (epoch %d) expired; its blocks are freed", p.request_id, p.epoch,
                        extra={"request_id": p.request_id})
            replies.append(m.RequestFailed(self.worker_id, p.request_id, p.epoch,
                                           "KV lease expired before the KV arrived", retriable=True))
        return replies

    @property
    def reservations_pending(self) -> bool:
        """Some placement here still waits for its KV."""
        return self.placements.any_in(RESERVED)

    def stats(self) -> dict:
        st, nixl = self.receiver.stats, self.receiver.nixl
        return {"received_messages": st.messages, "received_bytes": st.bytes, "rejected": st.rejected,
                "last_rejection": st.last_error, "leases": len(self.leases), "held_leases": self.leases.num_held,
                "ipc_writers": self.receiver.ipc.num_writers,
                "nixl_writers": nixl.num_writers if nixl is not None else 0,
                # nixl's landing region (bytes; 0: none), requests copied in from it, and its ranges out now.
                "nixl_landing_bytes": nixl.landing.nbytes if nixl is not None and nixl.landing is not None else 0,
                "nixl_landed": nixl.landed_requests if nixl is not None else 0,
                "nixl_landing_ranges": nixl.ranges_held if nixl is not None else 0}

    def warm_up(self) -> None:
        """The kernels that write arriving pages, compiled now (KVReceiver.warm_up)."""
        self.receiver.warm_up()

    def close(self) -> None:
        self.receiver.close()


class PrefillSide:
    def __init__(self, engine: LLMEngine, worker_id: str, wc: WorkerConfig, layout: KVLayout,
                 placements: PlacementTable, wakeup: Callable[[], None], security: Curve | None = None,
                 backends: list[str] | None = None):
        """wakeup: called from the sender's threads when a transfer ends.
        security: for dialing data sockets (pdd.security.data_security; None: plaintext).
        backends: those the worker offers (pdd.transfer.offered_backends; None: of wc)."""
        self.engine = engine
        self.worker_id = worker_id
        self.placements = placements
        placements.add_holder(self)
        device = engine.device
        ipc = {"device": device, "layer_group": wc.ipc_layers_per_copy}
        self.sender = MultiSender({
            b: make_sender(b, layout, security=security, timeout_s=wc.transfer_timeout_s,
                           **(ipc if b == "cuda_ipc" else {}))
            for b in (backends if backends is not None else offered_backends(wc.transfer_backend, device))})
        self.sender.set_wakeup(wakeup)
        self.connector = PrefillConnector(self.sender, engine.runner.kv_cache, engine.cfg.block_size, engine.kv)
        engine.attach_connector(self.connector)

    def handle(self, msg: m.Message) -> list[m.Message]:
        if isinstance(msg, m.KVTarget):
            return self._target(msg)
        if not isinstance(msg, m.Prefill):
            raise TypeError(f"PrefillSide does not take {msg.TYPE} messages")
        try:
            if msg.transfer_backend not in self.sender.senders:
                raise InvalidRequest(f"transfer_backend: {msg.transfer_backend!r} is not offered by this worker "
                                     f"({', '.join(self.sender.senders)})")
            with self.placements.placing(msg.request_id, msg.epoch, COMPUTING) as p:
                self.engine.add_request(p.engine_id, msg.prompt_token_ids, msg.sampling, prefill_only=True,
                                        block_hashes=msg.block_hashes)
        except InvalidRequest as e:
            return [m.PrefillFailed(self.worker_id, msg.request_id, msg.epoch, str(e))]
        p.backend, p.num_prompt_tokens = msg.transfer_backend, len(msg.prompt_token_ids)
        self.connector.expect(p.engine_id)
        spans.begin(p, "prefill", msg.traceparent, **{"pdd.prompt_tokens": p.num_prompt_tokens})
        return []

    def _target(self, msg: m.KVTarget) -> list[m.Message]:
        """Where an expected prompt's KV goes (the decode worker's reservation)."""
        p = self.placements.find(msg.request_id, msg.epoch)
        if p is None or p.state not in (COMPUTING, SHIPPING) or p.target is not None:
            return []   # aborted meanwhile, or failed already: nothing to send
        try:
            self._check_target(msg, p.num_prompt_tokens)
        except InvalidRequest as e:
            self.placements.release(p.engine_id)
            return [m.PrefillFailed(self.worker_id, msg.request_id, msg.epoch, str(e))]
        p.target = TransferTarget(p.engine_id, msg.lease_id, msg.dst_worker, msg.dst_addr, tuple(msg.dst_block_ids),
                                  msg.skip_blocks, backend=p.backend, dst_public_key=msg.dst_public_key)
        self.connector.set_target(p.target)
        spans.begin(p, "kv_send", msg.traceparent, **{"pdd.dst_worker": msg.dst_worker, "pdd.backend": p.backend})
        return []

    def _check_target(self, msg: m.KVTarget, prompt_len: int) -> None:
        """Where the KV goes must hold the whole prompt: a short block list found
        mid-forward would fail every request of the batch."""
        num_blocks = -(-prompt_len // self.engine.cfg.block_size)
        if len(msg.dst_block_ids) < num_blocks:
            raise InvalidRequest(f"dst_block_ids: {len(msg.dst_block_ids)} blocks for a prompt of "
                                 f"{prompt_len} tokens, which needs {num_blocks}")
        if not 0 <= msg.skip_blocks <= num_blocks:
            raise InvalidRequest(f"skip_blocks: must be in [0, {num_blocks}], got {msg.skip_blocks}")

    def on_outputs(self, outputs: list[EngineOutput]) -> list[m.Message]:
        """The step sampled first tokens of computing prompts: those are done,
        their pages all handed over. The tokens go to the router now, ahead of
        the pages, and to the decode worker with the transfer's last message."""
        replies = []
        for o in outputs:
            p = self.placements.get(o.request_id)
            p.state = SHIPPING
            h = p.handoff = Handoff(o.new_token_ids[0], o.logprobs or None, o.num_cached_tokens)
            spans.end(p, "prefill", **{"pdd.cached_tokens": h.num_cached_tokens})
            # An injected failure (pdd.faults) withholds the start, as a lost last message would.
            self.connector.finish(p.engine_id, None if faults.fail_transfer(p.engine_id) else h)
            replies.append(m.FirstToken(self.worker_id, p.request_id, p.epoch, h.first_token, h.logprobs,
                                        h.num_cached_tokens))
        return replies

    def poll(self) -> list[m.Message]:
        """Transfers that ended: PrefillDone (the decode worker accepted the last
        message: it started the request), or PrefillFailed (the router then has
        the decode worker prefill the request itself)."""
        replies = []
        wid = self.worker_id
        for r in faults.transfer_results(self.sender.poll()):   # injected failures/delays, if set
            p = self.placements.get(r.request_id)
            if p is None or p.state not in (COMPUTING, SHIPPING):
                continue   # aborted meanwhile
            spans.end(p, "kv_send", None if r.ok else f"KV transfer failed: {r.error}",
                      **{"pdd.bytes": r.bytes, "pdd.transfer_s": r.seconds, "pdd.blocks_sent": r.blocks_sent,
                         "pdd.blocks_skipped": r.blocks_skipped})
            if p.state is COMPUTING:
                if not r.ok:
                    # Failed while the prompt still computes: stop computing it.
                    self.placements.release(p.engine_id)
                    log.warning("KV transfer of %s failed mid-prefill: %s", p.request_id, r.error,
                                extra={"request_id": p.request_id})
                    replies.append(m.PrefillFailed(wid, p.request_id, p.epoch, f"KV transfer failed: {r.error}"))
                continue
            p.state = DONE
            self.placements.release(p.engine_id)
            if r.ok:
                h = p.handoff
                stats = {"bytes": r.bytes, "seconds": r.seconds, "blocks_sent": r.blocks_sent,
                         "blocks_skipped": r.blocks_skipped, "descriptors": r.descriptors}
                replies.append(m.PrefillDone(wid, p.request_id, p.epoch, h.first_token, h.logprobs,
                                             h.num_cached_tokens, stats))
            else:
                log.warning("KV transfer of %s failed: %s", p.request_id, r.error, extra={"request_id": p.request_id})
                replies.append(m.PrefillFailed(wid, p.request_id, p.epoch, f"KV transfer failed: {r.error}"))
        return replies

    def release(self, p: WorkerPlacement) -> None:
        """(PlacementTable.release) A prompt whose transfer is not over: its
        unsent pages are dropped, blocks held for a target that never came go
        back; other states hold nothing here."""
        if p.state in (COMPUTING, SHIPPING):
            self.connector.abort(p.engine_id)

    @property
    def transfers_pending(self) -> bool:
        return self.placements.any_in(SHIPPING)

    def warm_up(self) -> None:
        """The page kernels of every backend offered, compiled now (KVSender.warm_up)."""
        self.sender.warm_up(self.engine.runner.kv_cache)

    def close(self) -> None:
        self.sender.close()
