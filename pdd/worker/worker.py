"""A worker process: one engine, connected to the cluster's routers over the control bus.

Two threads, and only one of them touches the engine:

- the event loop does the control I/O: it registers with every router,
  receives commands and queues them for the engine thread, sends what the
  engine thread hands back to the router whose request it is, and heartbeats
  from the engine thread's latest snapshot (pdd.worker.links: one link per
  router, each router's request ids in a namespace of its own);
- the engine thread (pdd.worker.engine_thread) owns the engine: it applies
  the queued commands between steps, runs the steps, and publishes snapshots.

(The KV data plane has threads of its own: a receiver writes arriving pages
into leased blocks, which no step uses before the lease is closed, and wakes
the engine thread when a request's KV has all landed; a sender wakes it when
a transfer ends.)

SIGTERM/SIGINT drain (take nothing new, finish what runs, say goodbye, exit);
a second signal stops at once. If the engine or a control task cannot go on,
the process exits with EXIT_WORKER_FAILED so that its supervisor restarts it.
A process the router refuses exits with EXIT_REFUSED; one it tells that another
process registered under its worker id since (Replaced) exits with EXIT_REPLACED:
restarted, it would only fight the other one for the id.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid

import zmq.asyncio

from pdd import build_info, faults, logs, sdnotify
from pdd.config import EXIT_WORKER_FAILED, EXIT_REFUSED, EXIT_REPLACED, ClusterConfig
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel
from pdd.worker.links import Outgoing, RouterLink, into_namespace, make_links
from pdd.security import control_security, worker_public_key
from pdd.transfer.ipc import host_id
from pdd.worker.engine_thread import EngineInfo, EngineThread
from pdd.worker.injected import drop_reserves
from pdd.worker.stats import HeartbeatReader

log = logging.getLogger(__name__)

# Router commands the engine thread applies.
ENGINE_COMMANDS = (m.Admit, m.Abort, m.Reserve, m.PrefillLocally, m.Prefill, m.KVTarget, m.ResetPrefixCache)
# How long a stop waits for the engine thread to finish its step; past that
# the step is taken to hang and the process exits without it.
ENGINE_STOP_TIMEOUT_S = 10.0
# A stop's time beyond the drain and the engine thread's end (goodbye, sockets
# closed); asked of systemd with them when a drain begins.
STOP_MARGIN_S = 5.0


class Worker:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.role = cfg.worker.role
        self.worker_id = cfg.worker.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        addrs = [cfg.worker.router_addr] if cfg.worker.router_addr else [a for a, _ in cfg.router.routers]
        self.links = make_links(addrs)
        self.outgoing = Outgoing(self.links)
        # This process start: the router tells a restarted worker from a live one.
        self.incarnation = uuid.uuid4().hex
        self.heartbeat_interval = cfg.router.heartbeat_interval_s
        self.heartbeats = HeartbeatReader(self.worker_id)
        self.draining = False
        self.exit_code = 0
        self.info: EngineInfo | None = None
        self.engine_thread: EngineThread | None = None
        # A router's command for the engine: the seam pdd.worker.injected wraps once a fault is set.
        self.to_engine = self._to_engine
        faults.when_armed(self, drop_reserves)

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        control_security(self.cfg, self.role)   # its keys checked: a config error stops us before the model loads
        self.started, self.stopping = asyncio.Event(), asyncio.Event()
        self.outbox: asyncio.Queue[tuple[RouterLink, m.Message] | None] = asyncio.Queue()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        self.engine_thread = EngineThread(self.cfg, self.worker_id, loop, self)
        self.engine_thread.start()
        await _first_of(self.started, self.stopping)
        if self.stopping.is_set():   # the engine failed to start, or a signal came first
            await self._stop_engine()
            return self.exit_code
        ctx = zmq.asyncio.Context()
        for link in self.links:
            # The connection is this process's own (pdd.router.connections): a process
            # started later under this worker id does not take it over, and the router
            # can tell this one that it was replaced.
            link.chan = DealerChannel(ctx, link.addr, f"{self.worker_id}/{self.incarnation}",
                                      control_security(self.cfg, self.role, link.index),
                                      on_disconnect=lambda link=link: self._router_gone(link))
        sender = self._start_task(self._send_loop())
        tasks = [self._start_task(t) for link in self.links
                 for t in (self._recv_loop(link), self._register_loop(link))]
        tasks.append(self._start_task(self._heartbeat_loop()))
        log.info("worker %s (%s) on %s, %s", self.worker_id, self.role, self.info.device, self.routers_named)
        await self.stopping.wait()
        await self._stop_engine()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.outbox.put_nowait(None)   # what the engine thread handed over is sent first
        await asyncio.gather(sender, return_exceptions=True)
        if self.exit_code == 0:
            for link in self.links:
                await link.chan.send(m.Goodbye(self.worker_id))
            await asyncio.sleep(0.05)  # let zmq flush the goodbye
        for link in self.links:
            link.chan.close()
        ctx.term()
        return self.exit_code

    @property
    def routers_named(self) -> str:
        return ", ".join(f"{link.name} {link.addr}" for link in self.links)

    def registered_with(self) -> int:
        """How many of the routers hold this worker registered."""
        return sum(link.registered.is_set() for link in self.links)

    def _start_task(self, coro) -> asyncio.Task:
        """A control task; if it fails, the worker stops rather than go on
        heartbeating without it (deaf to commands, or mute)."""
        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.critical("worker %s: %s failed; exiting with status %d", self.worker_id,
                             task.get_coro().__name__, EXIT_WORKER_FAILED, exc_info=task.exception())
                self.exit_code = self.exit_code or EXIT_WORKER_FAILED
                self.stopping.set()
        task = asyncio.create_task(coro)
        task.add_done_callback(done)
        return task

    def begin_drain(self) -> None:
        """SIGTERM: take no new requests, finish the running ones, then stop.
        A second one stops at once."""
        if self.draining:
            log.info("worker %s stopping without draining", self.worker_id)
            self.stopping.set()
            return
        drain_s = self.cfg.worker.drain_timeout_s
        log.info("worker %s draining (up to %gs)", self.worker_id, drain_s)
        self.draining = True
        self.engine_thread.drain()
        sdnotify.notifier().stopping(f"{self.worker_id} draining, up to {drain_s:g}s",
                                     within_s=drain_s + ENGINE_STOP_TIMEOUT_S + STOP_MARGIN_S)
        asyncio.get_running_loop().call_later(drain_s, self._drain_expired)

    def _drain_expired(self) -> None:
        """Past worker.drain_timeout_s: stop as a second signal does; the router
        moves the requests still running here."""
        if not self.stopping.is_set():
            log.warning("worker %s: still busy after worker.drain_timeout_s (%gs); stopping without draining",
                        self.worker_id, self.cfg.worker.drain_timeout_s)
            self.stopping.set()

    async def _stop_engine(self) -> None:
        t = self.engine_thread
        t.stop()
        await asyncio.to_thread(t.join, ENGINE_STOP_TIMEOUT_S)
        if t.is_alive():
            log.error("worker %s: the engine thread did not stop within %.0fs (a step hangs?); exiting "
                      "without it", self.worker_id, ENGINE_STOP_TIMEOUT_S)
            self.exit_code = self.exit_code or EXIT_WORKER_FAILED

    # ------------------------------------------------------------ from the engine thread

    def on_engine_started(self, info: EngineInfo) -> None:
        self.info = info
        self.started.set()

    def on_engine_messages(self, messages: list[m.Message]) -> None:
        dropped = 0
        for msg in messages:
            for link, out in self.outgoing.route(msg):
                if link.forgets_pending:
                    dropped += 1
                else:
                    self.outbox.put_nowait((link, out))
        if dropped:
            log.debug("worker %s: %d message(s) about dropped requests not sent", self.worker_id, dropped)

    def on_engine_forgot(self, prefix: str) -> None:
        """The engine thread dropped what one router held here (`forget`)."""
        for link in self.links:
            if link.prefix == prefix:
                link.forgets_pending = max(0, link.forgets_pending - 1)

    def on_engine_exit(self, code: int) -> None:
        """The engine thread ended: drained (0), or the engine failed."""
        self.exit_code = self.exit_code or code
        self.stopping.set()

    # ------------------------------------------------------------------ control

    def register_message(self, link: RouterLink) -> m.Register:
        i = self.info
        return m.Register(session=link.session,
            worker_id=self.worker_id, role=self.role, host=socket.gethostname(), pid=os.getpid(),
            device=i.device, layout=i.layout.to_dict(), num_blocks=i.num_blocks, max_num_seqs=i.max_num_seqs,
            max_model_len=i.max_model_len, data_addr=i.data_addr, transfer_backends=i.transfer_backends,
            host_id=host_id(), incarnation=self.incarnation, public_key=worker_public_key(self.cfg),
            prefills_for_others=i.prefills_for_others, step=i.step, build=build_info())

    async def _register_loop(self, link: RouterLink) -> None:
        """(Re-)register until the router answers; the router may start after us.
        Unanswered for long, it says so (at the default log level): a wrong
        router address or a router that is down is otherwise a silent wait."""
        unanswered = 0
        while True:
            if link.registered.is_set():
                unanswered = 0
            else:
                await link.chan.send(self.register_message(link))
                unanswered += 1
                if unanswered % 30 == 10:
                    log.warning("worker %s: no answer from the %s at %s for %ds; still trying", self.worker_id,
                                link.name, link.addr, unanswered)
            await asyncio.sleep(1.0)

    async def _recv_loop(self, link: RouterLink) -> None:
        while True:
            msg = await link.chan.recv()
            self._heard(link)
            if isinstance(msg, ENGINE_COMMANDS):
                self.to_engine(link, msg)
            elif isinstance(msg, m.HeartbeatAck):
                pass   # its arrival is what counts (_heard)
            elif isinstance(msg, m.RegisterReply):
                self._on_register_reply(link, msg)
            elif isinstance(msg, m.Replaced):
                log.error("worker %s: another process registered under this worker id; this one exits "
                          "(status %d: not to be restarted)", self.worker_id, EXIT_REPLACED)
                self.exit_code = EXIT_REPLACED
                self.stopping.set()
            elif isinstance(msg, m.ReRegister):
                # The router does not know us (it restarted, or took us for lost and
                # moved our requests): whatever we hold of its is nobody's.
                link.registered.clear()
                self._forget(link)
                await link.chan.send(self.register_message(link))
            elif isinstance(msg, m.SetFaults):
                self._set_faults(msg)
            elif isinstance(msg, m.SetLogLevel):
                self._set_log_level(msg.level)
            elif isinstance(msg, m.Shutdown):
                self.begin_drain() if msg.drain else self.stopping.set()
            else:
                log.warning("worker: ignoring unexpected %s message", msg.TYPE)

    def _to_engine(self, link: RouterLink, msg: m.Message) -> None:
        self.engine_thread.submit(into_namespace(link, msg))

    def _forget(self, link: RouterLink) -> None:
        """Drop what `link`'s router placed here, and every message about it not
        sent yet (on_engine_messages): one that went after the next Register
        could pass for a request the router placed here since, under the same
        id (a client's X-Request-Id) and epoch. A new session: the next Register
        says so."""
        link.session += 1
        link.forgets_pending += 1
        self._drop_unsent(link)
        self.engine_thread.forget(link.prefix)

    def _router_gone(self, link: RouterLink) -> None:
        """The connection to a router closed: the process is gone (or cut off, and
        then it counts us lost at once). What it placed here is freed now, not
        after a timeout; its restart finds us registering again."""
        if not link.registered.is_set():
            return
        log.warning("worker %s: the connection to the %s at %s closed; dropping what it placed here and "
                    "registering again", self.worker_id, link.name, link.addr)
        link.registered.clear()
        self._forget(link)

    def _on_register_reply(self, link: RouterLink, msg: m.RegisterReply) -> None:
        if msg.ok:
            if not link.registered.is_set():
                log.info("worker %s registered with the %s", self.worker_id, link.name)
                if not self.registered_with():
                    sdnotify.notifier().ready(f"{self.worker_id} ({self.role}) registered at {link.addr}")
            self.heartbeat_interval = msg.heartbeat_interval_s
            link.liveness_s = msg.liveness_s
            self.engine_thread.idle_wakeup_s = msg.heartbeat_interval_s
            link.registered.set()
        else:
            log.error("router refused worker %s: %s", self.worker_id, msg.error)
            self.exit_code = EXIT_REFUSED
            self.stopping.set()

    def _set_faults(self, msg: m.SetFaults) -> None:
        try:
            faults.apply(msg.faults, clear=msg.clear)
        except faults.FaultError as e:   # the router checked them: another version's name?
            log.error("worker %s: refused fault settings: %s", self.worker_id, e)

    def _set_log_level(self, level: str) -> None:
        try:
            log.warning("worker %s: log level now %s (pdd admin log-level)", self.worker_id, logs.set_level(level))
        except ValueError as e:
            log.error("worker %s: refused a log level: %s", self.worker_id, e)

    def _drop_unsent(self, link: RouterLink) -> None:
        """Take out of the outbox what the engine thread handed over for `link` and is not sent yet."""
        kept, dropped = [], 0
        while not self.outbox.empty():
            item = self.outbox.get_nowait()
            if item is not None and item[0] is link:
                dropped += 1
            else:
                kept.append(item)   # the stop's end mark too
        for item in kept:
            self.outbox.put_nowait(item)
        if dropped:
            log.debug("worker %s: %d unsent message(s) about dropped requests discarded", self.worker_id, dropped)

    async def _send_loop(self) -> None:
        """Sends what the engine thread handed over, in order, until None."""
        while (item := await self.outbox.get()) is not None:
            link, msg = item
            await link.chan.send(msg)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            beat = None
            for link in self.links:
                if link.registered.is_set():
                    self._watch_router(link)
                    beat = beat or self.heartbeat()
                    await link.chan.send(beat)

    def _watch_router(self, link: RouterLink) -> None:
        """The router answers every heartbeat (HeartbeatAck, ReRegister or
        Replaced); none for its liveness window means it is down, stalled or cut
        off from here, and has counted this worker lost unless it stalled. Said
        once, and the heartbeats go on: not an exit, which would take every
        worker with a router restart or stall (a stalled router answers late and
        keeps the requests; a restarted one, or one that moved them, answers
        ReRegister and they are dropped; a process replaced meanwhile is told)."""
        silent_s = time.monotonic() - link.last_heard
        if link.liveness_s and silent_s > link.liveness_s and not link.unanswered:
            link.unanswered = True
            log.warning("worker %s: no answer from the %s for %.1fs (its liveness window is %gs): down, "
                        "stalled or cut off from this worker; heartbeats go on", self.worker_id, link.name,
                        silent_s, link.liveness_s)

    def _heard(self, link: RouterLink) -> None:
        now = time.monotonic()
        if link.unanswered:
            link.unanswered = False
            log.warning("worker %s: the %s answers again, after %.1fs", self.worker_id, link.name,
                        now - link.last_heard)
        link.last_heard = now

    def heartbeat(self) -> m.Heartbeat:
        t = self.engine_thread
        started = t.step_started_at   # read once: the engine thread clears it when the step ends
        running_s = time.monotonic() - started if started is not None else 0.0
        return self.heartbeats.heartbeat(t.snapshot, running_s, self.draining, faults.current())


async def _first_of(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
