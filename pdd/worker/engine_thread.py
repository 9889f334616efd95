"""The worker's engine thread: the one thread that touches the engine.

    event loop ── commands ──▶ queue ──▶ engine thread: apply commands between
                                         steps, start requests whose KV landed,
                                         expire leases, poll transfers,
    event loop ◀── messages ── call_soon_threadsafe ◀──┘  step, publish a snapshot

The thread builds the engine and its role's side (so every device object is
made where it is used), then loops. Each pass takes the commands queued since
the last one — blocking while the engine has nothing to do, but never longer
than `idle_wakeup_s`, because leases expire; the data plane wakes it when a
transfer ends or a request's KV lands — applies them, runs one step if
there is work, and hands the replies to the event loop in one call. For the
heartbeats it publishes an immutable EngineSnapshot (after each pass that
leaves it idle, every SNAPSHOT_PERIOD_S while busy), and it sets
`step_started_at` for the duration of each step: a step that never ends shows
in the heartbeats while the event loop still answers.

A step that raises fails the requests of its batch (RequestFailed,
retriable=False), and the engine serves on. When it cannot — a device error,
MAX_CONSECUTIVE_STEP_FAILURES steps failing in a row, or the recovery itself
raising — the thread logs why and ends with EXIT_WORKER_FAILED: the process
exits and its supervisor starts a fresh one.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from pdd import faults
from pdd.config import EXIT_WORKER_FAILED, EXIT_REFUSED, ClusterConfig
from pdd.engine.engine import LLMEngine
from pdd.kv.cache import KVCacheSpec
from pdd.kv.layout import KVLayout
from pdd.logs import request_context
from pdd.model.loader import weights_fingerprint
from pdd.protocol import messages as m
from pdd.security import data_security
from pdd.transfer.plan import receiver_plan, set_aside
from pdd.worker.disagg import DecodeSide, PrefillSide, admit, step_messages
from pdd.worker.injected import inject_step_faults
from pdd.worker.records import PlacementTable, engine_id
from pdd.worker.stats import EngineSnapshot, EngineStats

log = logging.getLogger(__name__)

# A bad request fails one step; an engine that fails this many in a row is
# itself broken, and a fresh process is the way out.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# While busy, a snapshot at most this often (copying the journals costs up to
# 0.1 ms); after every pass that leaves the engine idle.
SNAPSHOT_PERIOD_S = 0.05


class EngineFailed(Exception):
    """The engine cannot go on; the process must exit."""


class _DataPlaneUnavailable(Exception):
    """The role's KV data plane cannot start (a configuration problem)."""


class _Control(enum.Enum):
    WAKE = "wake"      # something to look at (a transfer ended, a request's KV landed)
    DRAIN = "drain"    # take nothing new; end once the work in hand is done
    STOP = "stop"      # end now


@dataclass(frozen=True)
class EngineInfo:
    """What registration says about the engine; fixed once it is built."""
    device: str
    layout: KVLayout
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    data_addr: str
    transfer_backends: list[str]
    prefills_for_others: bool
    step: m.StepLimits


@dataclass(frozen=True)
class _Forget:
    """A router holds none of its requests here (it restarted, lost us, or is
    gone): those whose ids begin with `prefix` are dropped ("": every one)."""
    prefix: str


class EngineListener(Protocol):
    """The event loop's side; each method is called on the loop."""
    def on_engine_started(self, info: EngineInfo) -> None: ...
    def on_engine_messages(self, messages: list[m.Message]) -> None: ...
    def on_engine_forgot(self, prefix: str) -> None: ...
    def on_engine_exit(self, code: int) -> None: ...


class EngineThread(threading.Thread):
    def __init__(self, cfg: ClusterConfig, worker_id: str, loop, listener: EngineListener):
        # A daemon: a step that never returns must not keep the process alive
        # once the event loop has given up on it.
        super().__init__(name="pdd-engine", daemon=True)
        self.cfg = cfg
        self.role = cfg.worker.role
        self.worker_id = worker_id
        self.loop = loop
        self.listener = listener
        self.idle_wakeup_s = cfg.router.heartbeat_interval_s   # the loop updates it at registration
        # Read by the event loop (heartbeats); each is replaced whole, never mutated.
        self.snapshot = EngineSnapshot()
        self._snapshot_at = 0.0
        self.step_started_at: float | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: list[m.Message] = []
        self._draining = self._stopping = False
        self._stalled = False
        self._consecutive_failures = 0
        self.engine: LLMEngine | None = None
        self.decode_side: DecodeSide | None = None
        self.prefill_side: PrefillSide | None = None
        self.placements: PlacementTable | None = None   # made with the engine
        self.stats = EngineStats()
        # One engine step: the seam pdd.worker.injected wraps once a fault is set.
        self.run_step = self._run_step
        faults.when_armed(self, inject_step_faults)

    # ------------------------------------------------------------ any thread

    def submit(self, msg: m.Message) -> None:
        self._queue.put(msg)

    def wake(self) -> None:
        self._queue.put(_Control.WAKE)

    def drain(self) -> None:
        faults.release_hangs()   # a step blocked by an injected hang would never let it drain
        self._queue.put(_Control.DRAIN)

    def forget(self, prefix: str = "") -> None:
        """Drop the requests whose ids begin with `prefix` (pdd.worker.links)."""
        self._queue.put(_Forget(prefix))

    def stop(self) -> None:
        faults.release_hangs()
        self._queue.put(_Control.STOP)

    # ------------------------------------------------------------ the thread

    def run(self) -> None:
        code = EXIT_WORKER_FAILED
        try:
            code = self._run()
        finally:
            self._flush()
            for side in (self.decode_side, self.prefill_side):
                if side is not None:
                    side.close()
            self._close_engine()
            self._post(self.listener.on_engine_exit, code)

    def _close_engine(self) -> None:
        """Free the engine's host KV tier (pinned memory outlives nothing)."""
        if self.engine is None:
            return
        try:
            self.engine.close()
        except Exception:
            log.warning("worker %s: closing the engine failed", self.worker_id, exc_info=True)

    def _run(self) -> int:
        """The exit status: 0 once stopped or drained."""
        try:
            info = self._start()
        except _DataPlaneUnavailable as e:
            # A configuration problem: restarting would fail the same way.
            log.error("worker %s cannot start its KV data plane: %s", self.worker_id, e)
            return EXIT_REFUSED
        except Exception:
            log.critical("worker %s: the engine failed to start", self.worker_id, exc_info=True)
            return EXIT_WORKER_FAILED
        self._post(self.listener.on_engine_started, info)
        try:
            self._serve()
        except Exception as e:
            log.critical("worker %s: the engine cannot go on (%s); exiting with status %d",
                         self.worker_id, e, EXIT_WORKER_FAILED, exc_info=True)
            return EXIT_WORKER_FAILED
        return 0

    def _start(self) -> EngineInfo:
        engine_cfg = self.cfg.engine
        if self.role == "prefill":
            # A prefill worker never runs a decode-only step: capturing decode graphs
            # would only cost start-up time and memory.
            engine_cfg = dataclasses.replace(engine_cfg, cuda_graphs=False)
        e = self.engine = LLMEngine(engine_cfg, beside_kv=self._set_aside)
        if e.grammar_compiler is not None:   # a request whose grammar compiled is scheduled at once
            e.grammar_compiler.on_ready = self.wake
        self.placements = PlacementTable(e)
        # Before registering: the router's first requests must not pay the
        # Triton compilation of eager steps or of the data plane's page copies
        # (on CPU nothing is compiled).
        warm_up = engine_cfg.warm_up and e.device.type == "cuda"
        if warm_up:
            e.warm_up()
        layout = KVLayout(
            model_id=self.cfg.layout_model_id(e.model_dir),
            weights_hash=weights_fingerprint(e.model_dir, e.cfg.load_format),
            dtype=str(e.dtype).removeprefix("torch."), block_size=e.cfg.block_size,
            num_layers=e.model_config.num_layers, num_kv_heads=e.model_config.num_kv_heads,
            head_dim=e.model_config.head_dim,
            kv_cache_dtype=str(e.runner.kv_spec.dtype).removeprefix("torch."),
            kv_scales=e.runner.kv_scales.identity() if e.runner.kv_scales is not None else "")
        wc = self.cfg.worker
        try:
            security = data_security(self.cfg)
            plan = receiver_plan(wc, e.device, e.runner.beside_kv_bytes)
            if self.role != "prefill":
                self.decode_side = DecodeSide(e, self.worker_id, wc, layout, self.placements, self.wake,
                                              security, plan)
            if self.role == "prefill" or wc.prefill_for_others:
                self.prefill_side = PrefillSide(e, self.worker_id, wc, layout, self.placements, self.wake, security,
                                                plan.backends)
        # e.g. no keys, data_addr taken, cuda_ipc without a GPU, nixl without its extra (NixlUnavailable)
        except (ValueError, RuntimeError) as err:
            raise _DataPlaneUnavailable(str(err)) from err
        if warm_up:
            for side in (self.decode_side, self.prefill_side):
                if side is not None:
                    side.warm_up()
            e.watch_compiles()
        self._publish_snapshot()
        return EngineInfo(
            device=str(e.device), layout=layout, num_blocks=e.kv.pool.num_usable_blocks,
            max_num_seqs=e.cfg.max_num_seqs, max_model_len=e.max_model_len,
            data_addr=self.decode_side.data_addr if self.decode_side else "", transfer_backends=plan.backends,
            prefills_for_others=wc.prefill_for_others, step=m.StepLimits.of(e.cfg, e.model_config))

    def _set_aside(self, spec: KVCacheSpec, max_tokens: int) -> int:
        """What the data plane's receiver keeps beside the pool (pdd.transfer.plan.set_aside),
        said in one line where there is something to say."""
        aside = set_aside(self.cfg.worker, spec.bytes_per_token, max_tokens)
        if aside.note:
            log.info("worker %s: %s", self.worker_id, aside.note)
        return aside.nbytes

    def _serve(self) -> None:
        """The loop; returns when stopped, or drained; raises EngineFailed."""
        while True:
            busy = self.engine.has_unfinished()
            if not busy and self._draining and not self._transfers_pending():
                log.info("worker %s drained", self.worker_id)
                return
            self._take_commands(wait=not busy or self._stalled)
            if self._stopping:
                return
            if self.decode_side is not None:
                self._replies += self.decode_side.poll()
            if self.prefill_side is not None:
                self._replies += self.prefill_side.poll()
            if self.engine.has_unfinished():
                self._step()
            # Before the replies: a heartbeat sent after them is at least as new,
            # except while busy, when snapshots are rate-limited.
            if (not self.engine.has_unfinished() or self._stalled
                    or time.monotonic() - self._snapshot_at >= SNAPSHOT_PERIOD_S):
                self._publish_snapshot()
            self._flush()

    def _take_commands(self, wait: bool) -> None:
        try:
            items = [self._queue.get(timeout=self.idle_wakeup_s) if wait else self._queue.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for item in items:
            self._apply(item)

    def _apply(self, item: m.Message | _Control | _Forget) -> None:
        if item is _Control.DRAIN:
            self._draining = True
        elif item is _Control.STOP:
            self._stopping = True
        elif isinstance(item, _Forget):
            held = [p for p in self.placements.all() if p.request_id.startswith(item.prefix)]
            if held:
                log.warning("worker %s: the router holds none of our %d request(s)%s; dropping them",
                            self.worker_id, len(held), f" of {item.prefix[:-1]}" if item.prefix else "")
            for p in held:
                self.placements.release(p.engine_id)
            # What came before is about what was dropped: handed over ahead of
            # the word that it is, so the loop can tell the two apart.
            self._flush()
            self._post(self.listener.on_engine_forgot, item.prefix)
        elif item is not _Control.WAKE:
            with request_context(getattr(item, "request_id", None)):   # its log lines carry the id
                try:
                    self._replies += self._dispatch(item)
                except Exception as e:
                    self._replies += self._command_failed(item, e)

    def _dispatch(self, msg: m.Message) -> list[m.Message]:
        if isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                for p in self.placements.of_request(rid):
                    self.placements.release(p.engine_id)
            return []
        if isinstance(msg, m.Admit):   # every role can run a request whole
            return admit(self.engine, self.worker_id, self.placements, msg)
        if isinstance(msg, m.ResetPrefixCache):   # `pdd admin cache flush`: the compiled grammars go too
            dropped = self.engine.kv.reset_prefix_cache()
            grammars = self.engine.flush_grammar_cache()
            log.info("worker %s: prefix cache reset, %d cached block(s) and %d compiled grammar(s) dropped",
                     self.worker_id, dropped, grammars)
            return [m.PrefixCacheReset(self.worker_id, msg.reset_id, dropped)]
        side = self.prefill_side if isinstance(msg, (m.Prefill, m.KVTarget)) else self.decode_side
        if side is None:
            log.warning("worker %s (%s) cannot handle %s", self.worker_id, self.role, msg.TYPE)
            return [m.RequestFailed(self.worker_id, msg.request_id, msg.epoch,
                                    f"a {self.role} worker does not take {msg.TYPE} messages")]
        return side.handle(msg)

    def _command_failed(self, msg: m.Message, e: Exception) -> list[m.Message]:
        """A command raised something other than InvalidRequest (a bug, or a
        value no check foresaw): its request fails, the worker serves on."""
        log.error("worker %s: applying %s failed", self.worker_id, msg.TYPE, exc_info=e)
        if isinstance(msg, (m.Abort, m.ResetPrefixCache)):   # no request to fail (a reset is not acknowledged)
            return []
        p = self.placements.find(msg.request_id, msg.epoch)
        self.placements.release(p.engine_id if p is not None else engine_id(msg.request_id, msg.epoch))
        return [m.RequestFailed(self.worker_id, msg.request_id, msg.epoch,
                                f"the worker failed to apply {msg.TYPE}: {type(e).__name__}: {e}")]

    def _run_step(self) -> list:
        self.step_started_at = time.monotonic()   # cleared by _step once it ended
        return self.engine.step()

    def _step(self) -> None:
        try:
            outputs = self.run_step()
        except Exception as e:
            self._replies += self._step_failed(e)
            return
        finally:
            self.step_started_at = None
        self._consecutive_failures = 0
        step = self.engine.last_step
        self.stats.record(step)
        # Nothing scheduled and nothing came back (e.g. waiting requests, no
        # free block): wait for a command or a wakeup instead of spinning.
        self._stalled = step.num_tokens == 0 and not outputs and self.engine.in_flight is None
        self._replies += step_messages(self.worker_id, self.placements, self.prefill_side, outputs)

    def _step_failed(self, e: Exception) -> list[m.Message]:
        self._consecutive_failures += 1
        if _is_device_error(e):
            raise EngineFailed(f"device error in an engine step: {e}") from e
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFailed(f"{self._consecutive_failures} engine steps failed in a row") from e
        log.error("worker %s: an engine step failed; failing the requests of its batch", self.worker_id, exc_info=e)
        try:
            failed = self.engine.abort_failed_step()
        except Exception as err:
            raise EngineFailed(f"cannot recover from a failed engine step: {err!r}") from err
        error = f"engine step failed: {type(e).__name__}: {e}"
        replies = []
        for eid in failed:
            p = self.placements.release(eid)
            if p is not None:
                replies.append(m.RequestFailed(self.worker_id, p.request_id, p.epoch, error, retriable=False))
        return replies

    def _transfers_pending(self) -> bool:
        return bool((self.prefill_side and self.prefill_side.transfers_pending)
                    or (self.decode_side and self.decode_side.reservations_pending))

    def _publish_snapshot(self) -> None:
        transfer = self.decode_side.stats() if self.decode_side else {}
        self.snapshot = self.stats.snapshot(self.engine, transfer)
        self._snapshot_at = time.monotonic()

    def _flush(self) -> None:
        if self._replies:
            self._post(self.listener.on_engine_messages, self._replies)
            self._replies = []

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: it gave up on this thread
            pass


def _is_device_error(e: BaseException) -> bool:
    """A CUDA error leaves the device context unusable: nothing will work again
    in this process. (Out of memory is not one: that step fails, others may not.)"""
    return isinstance(e, torch.AcceleratorError) or "CUDA error" in str(e)

