"""The disaggregated request lifecycle, router side (DESIGN.md, "Request lifecycle").

    decode  <- Reserve        blocks held under a lease, its own prefix hits counted
    decode  -> Reserved
    prefill <- Prefill        computes, writes KV layer by layer into the reserved blocks
    prefill -> FirstToken     streamed to the client at once (TTFT), pages still in flight
    prefill -> PrefillDone    every page has landed
    decode  <- KVReady        decode continues after the first token, streaming tokens

Every failure falls back to something that still answers the client: no
decode room -> colocated admission; transfer failed or prefill worker lost ->
the decode worker prefills in the blocks it already holds; decode worker lost
-> re-admission elsewhere (router.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

from pdd.kv.hashing import block_hashes
from pdd.protocol import messages as m
from pdd.router.policy import pick_worker
from pdd.router.requests import RequestState, TokenEvent

log = logging.getLogger(__name__)

PREFILL_ROLES = ("prefill",)
DECODE_ROLES = ("decode", "colocated")


def transfer_backend(prefill, decode) -> str | None:
    """The data plane for a prefill -> decode pair: the prefill worker's first
    choice the decode worker also takes; cuda_ipc only within one host."""
    for b in prefill.transfer_backends or ["tcp"]:
        if b in (decode.transfer_backends or ["tcp"]) and (
                b != "cuda_ipc" or (prefill.host_id and prefill.host_id == decode.host_id)):
            return b
    return None


class DisaggFlow:
    def __init__(self, router):
        self.router = router
        self.reservations: dict[str, asyncio.Future] = {}

    # ------------------------------------------------------------------ routing

    def decode_candidates(self):
        return [w for w in self.router.registry.candidates(DECODE_ROLES) if w.data_addr]

    def available(self) -> bool:
        return bool(self.router.registry.candidates(PREFILL_ROLES) and self.decode_candidates())

    async def start(self, state: RequestState) -> None:
        """Run the reservation and hand the prompt to a prefill worker (a task per request)."""
        r = self.router
        decode = pick_worker(self.decode_candidates(), state.block_hashes)
        prefill = pick_worker(r.registry.candidates(PREFILL_ROLES), state.block_hashes)
        if decode is None or prefill is None:
            await self._fallback(state, "no prefill or decode worker")
            return
        backend = state.transfer_backend = transfer_backend(prefill, decode) or ""
        if not backend:
            await self._fallback(state, f"no KV transfer backend common to {prefill.worker_id} "
                                        f"{prefill.transfer_backends} and {decode.worker_id} {decode.transfer_backends}")
            return
        state.mode, state.phase = "disagg", "reserving"
        state.worker_id, state.prefill_worker = decode.worker_id, prefill.worker_id
        decode.inflight += 1
        fut = asyncio.get_running_loop().create_future()
        self.reservations[state.request_id] = fut
        state.phase_since = time.monotonic()
        await r.chan.send(decode.worker_id, m.Reserve(state.request_id, state.prompt_token_ids,
                                                      vars(state.sampling), r.cfg.router.kv_lease_ttl_s))
        try:
            reply: m.Reserved = await asyncio.wait_for(fut, r.cfg.router.reserve_timeout_s)
        except asyncio.TimeoutError:
            reply = m.Reserved(decode.worker_id, state.request_id, ok=False, error="no answer to Reserve")
        finally:
            self.reservations.pop(state.request_id, None)
        if state.request_id not in r.requests:   # aborted while we waited
            if reply.ok:
                await r.chan.send(decode.worker_id, m.Abort([state.request_id]))
            return
        if not reply.ok:
            decode.inflight = max(0, decode.inflight - 1)
            state.worker_id = state.prefill_worker = None
            await self._fallback(state, reply.error)
            return
        now = time.monotonic()
        r.metrics.disagg_phase.labels("reserve").observe(now - state.phase_since)
        state.phase, state.lease_id, state.phase_since = "prefilling", reply.lease_id, now
        skip = reply.num_cached_tokens // r.registry.layout.block_size
        prefill.inflight += 1
        await r.chan.send(prefill.worker_id, m.Prefill(
            state.request_id, state.prompt_token_ids, vars(state.sampling), decode.worker_id, decode.data_addr,
            reply.block_ids, skip, reply.lease_id, backend))

    async def _fallback(self, state: RequestState, why: str) -> None:
        log.info("request %s goes colocated: %s", state.request_id, why)
        self.router.metrics.fallbacks.labels("no_decode_room" if "KV blocks" in why else "unavailable").inc()
        state.mode, state.phase = "colocated", "decoding"
        if not await self.router.admit_colocated(state):
            state.fail(f"no worker can take the request ({why})")
            self.router.retire(state)

    # ------------------------------------------------------------------ messages

    def on_reserved(self, peer: str, msg: m.Reserved) -> bool:
        """False if nobody waits for this reservation (the caller releases it)."""
        fut = self.reservations.get(msg.request_id)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    async def on_first_token(self, peer: str, msg: m.FirstToken) -> None:
        state = self.router.requests.get(msg.request_id)
        if state is None or state.prefill_worker != peer or state.phase != "prefilling" or state.output_token_ids:
            return
        self.router.metrics.disagg_phase.labels("first_token").observe(time.monotonic() - state.phase_since)
        self.router.deliver(state, TokenEvent([msg.token], False, None, msg.logprobs or None, msg.num_cached_tokens))

    async def on_prefill_done(self, peer: str, msg: m.PrefillDone) -> None:
        r = self.router
        state = r.requests.get(msg.request_id)
        if state is None or state.prefill_worker != peer or state.phase != "prefilling":
            return
        self._prefill_over(state)
        state.phase = "decoding"
        r.metrics.disagg_phase.labels("prefill").observe(time.monotonic() - state.phase_since)
        r.metrics.observe_transfer(msg.transfer)
        worker = r.registry.workers.get(peer)
        if worker is not None:
            worker.note_hashes(state.block_hashes)
        if not state.output_token_ids:  # no FirstToken came ahead of it
            r.deliver(state, TokenEvent([msg.first_token], False, None, msg.logprobs or None,
                                        msg.num_cached_tokens))
        if state.finished:  # the first token ended it (a stop string): the decode worker lets go
            return
        await r.chan.send(state.worker_id, m.KVReady(state.request_id, state.lease_id, state.output_token_ids[0]))

    async def on_prefill_failed(self, peer: str, msg: m.PrefillFailed) -> None:
        state = self.router.requests.get(msg.request_id)
        if state is None or state.prefill_worker != peer or state.phase != "prefilling":
            return
        log.warning("prefill of %s on %s failed (%s); its decode worker prefills it", msg.request_id, peer,
                    msg.error)
        self.router.metrics.transfer_failures.inc()
        await self.prefill_locally(state, "transfer_failed")

    async def prefill_locally(self, state: RequestState, reason: str) -> None:
        """The KV will not come: the decode worker computes the prompt in the blocks it holds."""
        self._prefill_over(state)
        self.router.metrics.fallbacks.labels(reason).inc()
        state.phase = "decoding"
        # A first token the client already has is kept: the decode worker continues after it.
        first = state.output_token_ids[0] if state.output_token_ids else None
        await self.router.chan.send(state.worker_id, m.PrefillLocally(state.request_id, state.lease_id, first))

    def _prefill_over(self, state: RequestState) -> None:
        worker = self.router.registry.workers.get(state.prefill_worker)
        if worker is not None:
            worker.inflight = max(0, worker.inflight - 1)

    async def on_prefill_worker_lost(self, worker_id: str) -> None:
        for state in list(self.router.requests.values()):
            if state.prefill_worker == worker_id and state.phase == "prefilling":
                await self.prefill_locally(state, "prefill_worker_lost")

    async def release_prefill(self, state: RequestState) -> None:
        """The request leaves (abort, migration) while its prompt may still be at the prefill worker."""
        if state.prefill_worker and state.phase in ("reserving", "prefilling"):
            self._prefill_over(state)
            await self.router.chan.send(state.prefill_worker, m.Abort([state.request_id]))
        state.phase = "decoding"


def output_hashes(state: RequestState, block_size: int) -> list[int]:
    """Blocks whose KV the decode worker holds when the request ends: the
    prompt and every output token but the last (which was never fed back)."""
    return block_hashes(state.prompt_token_ids + state.output_token_ids[:-1], block_size)
