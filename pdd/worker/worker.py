"""A worker process: one engine, connected to the router over the control bus.

Two activities share one asyncio loop without stalling each other: the
control I/O (receive, heartbeat) runs on the loop, and each engine step runs
in a dedicated thread (torch releases the GIL while it computes). Commands
that arrive during a step are queued and applied between steps, so the engine
is only ever touched by one thing at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from pdd import faults
from pdd.config import EXIT_REFUSED, ClusterConfig
from pdd.engine.engine import LLMEngine
from pdd.engine.sampling_params import InvalidRequest, SamplingParams
from pdd.kv.layout import KVLayout
from pdd.model.loader import weights_fingerprint
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel
from pdd.transfer import offered_backends
from pdd.transfer.ipc_pool import host_id
from pdd.worker.disagg import DecodeSide, PrefillSide
from pdd.worker.stats import StepStatsBuffer

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.role = cfg.worker.role
        self.worker_id = cfg.worker.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.router_addr = cfg.worker.router_addr or cfg.router.control_addr
        self.engine: LLMEngine | None = None
        self.pending: list[m.Message] = []
        self.wake = asyncio.Event()
        self.stopping = asyncio.Event()
        self.draining = False
        self.registered = asyncio.Event()
        self.heartbeat_interval = cfg.router.heartbeat_interval_s
        self.stats = StepStatsBuffer()
        # One thread: engine steps never overlap.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.exit_code = 0
        self.decode_side: DecodeSide | None = None
        self.prefill_side: PrefillSide | None = None

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        self.loop = loop
        engine_cfg = self.cfg.engine
        if self.role == "prefill":
            # A prefill worker never runs a decode-only step: capturing decode graphs
            # would only cost start-up time and memory.
            engine_cfg = dataclasses.replace(engine_cfg, cuda_graphs=False)
        self.engine = await loop.run_in_executor(self.executor, LLMEngine, engine_cfg)
        try:
            self.decode_side = DecodeSide(self, self.layout()) if self.role in ("decode", "colocated") else None
            self.prefill_side = PrefillSide(self, self.layout()) if self.role == "prefill" else None
        except (ValueError, RuntimeError) as e:  # e.g. data_addr taken, cuda_ipc without a GPU
            log.error("worker %s cannot start its KV data plane: %s", self.worker_id, e)
            self.executor.shutdown(wait=True)
            return EXIT_REFUSED
        ctx = zmq.asyncio.Context()
        self.chan = DealerChannel(ctx, self.router_addr, self.worker_id)
        tasks = [asyncio.create_task(t) for t in
                 (self._recv_loop(), self._engine_loop(), self._heartbeat_loop(), self._register_loop())]
        log.info("worker %s (%s) on %s, router %s", self.worker_id, self.role, self.engine.device,
                 self.router_addr)
        await self.stopping.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.exit_code == 0:
            await self.chan.send(m.Goodbye(self.worker_id))
            await asyncio.sleep(0.05)  # let zmq flush the goodbye
        self.chan.close()
        for side in (self.decode_side, self.prefill_side):
            if side is not None:
                side.close()
        ctx.term()
        self.executor.shutdown(wait=True)
        return self.exit_code

    def begin_drain(self) -> None:
        """SIGTERM: take no new requests, finish the running ones, then stop."""
        if not self.draining:
            log.info("worker %s draining", self.worker_id)
            self.draining = True
            self.wake.set()

    def wake_threadsafe(self) -> None:
        """For other threads (the KV sender): something for the engine loop to look at."""
        self.loop.call_soon_threadsafe(self.wake.set)

    def layout(self) -> KVLayout:
        e = self.engine
        if not hasattr(self, "_layout"):
            self._layout = KVLayout(
                model_id=self.cfg.served_model_name(e.model_dir),
                weights_hash=weights_fingerprint(e.model_dir, e.cfg.load_format),
                dtype=str(e.dtype).removeprefix("torch."), block_size=e.cfg.block_size,
                num_layers=e.model_config.num_layers, num_kv_heads=e.model_config.num_kv_heads,
                head_dim=e.model_config.head_dim)
        return self._layout

    def register_message(self) -> m.Register:
        e = self.engine
        return m.Register(
            worker_id=self.worker_id, role=self.role, host=socket.gethostname(), pid=os.getpid(),
            device=str(e.device), layout=self.layout().to_dict(), num_blocks=e.kv.pool.num_usable_blocks,
            max_num_seqs=e.cfg.max_num_seqs, max_model_len=e.max_model_len,
            data_addr=self.decode_side.data_addr if self.decode_side else "",
            transfer_backends=offered_backends(self.cfg.worker.transfer_backend, e.device), host_id=host_id())

    async def _register_loop(self) -> None:
        """(Re-)register until the router answers; the router may start after us."""
        while True:
            if not self.registered.is_set():
                await self.chan.send(self.register_message())
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ control

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.chan.recv()
            if isinstance(msg, m.RegisterReply):
                self._on_register_reply(msg)
            elif isinstance(msg, m.ReRegister):
                self.registered.clear()
                await self.chan.send(self.register_message())
            elif isinstance(msg, m.Shutdown):
                self.begin_drain() if msg.drain else self.stopping.set()
            elif isinstance(msg, (m.Admit, m.Abort, m.Reserve, m.KVReady, m.PrefillLocally, m.Prefill)):
                self.pending.append(msg)
                self.wake.set()
            else:
                log.warning("worker: ignoring unexpected %s message", msg.TYPE)

    def _on_register_reply(self, msg: m.RegisterReply) -> None:
        if msg.ok:
            if not self.registered.is_set():
                log.info("worker %s registered", self.worker_id)
            self.heartbeat_interval = msg.heartbeat_interval_s
            self.registered.set()
        else:
            log.error("router refused worker %s: %s", self.worker_id, msg.error)
            self.exit_code = EXIT_REFUSED
            self.stopping.set()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self.registered.is_set():
                await self.chan.send(self.heartbeat())
            self.wake.set()  # periodic duties of the engine loop (lease expiry)

    def heartbeat(self) -> m.Heartbeat:
        e = self.engine
        samples = self.stats.drain()
        return m.Heartbeat(
            worker_id=self.worker_id, running=len(e.scheduler.running), waiting=e.scheduler.num_waiting(),
            free_blocks=e.kv.num_free_blocks, total_blocks=e.kv.pool.num_usable_blocks,
            prefix_hit_rate=e.kv.hit_rate(), num_preemptions=e.scheduler.num_preemptions,
            step_latencies=samples.step_latencies, prefill_chunks=samples.prefill_chunks,
            decode_batches=samples.decode_batches, recent_hashes=e.kv.take_recent_hashes(),
            transfer=self.decode_side.stats() if self.decode_side else {}, draining=self.draining)

    # ------------------------------------------------------------------ engine

    def _apply_pending(self) -> list[m.Message]:
        """Apply queued commands to the engine; returns replies to send."""
        replies = []
        pending, self.pending = self.pending, []
        for msg in pending:
            if isinstance(msg, m.Abort):
                for rid in msg.request_ids:
                    self._abort(rid)
            elif isinstance(msg, m.Admit) and self.role != "prefill":
                replies.extend(self._admit(msg))
            elif isinstance(msg, m.Prefill) and self.prefill_side is not None:
                replies.extend(self.prefill_side.handle(msg))
            elif self.decode_side is not None and not isinstance(msg, (m.Admit, m.Prefill)):
                replies.extend(self.decode_side.handle(msg))
            else:
                log.warning("worker %s (%s) cannot handle %s", self.worker_id, self.role, msg.TYPE)
                rid = getattr(msg, "request_id", "")
                replies.append(m.RequestFailed(self.worker_id, rid, f"a {self.role} worker does not take "
                                               f"{msg.TYPE} messages"))
        if self.decode_side is not None:
            replies.extend(self.decode_side.expire())
        if self.prefill_side is not None:
            replies.extend(self.prefill_side.poll())
        return replies

    def _abort(self, request_id: str) -> None:
        # Decode side first: the lease must be closed before the blocks are freed.
        for side in (self.decode_side, self.prefill_side):
            if side is not None:
                side.abort(request_id)
        self.engine.abort_request(request_id)

    def _admit(self, msg: m.Admit) -> list[m.Message]:
        try:
            sampling = SamplingParams(**msg.sampling)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, sampling,
                                    num_prior_output_tokens=msg.num_prior_output_tokens)
        except (InvalidRequest, TypeError, ValueError) as e:
            return [m.RequestFailed(self.worker_id, msg.request_id, f"{e}", retriable=False)]
        return []

    def _transfers_pending(self) -> bool:
        return bool((self.prefill_side and self.prefill_side.first_tokens)
                    or (self.decode_side and self.decode_side.lease_of))

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Cleared before looking for work: a wake-up that arrives while we
            # look (or send) is not lost, it makes the wait below return at once.
            self.wake.clear()
            for reply in self._apply_pending():
                await self.chan.send(reply)
            if not self.engine.has_unfinished():
                if self.draining and not self._transfers_pending():
                    self.stopping.set()
                    return
                await self.wake.wait()
                continue
            delay = faults.get(f"{self.role}.step_delay_s")
            if delay:
                await asyncio.sleep(delay)
            outputs = await loop.run_in_executor(self.executor, self.engine.step)
            self.stats.record(self.engine.last_step)
            if self.prefill_side is not None:
                for reply in self.prefill_side.on_outputs(outputs):
                    await self.chan.send(reply)
            elif outputs:
                items = [[o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.logprobs or None,
                          o.num_cached_tokens] for o in outputs]
                await self.chan.send(m.TokenBatch(self.worker_id, items))
