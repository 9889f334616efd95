"""The `cuda_ipc` backend, prefill side: one-sided page writes into a decode
worker's KV pool on the same host (over NVLink between two GPUs, or within one).

The decode worker exports its pool once (pdd.transfer.ipc); this sender
opens it in its own device's context and launches the page-copy kernel on a
side stream ordered after the layers' writes: by default one launch per engine
step, at its end; or one per group of layers while the forward goes on (see
__init__ for when each pays). Before the next step reuses any source block,
the compute stream waits for the side stream (step_done); no host sync
anywhere on the engine thread.

A store into another process's memory cannot be refused after the fact, so
the decode worker must know who may write and until when. Control messages on
its data socket (answered by pdd.transfer.ipc.IpcControl), from this sender's
I/O thread (pdd.transfer.sender.ControlSender):

    ipc_open    once per decode worker: the pool's export, if our layouts agree
    ipc_begin   before a request's first copy: the lease is live, the decode
                worker holds its blocks until we end; answers how many seconds
                we may write (no copy is launched after that)
    ipc_commit  after the request's last copy completed: its lease is checked
                again; only an ok commit makes the transfer a success. It
                carries the handoff (the first token): the decode worker
                starts the request on it, as on tcp's done message
    ipc_end     after the copies of an aborted or failed request completed

Results: a request succeeds when its commit is acknowledged; it fails with a
reason when the pool cannot be opened, the lease is refused or gone, the
decode worker does not answer within `timeout_s` or its connection drops, or
its lease would expire. A dropped connection also unmaps the pool at once: a
dead process's GPU memory stays allocated while anyone maps it.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from pdd.ops.triton_pages import copy_blocks_unchecked
from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, TransferTarget
from pdd.transfer.dest import Dest, DestKey
from pdd.transfer.ipc import PoolOpenError, open_pool
from pdd.transfer.progress import Progress, Tombstones
from pdd.transfer.receiver import pool_mismatch
from pdd.transfer.sender import ControlSender
from pdd.transfer.staging import dst_blocks_for, index_tensor

log = logging.getLogger(__name__)
# Stop launching copies this long before the lease the decode worker granted
# ends: the grant's age on arrival, and copies still queued behind compute.
_DEADLINE_MARGIN_S = 1.0
_REOPEN_AFTER_S = 5.0  # a pool that failed to open is asked for again after this long
# Longest the engine thread waits for a request's ipc_begin answer (asked when
# the request arrived, so normally long there): the whole prefill worker waits
# with it, so past this the request fails over to a local prefill instead.
_GRANT_WAIT_S = 5.0


class WriteState(enum.Enum):
    """Where one request's writes stand with the decode worker."""

    ASKING = "asking"          # ipc_begin sent, not answered: no copy launches yet
    WRITING = "writing"        # the decode worker counts us as a writer: copies launch until the deadline
    COMMITTING = "committing"  # its copies completed, the commit is out: no more copies, a writer until answered
    ENDED = "ended"            # settled, or settling: no more copies, no longer a writer


@dataclass(frozen=True)
class Commit:
    """What a request's commit carries (known once finish() was called)."""

    blocks_skipped: int = 0
    handoff: Handoff | None = None      # to the decode side, which starts the request on it


@dataclass
class IpcWrite:
    """One request's transfer. `state` moves on the I/O thread only; it and the
    fields the engine thread reads (pool, deadline, error, copied) are set under
    the sender's lock."""

    target: TransferTarget
    progress: Progress
    state: WriteState = WriteState.ASKING
    pool: torch.Tensor | None = None    # the decode worker's pool, opened here
    pool_id: str = ""
    deadline: float = 0.0               # perf_counter(): no copy launched after it
    error: str = ""                     # why it fails: no more copies, the I/O thread settles it
    # Recorded on the side stream right after its last copy: it completes when
    # this request's pages are there, not behind copies launched for later steps.
    copied: "torch.cuda.Event | None" = None
    commit: Commit | None = None        # set once finish() was called: the commit follows
    aborted: bool = False               # abort() was called: its end is reported to no one
    ids: "StepIds | None" = None


def run_of_layers(layer_view: torch.Tensor, index: int, first: int) -> torch.Tensor:
    """Layers first..index of the pool whose layer `index` is `layer_view`: the
    pool is one contiguous [layers, 2, blocks, ...] allocation, so neighbouring
    layers sit one layer's size apart in the same storage."""
    n = layer_view.numel()
    return layer_view.as_strided((index - first + 1, *layer_view.shape), (n, *layer_view.stride()),
                                 layer_view.storage_offset() - (index - first) * n)


@dataclass
class StepIds:
    """The blocks one engine step sends for a request, as the engine passed
    them (compared by identity) and as device index tensors."""

    src: list[int]
    indices: list[int]
    dst: list[int]
    src_t: torch.Tensor
    dst_t: torch.Tensor
    nbytes: int          # per layer
    counted: bool = False  # its blocks are in the request's progress


class _PoolDest(Dest):
    """A decode worker's data socket, and its pool as far as we know it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pool: torch.Tensor | None = None
        self.pool_id = ""
        self.opening = False
        self.opening_for = ""             # the request whose lease the pending ipc_open names
        self.waiting: list[str] = []      # requests to begin once the pool is open
        self.error = ""
        self.failed_at = 0.0


class CudaIpcSender(ControlSender):
    thread_name = "kv-ipc-sender"
    # A decode worker that died must not keep its GPU memory allocated through
    # our mapping of its pool: the monitor says when its connection drops.
    monitor_events = zmq.EVENT_DISCONNECTED
    dest_class = _PoolDest

    def __init__(self, layout: KVLayout, timeout_s: float = 30.0, device: torch.device | str | None = None,
                 layer_group: int = 0, copy_ctas: int | None = None, security=None):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc KV transfer backend needs a GPU")
        # When pages are copied. N >= 1: one launch per N layers, as the forward
        # writes them (layer-wise streaming; N = all layers: one launch at the
        # last layer). 0: one launch per step, at its end, after the step's
        # sampling was queued. Measured on H200 x2 (docs/benchmarks.md): copies
        # beside the forward slow its GEMMs by more than they take (an 8k
        # prompt's 1 GiB crosses NVLink in ~3 ms), and a copy still running when
        # the sampling kernels are queued delays the first token; since the
        # first token goes to the client ahead of the pages (FirstToken), the
        # transfer is best off after the sampling.
        self.layer_group = layer_group
        self._at_step_end: list[tuple[IpcWrite, StepIds, torch.Tensor]] = []
        # Programs per copy launch (None: one per page chunk, as many as the GPU
        # takes): fewer leave more of the GPU to the forward pass the copies overlap.
        self.copy_ctas = copy_ctas
        device = torch.device(device if device is not None else "cuda")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._side = torch.cuda.Stream(self.device)
        self._lock = threading.Lock()
        # Notified (under the lock) when a write leaves ASKING: the engine thread
        # waits for its ipc_begin's answer before its first copy.
        self._answered = threading.Condition(self._lock)
        self._writes: dict[str, IpcWrite] = {}
        self._failed = Tombstones()    # settled before finish(): later calls for them are silent
        super().__init__(layout, timeout_s, security)

    # -- engine side ---------------------------------------------------------

    def prepare(self, target: TransferTarget) -> None:
        """Start opening the pool and registering as a writer as soon as the
        request is known, so the first layer's copy does not wait for it."""
        self._write_for(target)

    def _write_for(self, target: TransferTarget) -> IpcWrite | None:
        rid = target.request_id
        with self._lock:
            if rid in self._failed:
                return None
            w = self._writes.get(rid)
            if w is None:
                w = self._writes[rid] = IpcWrite(target, Progress(rid))
                self._put(("begin", rid))
        return w

    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        self._check_open()
        if src_layer.device != self.device:
            raise ValueError(f"source pages are on {src_layer.device}, this sender copies from {self.device}")
        w = self._write_for(target)
        if w is None or w.error:
            return
        ids = w.ids
        if ids is None or ids.src is not src_block_ids or ids.indices is not block_indices:
            # A new step's blocks; every layer of the step passes the same lists,
            # so the checks and the device index tensors are made once per step.
            dst = dst_blocks_for(self.layout, target, src_layer, src_block_ids, block_indices)
            if not src_layer.is_contiguous():
                raise ValueError("source layer must be one contiguous layer of a [layers, 2, blocks, ...] pool")
            wait = min(self.timeout_s, _GRANT_WAIT_S)
            if not self._wait_answered(w, wait):
                self._fail_soon(w, f"no answer to ipc_begin from the decode worker in {wait:g}s")
                return
            ids = w.ids = StepIds(src_block_ids, block_indices, dst, index_tensor(src_block_ids, self.device),
                                   index_tensor(dst, self.device),
                                   2 * len(dst) * src_layer[0, 0].numel() * src_layer.element_size())
        if not ids.dst:
            return
        if self.layer_group == 0:
            if layer == self.layout.num_layers - 1:
                self._at_step_end.append((w, ids, run_of_layers(src_layer, layer, 0)))
            return
        first = layer - layer % self.layer_group
        if layer - first == self.layer_group - 1 or layer == self.layout.num_layers - 1:
            self._launch(w, ids, run_of_layers(src_layer, layer, first), first)
        # else: copied with the last layer of its group

    def _launch(self, w: IpcWrite, ids: StepIds, src_run: torch.Tensor, first: int) -> None:
        """Copy layers first.. (as many as `src_run` holds) of the step's blocks, after
        everything queued so far on the compute stream (those layers' writes, the ids)."""
        compute = torch.cuda.current_stream(self.device)
        with self._lock:
            if w.error or w.state is not WriteState.WRITING:
                if w.commit is not None and not w.error:   # its commit may be out: these pages would be missing
                    log.error("kv ipc sender: a copy for %s launched after it finished; not copied",
                              w.target.request_id)
                return
            if time.perf_counter() > w.deadline:
                self._fail_locked(w, "the KV lease would expire before the transfer completes")
                return
            self._side.wait_stream(compute)
            with torch.cuda.stream(self._side):
                copy_blocks_unchecked(src_run, w.pool[first:first + src_run.shape[0]], ids.src_t, ids.dst_t,
                                      self.copy_ctas)
            w.copied = torch.cuda.Event()
            w.copied.record(self._side)
            if not w.progress.bytes:
                w.progress.t_first = time.perf_counter()
            if not ids.counted:
                w.progress.blocks.update(ids.dst)
                ids.counted = True
            w.progress.bytes += ids.nbytes * src_run.shape[0]

    def warm_up(self, kv_cache: torch.Tensor) -> None:
        """The copy _launch makes, once: the null block onto itself in our own
        pool, over a run of layers as send_layer cuts them. A peer's pool differs
        from ours only in its number of blocks, which makes no new variant of
        the kernel (pdd.ops.triton_pages), nor does the number of pages."""
        run = min(self.layer_group or kv_cache.shape[0], kv_cache.shape[0])
        ids = index_tensor([0], self.device)
        copy_blocks_unchecked(run_of_layers(kv_cache[run - 1], run - 1, 0), kv_cache[:run], ids, ids, self.copy_ctas)
        torch.cuda.current_stream(self.device).synchronize()

    def step_done(self) -> None:
        pending, self._at_step_end = self._at_step_end, []
        for w, ids, src_run in pending:
            self._launch(w, ids, src_run, 0)
        # The next step may write into blocks whose copies are still queued.
        torch.cuda.current_stream(self.device).wait_stream(self._side)

    def finish(self, request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        with self._lock:
            if self._failed.discard(request_id):
                return
            known = request_id in self._writes
        if known:
            self._mail.put(("finish", request_id, blocks_skipped, handoff))
        else:  # nothing was ever sent
            self._emit(Progress(request_id).result(True, blocks_skipped=blocks_skipped))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._failed.discard(request_id)
            w = self._writes.get(request_id)
            if w is None:
                return
            w.aborted = True
            w.error = w.error or "aborted"
        self._mail.put(("abort", request_id))

    def _wait_answered(self, w: IpcWrite, timeout: float) -> bool:
        """Wait until `w`'s ipc_begin is answered (or it ended); False on timeout."""
        with self._answered:
            return self._answered.wait_for(lambda: w.state is not WriteState.ASKING, timeout)

    def _fail_locked(self, w: IpcWrite, error: str) -> None:
        if not w.error:
            w.error = error
            self._mail.put(("fail", w.target.request_id))

    def _fail_soon(self, w: IpcWrite, error: str) -> None:
        with self._lock:
            self._fail_locked(w, error)

    # -- I/O thread ----------------------------------------------------------

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        w = self._writes.get(cmd[1])
        if w is None:
            return
        if kind == "begin":
            self._begin(w)
        elif kind == "finish":
            w.commit = Commit(cmd[2], cmd[3])
            if w.error:
                self._settle(w, False, w.error)
            elif w.state is WriteState.WRITING:
                self._commit(w)
            # else: the commit follows the begin's answer
        elif kind in ("abort", "fail") and w.state is not WriteState.ASKING:
            self._settle(w, False, w.error)
        # (abort/fail before the begin was answered: _on_begin settles it)

    def _crashed(self, error: str) -> None:
        with self._lock:
            writes = list(self._writes.values())
        for w in writes:
            self._settle(w, False, error)

    def _on_monitor(self, key: DestKey, dest: _PoolDest, events: set[int]) -> bool:
        if zmq.EVENT_DISCONNECTED in events:
            self._peer_gone(key, dest)
        return True

    def _peer_gone(self, key: DestKey, dest: _PoolDest) -> None:
        """The decode worker's socket closed (it exited, or is restarting): fail
        what we write there and let go of its pool now. Each write keeps the
        mapping alive until its own copies completed (_settle waits for them)."""
        if dest.pool is None:
            return
        log.warning("kv ipc sender: lost the connection to %s; its KV pool is unmapped", dest.addr)
        dest.pool, dest.pool_id = None, ""
        for w in [w for w in self._writes.values() if self._dest_key(w.target) == key]:
            self._settle(w, False, "the decode worker disconnected (exited or restarting)")
            w.pool = None

    def _begin(self, w: IpcWrite) -> None:
        why = self._missing_key(w.target)
        if why:
            self._settle(w, False, why)
            return
        dest = self._dest(w.target)
        if dest.pool is not None:
            self._ask(dest, "ipc_begin", w.target.request_id, request_id=w.target.request_id,
                      lease_id=w.target.lease_id, pool_id=dest.pool_id)
            return
        if dest.error and time.perf_counter() - dest.failed_at < _REOPEN_AFTER_S:
            self._settle(w, False, dest.error)
            return
        dest.waiting.append(w.target.request_id)
        if not dest.opening:
            self._open(dest, w)

    def _open(self, dest: _PoolDest, w: IpcWrite) -> None:
        """Ask for the pool; the decode worker exports it only to the holder of a live lease (w's)."""
        dest.opening, dest.error, dest.opening_for = True, "", w.target.request_id
        self._ask(dest, "ipc_open", self._dest_key(w.target), layout=self.layout_dict,
                  request_id=w.target.request_id, lease_id=w.target.lease_id)

    def _commit(self, w: IpcWrite) -> None:
        self._stop_copies(w, WriteState.COMMITTING)   # the commit says the pages are there: only once they are
        dest = self._dests[self._dest_key(w.target)]
        handoff = w.commit.handoff
        self._ask(dest, "ipc_commit", w.target.request_id, request_id=w.target.request_id,
                  lease_id=w.target.lease_id, pool_id=w.pool_id,
                  handoff=handoff.to_dict() if handoff is not None else None)

    def _stop_copies(self, w: IpcWrite, state: WriteState) -> None:
        """Move `w` on to `state`, in which no copy starts, then block until
        every copy launched for it has completed."""
        with self._lock:
            w.state = state
            self._answered.notify_all()
            done = w.copied
        # Not an event recorded now: by the time the engine thread finishes a
        # request (it reads a step's tokens after launching the next step), the
        # side stream already holds the next step's copies, queued behind that
        # whole step's compute; waiting for them would hold every commit one
        # prefill step (first-to-second-token gaps up to ~1 s on 2xH200 at 12 req/s).
        if done is not None:
            done.synchronize()

    def _settle(self, w: IpcWrite, ok: bool, error: str = "") -> None:
        """End a request's transfer exactly once: copies completed, the decode
        worker told (end) if it counted us as a writer, the result reported."""
        rid = w.target.request_id
        writer = w.state in (WriteState.WRITING, WriteState.COMMITTING)
        self._stop_copies(w, WriteState.ENDED)   # an engine thread waiting for the begin's answer sees it end
        with self._lock:
            if self._writes.get(rid) is not w:
                return
            del self._writes[rid]
            if not ok and w.commit is None and not w.aborted:
                self._failed.add(rid)   # its later pages are dropped, finish() is silent
        if not ok and writer:
            dest = self._dests.get(self._dest_key(w.target))
            if dest is not None:
                self._tell(dest, "ipc_end", request_id=rid, lease_id=w.target.lease_id, pool_id=w.pool_id)
        if not w.aborted:
            if ok:
                w.progress.t_last = time.perf_counter()
            self._emit(w.progress.result(ok, error, w.commit.blocks_skipped if w.commit is not None else 0))

    # -- control messages --------------------------------------------------

    def _on_reply(self, kind: str, key, ok: bool, error: str, data: dict) -> None:
        if kind == "ipc_open":
            self._on_open(key, ok, error, data)
            return
        w = self._writes.get(key)
        if w is None:
            return
        if kind == "ipc_begin":
            self._on_begin(w, ok, error, data)
        elif kind == "ipc_commit":
            with self._lock:
                w.state = WriteState.ENDED   # the commit ended us as a writer, whatever its answer
            self._settle(w, ok, "" if ok else f"refused by the decode worker: {error}")

    def _on_open(self, key: DestKey, ok: bool, error: str, data: dict) -> None:
        dest = self._dests[key]
        dest.opening = False
        if not ok and data.get("lease_refused"):
            # That request's lease is gone (aborted, expired): it fails alone, and
            # the next waiting request asks under its own lease.
            asker = self._writes.get(dest.opening_for)
            dest.waiting = [rid for rid in dest.waiting if rid != dest.opening_for]
            if asker is not None:
                self._settle(asker, False, f"refused by the decode worker: {error}")
            following = next((self._writes[rid] for rid in dest.waiting if rid in self._writes), None)
            if following is not None:
                self._open(dest, following)
            return
        if ok:
            try:
                pool = open_pool(data["pool"], self.device)
                err = pool_mismatch(pool, self.layout, "the decode worker's pool")
                if err:
                    raise PoolOpenError(err)
                dest.pool, dest.pool_id = pool, data["pool_id"]
                log.info("opened the KV pool of %s through CUDA IPC", dest.addr)
            except (PoolOpenError, KeyError, TypeError) as e:
                ok, error = False, str(e)
        if not ok:
            dest.error, dest.failed_at = f"cannot open the decode worker's KV pool: {error}", time.perf_counter()
            log.warning("kv ipc sender: %s (%s)", dest.error, dest.addr)
        waiting, dest.waiting = dest.waiting, []
        for rid in waiting:
            w = self._writes.get(rid)
            if w is not None:
                self._begin(w)

    def _on_begin(self, w: IpcWrite, ok: bool, error: str, data: dict) -> None:
        dest = self._dests[self._dest_key(w.target)]
        if ok:
            with self._lock:
                w.pool, w.pool_id, w.state = dest.pool, dest.pool_id, WriteState.WRITING
                w.deadline = time.perf_counter() + float(data.get("seconds", 0.0)) - _DEADLINE_MARGIN_S
                self._answered.notify_all()
            if w.error:                 # aborted or failed while we asked
                self._settle(w, False, w.error)
            elif w.commit is not None:
                self._commit(w)
            return
        if error.startswith("stale pool"):  # the decode worker restarted: open it afresh next time
            dest.pool, dest.pool_id = None, ""
        self._settle(w, False, f"refused by the decode worker: {error}")

    def _unanswered(self, kind: str, key, why: str) -> None:
        if kind == "ipc_open":
            self._on_open(key, False, why, {})
            return
        w = self._writes.get(key)
        if w is not None:
            # A silent decode worker may be gone: let go of its pool (a dead
            # process's memory stays allocated while we map it); the next
            # request opens it afresh. A late begin may have registered us:
            # the decode worker then holds the blocks until deadline + grace.
            dest = self._dests.get(self._dest_key(w.target))
            if dest is not None:
                dest.pool, dest.pool_id = None, ""
            self._settle(w, False, why)

    def _expire(self, now: float) -> None:
        self._expire_asked(now)

    def _next_deadline(self) -> float | None:
        return self._asked_deadline()

    def cannot_reach(self, addr: str) -> bool:
        """The last attempt to open `addr`'s pool failed (read from any thread)."""
        return any(dest.addr == addr and dest.error for dest in list(self._dests.values()))
