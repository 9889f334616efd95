"""The `nixl` backend, prefill side: one-sided WRITEs into a decode worker's
KV pool through NIXL/UCX (RDMA between hosts; NVLink, shared memory or TCP
where that is what UCX finds). The decode side is pdd.transfer.nixl_control.

send_layer() gathers a layer's pages into registered staging memory on the
pool's device (pdd.transfer.nixl_agent.StagingArena), ordered after the
layer's writes: the engine may reuse its blocks once the step ends, whatever
the network does, and the pages of one write are contiguous at the source.
The gather stages pages in destination block order (in_destination_order).
The I/O thread (pdd.transfer.sender.ControlSender) posts the write once the
gather is done, naming one descriptor per k|v per run of consecutive
destination blocks (so one per k|v for blocks contiguous in the decode pool,
in whatever order the request holds them), and polls NIXL until it completed.

Around the writes, control messages on the decode worker's data socket, as
for cuda_ipc (pdd.transfer.writers):

    nixl_open    once per decode worker life: its agent metadata and where its
                 pool is, if our layouts agree; we load the metadata (a peer
                 seen under an earlier name is dropped: it restarted)
    nixl_begin   before a request's first write: the lease is live, the decode
                 worker holds its blocks until we end; answers how long we may
                 write, and which blocks (no write goes outside them); asks
                 for a range of its landing region, granted where it has room
    nixl_commit  after every write of the request completed (completion means
                 it landed: NIXL flushes before it reports it): names how many
                 writes there were; the decode worker accepts once each one's
                 notification came and passed its checks; carries the handoff
    nixl_end     after a failed or aborted request's writes stopped

Each write carries a notification (request, lease, pool incarnation, KV
layout digest, sequence number, blocks, landing range) that NIXL delivers to
the decode worker once the write landed.

With a landing range (pdd.transfer.nixl_landing) a piece's pages go to the
range's places of its blocks, which we choose: a block is given the next free
place when it is first written, and keeps it (the notification names each
block's place). A piece's new blocks thus take consecutive places: a layer
staged whole, or a prompt chunk's new blocks, are two descriptors, however
scattered its blocks are in the decode pool (a half-filled block a chunk
completes keeps its earlier place: a run or two more). The decode worker
copies them into the blocks at the commit. Without a range (none granted: no
room, none configured, an older decode worker) the pages go straight into
the blocks, one descriptor per k|v per run.

Results: a request succeeds when its commit is accepted. It fails when the
pool cannot be opened, the lease is refused or would expire, a write fails
(the decode worker went away: NIXL reports the disconnect), or nothing
progressed for `timeout_s` while something was owed (pdd.transfer.progress.
Progress: each completed write restarts the clock; a control message not
answered in `timeout_s` fails too). Writes still running when a request
fails are let finish before nixl_end; a stalled one is cancelled, and then no
end is sent: the decode worker keeps the blocks until the lease's deadline
plus WRITER_GRACE_S (pdd.transfer.leases), in case the cancelled write still
lands.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, TransferTarget
from pdd.transfer.dest import HANDSHAKE_FAILED, Dest, DestKey, handshake_refused
from pdd.transfer.nixl_agent import Agent, PoolRegion, StagingArena, device_id, mem_type, write_descs
from pdd.transfer.nixl_landing import landing_region
from pdd.transfer.progress import Progress, Tombstones
from pdd.transfer.sender import ControlSender, RequestTable
from pdd.transfer.staging import index_tensor
from pdd.transfer.wire import encode_write_notif, layout_digest

log = logging.getLogger(__name__)

_POLL_S = 0.001      # writes in flight are looked at this often: NIXL reports (and notifies) only when asked
_STAGING_MAX = 256 << 20   # staging memory, at most (the default is two layers of the pool, up to this)
_DEADLINE_MARGIN_S = 1.0   # no write is posted this close to the end of the lease the decode worker granted
_REOPEN_AFTER_S = 5.0      # a pool that failed to open is asked for again after this long
# Longest the engine thread waits for staging memory (the writes before it
# drain at network speed): the whole prefill worker waits with it, so past
# this the request fails over to a local prefill instead.
_STAGING_WAIT_S = 5.0


@dataclass
class _Piece:
    """Pages staged for one write: [2, n, page] at `offset` of the arena."""

    layer: int
    dst: list[int]
    offset: int
    nbytes: int
    ready: "torch.cuda.Event | None"
    t_enq: float


@dataclass
class _Write:
    piece: _Piece
    handle: object


@dataclass
class _Req:
    target: TransferTarget
    progress: Progress
    queue: deque[_Piece] = field(default_factory=deque)   # staged, not yet posted
    inflight: list[_Write] = field(default_factory=list)
    writes: int = 0            # posted so far: the next one's sequence number
    descriptors: int = 0
    pool_id: str = ""          # the decode worker's incarnation our begin named: we write only to it
    granted: bool = False      # the begin was answered: we may write
    begun: bool = False        # the decode worker counts us as a writer
    blocks: frozenset[int] = frozenset()
    landing: PoolRegion | None = None   # the range granted in the decode worker's landing region
    landing_offset: int = -1
    places: dict[int, int] = field(default_factory=dict)   # block -> its place in the landing range, as given
    write_until: float = 0.0   # perf_counter(): no write posted after it
    finished: bool = False
    blocks_skipped: int = 0
    handoff: Handoff | None = None
    committing: bool = False
    settled: bool = False
    aborted: bool = False
    cancelled: bool = False    # a write was cancelled mid-flight: it may still land, so no end


class _PeerDest(Dest):
    """A decode worker's data socket, and its NIXL agent and pool as far as we know them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.peer = ""                  # its agent's name, loaded in ours
        self.region: PoolRegion | None = None
        self.landing: dict | None = None   # its landing region (nixl_landing.LandingArena.region), if any
        self.pool_id = ""
        self.opening_for: _Req | None = None
        self.waiting: list[_Req] = []   # to begin once the pool is open
        self.error = ""
        self.failed_at = 0.0


def in_destination_order(dst: list[int], src: list[int]) -> tuple[list[int], list[int]]:
    """The (destination, source) block pairs sorted by destination block.

    A pool that served requests hands blocks out in no useful order (it frees a
    request's blocks tail-first and reuses the least recently freed first), so
    neighbours in the pool rarely come as consecutive ascending ids. Staged in
    destination order, blocks forming a range of the pool are one run however
    the request holds them: one descriptor per k and v. The gather copies every
    page anyway; its order costs nothing."""
    order = sorted(range(len(dst)), key=dst.__getitem__)
    return [dst[i] for i in order], [src[i] for i in order]


class NixlSender(RequestTable, ControlSender):
    backend = "nixl"
    thread_name = "kv-nixl-sender"
    dest_class = _PeerDest
    request_class = _Req

    def __init__(self, layout: KVLayout, timeout_s: float = 30.0, staging_bytes: int | None = None,
                 security=None):
        self.agent = Agent("prefill")
        self.staging_bytes = staging_bytes
        self.arena: StagingArena | None = None   # made, and registered, at the first page
        self._layout_id = layout_digest(layout.to_dict())
        self._reqs: dict[str, _Req] = {}
        self._draining: list[_Req] = []   # settled, with writes still running
        self._uncancelled: list[_Write] = []   # stalled writes NIXL could not cancel (yet)
        self._failed = Tombstones()
        # The decode worker's socket closing means it exited or restarts: its
        # writes fail now and its agent is dropped (a new one will answer the
        # open). A refused CURVE handshake fails its requests at once too.
        self.monitor_events = zmq.EVENT_DISCONNECTED | (HANDSHAKE_FAILED if security is not None else 0)
        super().__init__(layout, timeout_s, security)

    # -- engine side ---------------------------------------------------------

    def prepare(self, target: TransferTarget) -> None:
        """Open the pool and register as a writer while the prompt computes."""
        self._put(("prepare", target))

    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        dst = self._dst_blocks_over_tcp(target, src_layer, src_block_ids, block_indices)
        if not dst:
            return
        dst, src_block_ids = in_destination_order(dst, src_block_ids)
        arena = self._arena_for(src_layer)
        page = src_layer[0, 0].numel() * src_layer.element_size()
        per_piece = max(1, arena.nbytes // 2 // (2 * page))
        flat = src_layer.view(2, src_layer.shape[1], -1)
        for i in range(0, len(dst), per_piece):
            n = len(dst[i:i + per_piece])
            wait = min(self.timeout_s, _STAGING_WAIT_S)
            offset = arena.take(2 * n * page, wait)
            if offset is None:
                self._put(("fail", target, f"no staging memory came free in {wait:g}s (the writes before "
                                           "it did not complete)"))
                return
            out = arena.buf[offset:offset + 2 * n * page].view(src_layer.dtype).view(2, n, flat.shape[2])
            torch.index_select(flat, 1, index_tensor(src_block_ids[i:i + n], src_layer.device), out=out)
            ready = None
            if src_layer.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            self._put(("send", target, _Piece(layer, dst[i:i + n], offset, 2 * n * page, ready,
                                              time.perf_counter())))

    def _arena_for(self, src_layer: torch.Tensor) -> StagingArena:
        if self.arena is None:
            page = src_layer[0, 0].numel() * src_layer.element_size()
            nbytes = self.staging_bytes or min(_STAGING_MAX, 2 * src_layer.numel() * src_layer.element_size())
            if nbytes < 4 * page:
                raise ValueError(f"nixl staging of {nbytes} bytes holds less than two pages of {2 * page} bytes")
            arena = StagingArena(nbytes, src_layer.device)
            self.agent.register(arena.buf)
            self.arena = arena
        return self.arena

    def close(self) -> None:
        if self._mail.closed:
            return
        if self.arena is not None:
            self.arena.close()   # an engine thread waiting for staging gives up
        super().close()
        for w in [w for req in list(self._reqs.values()) + self._draining for w in req.inflight] + self._uncancelled:
            self.agent.release(w.handle)
        self._reqs, self._draining, self._uncancelled = {}, [], []
        self.agent.close()

    # -- I/O thread: commands ------------------------------------------------

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "prepare":
            self._request(cmd[1])
        elif kind == "send":
            self._enqueue(cmd[1], cmd[2])
        elif kind == "finish":
            self._on_finish(*cmd[1:])
        elif kind == "abort":
            self._failed.discard(cmd[1])
            req = self._reqs.get(cmd[1])
            if req is not None:
                req.aborted = True
                self._settle(req, False, "aborted")
        elif kind == "fail":
            req = self._request(cmd[1])
            if req is not None:
                self._settle(req, False, cmd[2])

    def _refuse(self, req: _Req, why: str) -> None:
        self._settle(req, False, why)

    def _enqueue(self, target: TransferTarget, piece: _Piece) -> None:
        req = self._request(target)
        if req is None:
            self.arena.give_back(piece.offset)
            return
        if not req.writes and not req.queue and not req.inflight:
            req.progress.t_first = piece.t_enq
        req.queue.append(piece)
        req.progress.owe(piece.t_enq)
        self._pump(req)

    def _after_finish(self, req: _Req, handoff: Handoff | None) -> None:
        req.handoff = handoff
        self._pump(req)

    # -- I/O thread: writes --------------------------------------------------

    def _pump(self, req: _Req) -> None:
        """Post what may go now; commit once everything was written."""
        if not req.granted or req.settled:
            return
        dest = self._dests[self._dest_key(req.target)]
        if dest.pool_id != req.pool_id:
            self._settle(req, False, "lost the decode worker's NIXL agent (it went away or restarted)")
            return
        # A block a write in flight (or one queued before) also writes waits
        # for it: two writes to the same place land in no fixed order.
        busy = {(w.piece.layer, b) for w in req.inflight for b in w.piece.dst}
        for piece in list(req.queue):
            cells = {(piece.layer, b) for b in piece.dst}
            if cells & busy or (piece.ready is not None and not piece.ready.query()):
                busy |= cells
                continue
            err = self._refusal(req, dest, piece)
            if err is None:
                err = self._post(req, dest, piece)
            if err is not None:
                self._settle(req, False, err)
                return
            req.queue.remove(piece)
        if req.finished and not req.queue and not req.inflight and not req.committing:
            req.committing = True
            self._ask(dest, "nixl_commit", req, request_id=req.target.request_id, lease_id=req.target.lease_id,
                      pool_id=req.pool_id, writes=req.writes,
                      handoff=req.handoff.to_dict() if req.handoff is not None else None)

    def _refusal(self, req: _Req, dest: _PeerDest, piece: _Piece) -> str | None:
        """Why `piece` must not be written, or None."""
        for b in piece.dst:
            if b not in req.blocks:
                return f"block {b} is not leased to this request"
            if b >= dest.region.num_blocks:
                return f"block {b} out of range (pool has {dest.region.num_blocks})"
        if time.perf_counter() > req.write_until:
            return "the KV lease would expire before the transfer completes"
        return None

    def _post(self, req: _Req, dest: _PeerDest, piece: _Piece) -> str | None:
        arena = self.arena
        n = len(piece.dst)
        region, dst = dest.region, piece.dst
        if req.landing is not None:
            # Every block written is leased (_refusal), so places stay inside the range.
            region, dst = req.landing, [req.places.setdefault(b, len(req.places)) for b in piece.dst]
        local, remote = write_descs(region, piece.nbytes // (2 * n), piece.layer,
                                    arena.buf.data_ptr() + piece.offset, n, dst, device_id(arena.buf))
        notif = encode_write_notif(request_id=req.target.request_id, lease_id=req.target.lease_id,
                                   pool_id=req.pool_id, layout_id=self._layout_id, seq=req.writes,
                                   layer=piece.layer, dst_block_ids=piece.dst, nbytes=piece.nbytes,
                                   landing=req.landing_offset, places=dst if req.landing is not None else ())
        try:
            handle = self.agent.write(local, mem_type(arena.buf), remote, region.mem, dest.peer, notif)
        except Exception as e:  # the peer went away, most often: NIXL says so
            self._drop_peer(dest)
            return f"nixl write to {dest.addr} failed: {type(e).__name__}: {e}"
        req.inflight.append(_Write(piece, handle))
        req.writes += 1
        req.descriptors += len(local)
        return None

    def _poll_writes(self) -> None:
        for req in list(self._reqs.values()):
            if req.inflight and self._reap(req) and not req.settled:
                self._pump(req)
            elif req.queue and req.granted:
                self._pump(req)   # a staged gather may have completed
        for req in list(self._draining):
            self._reap(req)
            if not req.inflight:
                self._draining.remove(req)
                self._end(req)
        for w in list(self._uncancelled):
            if self.agent.state(w.handle) != "PROC" and self.agent.release(w.handle):
                self._uncancelled.remove(w)
                self.arena.give_back(w.piece.offset)

    def _reap(self, req: _Req) -> bool:
        """Writes of `req` that ended: released, progress counted. True if any ended."""
        ended = False
        for w in list(req.inflight):
            state = self.agent.state(w.handle)
            if state == "PROC":
                continue
            ended = True
            req.inflight.remove(w)
            self.agent.release(w.handle)
            self.arena.give_back(w.piece.offset)
            if state != "DONE":
                if not req.settled:
                    dest = self._dests.get(self._dest_key(req.target))
                    if dest is not None:
                        self._drop_peer(dest)
                    why = state.removeprefix("ERR: ")
                    self._settle(req, False, f"nixl write to {req.target.dst_addr} failed: {why}")
                continue
            req.progress.delivered(w.piece.nbytes, w.piece.dst, time.perf_counter(),
                                   still_owed=bool(req.queue or req.inflight))
        return ended

    # -- I/O thread: ending a request ------------------------------------------

    def _settle(self, req: _Req, ok: bool, error: str = "") -> None:
        """End a request's transfer exactly once: its result reported (unless
        aborted), staged pages let go, the decode worker told once its writes stopped."""
        if req.settled:
            return
        req.settled = True
        rid = req.target.request_id
        if self._reqs.get(rid) is req:
            del self._reqs[rid]
        if not ok and not req.finished and not req.aborted:
            self._failed.add(rid)   # its later pages are dropped, finish() is silent
        for piece in req.queue:
            self.arena.give_back(piece.offset)
        req.queue.clear()
        if not req.aborted:
            result = req.progress.result(ok, error, req.blocks_skipped)
            result.descriptors = req.descriptors
            self._emit(result)
        if ok:
            return
        if req.inflight:
            self._draining.append(req)
        else:
            self._end(req)

    def _end(self, req: _Req) -> None:
        if req.begun and not req.cancelled:
            dest = self._dests.get(self._dest_key(req.target))
            if dest is not None:
                req.begun = False
                self._tell(dest, "nixl_end", request_id=req.target.request_id, lease_id=req.target.lease_id,
                           pool_id=req.pool_id)

    def _cancel(self, req: _Req) -> None:
        """Stop a stalled request's writes (they may still land: no end follows).
        One NIXL cannot cancel yet keeps its staging until it ends (_poll_writes)."""
        for w in req.inflight:
            req.cancelled = True
            if self.agent.release(w.handle):
                self.arena.give_back(w.piece.offset)
            else:
                self._uncancelled.append(w)
        req.inflight.clear()

    def _expire(self, now: float) -> None:
        # Called after every turn of the I/O loop: the writes are polled here too.
        self._poll_writes()
        for req in list(self._reqs.values()):
            due = req.progress.deadline(self.timeout_s)
            if due is not None and now >= due:
                self._cancel(req)
                self._settle(req, False, f"stalled: no progress for {self.timeout_s:g}s waiting for the decode "
                                         "worker (worker.transfer_timeout_s)")
        for req in list(self._draining):
            if req.progress.deadline(self.timeout_s) is not None and now >= req.progress.deadline(self.timeout_s):
                self._cancel(req)
                self._draining.remove(req)
        self._expire_asked(now)

    def _next_deadline(self) -> float | None:
        if any(r.inflight or (r.queue and r.granted) for r in self._reqs.values()) \
                or self._draining or self._uncancelled:
            return time.perf_counter() + _POLL_S
        due = [d for r in self._reqs.values() if (d := r.progress.deadline(self.timeout_s)) is not None]
        return min(due + [d for d in (self._asked_deadline(),) if d is not None], default=None)

    def _crashed(self, error: str) -> None:
        for req in list(self._reqs.values()):
            self._settle(req, False, error)

    # -- I/O thread: control messages ------------------------------------------

    def _begin(self, req: _Req) -> None:
        dest = self._dest(req.target)
        if dest.peer:
            req.pool_id = dest.pool_id
            self._ask(dest, "nixl_begin", req, request_id=req.target.request_id, lease_id=req.target.lease_id,
                      pool_id=dest.pool_id, landing=dest.landing is not None)
            return
        if dest.error and time.perf_counter() - dest.failed_at < _REOPEN_AFTER_S:
            self._settle(req, False, dest.error)
            return
        dest.waiting.append(req)
        if dest.opening_for is None:
            self._open(dest, req)

    def _open(self, dest: _PeerDest, req: _Req) -> None:
        """Ask for the pool; the decode worker hands it out only to the holder of a live lease (req's)."""
        dest.opening_for, dest.error = req, ""
        self._ask(dest, "nixl_open", self._dest_key(req.target), layout=self.layout_dict,
                  request_id=req.target.request_id, lease_id=req.target.lease_id)

    def _on_reply(self, kind: str, key, ok: bool, error: str, data: dict, timed_out: bool = False) -> None:
        if kind == "nixl_open":
            self._on_open(key, ok, error, data)
        elif kind == "nixl_begin":
            self._on_begin(key, ok, error, data, timed_out)
        elif kind == "nixl_commit":
            key.begun = False   # the commit ended us as a writer, whatever its answer
            self._settle(key, ok, error)

    def _unanswered(self, kind: str, key, why: str) -> None:
        self._on_reply(kind, key, False, why, {}, timed_out=True)

    def _on_open(self, key: DestKey, ok: bool, error: str, data: dict) -> None:
        dest = self._dests.get(key)
        if dest is None:
            return
        asker, dest.opening_for = dest.opening_for, None
        if not ok and data.get("lease_refused"):
            # That request's lease is gone (aborted, expired): it fails alone, and
            # the next waiting request asks under its own lease.
            dest.waiting = [r for r in dest.waiting if r is not asker and not r.settled]
            if asker is not None:
                self._settle(asker, False, error)
            if dest.waiting:
                self._open(dest, dest.waiting[0])
            return
        if ok:
            try:
                self._load_peer(dest, data)
            except Exception as e:  # a malformed answer, or NIXL's refusal of the metadata, whatever its type
                ok, error = False, f"{type(e).__name__}: {e}"
        if not ok:
            dest.error, dest.failed_at = f"cannot open the decode worker's KV pool: {error}", time.perf_counter()
            log.warning("kv nixl sender: %s (%s)", dest.error, dest.addr)
        waiting, dest.waiting = dest.waiting, []
        for req in waiting:
            if not req.settled:
                self._begin(req)

    def _load_peer(self, dest: _PeerDest, data: dict) -> None:
        region = PoolRegion(**data["pool"])
        want = self.layout.num_layers * 2 * region.num_blocks * self._page_bytes()
        if region.nbytes != want:
            raise ValueError(f"the decode worker's pool is {region.nbytes} bytes, its layout implies {want}")
        landing = data.get("landing")
        if landing is not None and not (isinstance(landing, dict)
                                        and {"addr", "nbytes", "device", "mem"} <= landing.keys()):
            raise ValueError(f"malformed landing region {landing!r:.80}")
        self._drop_peer(dest)
        dest.peer = self.agent.add_peer(data["metadata"])
        dest.region, dest.pool_id, dest.landing = region, data["pool_id"], landing
        log.info("kv nixl sender: loaded the NIXL agent %s of %s", dest.peer, dest.addr)

    def _page_bytes(self) -> int:
        lo = self.layout
        return lo.block_size * lo.num_kv_heads * lo.head_dim * getattr(torch, lo.kv_cache_dtype).itemsize

    def _drop_peer(self, dest: _PeerDest) -> None:
        """Forget the decode worker's agent (it restarted, or went away): the next request opens afresh."""
        if dest.peer:
            log.info("kv nixl sender: dropped the NIXL agent %s of %s", dest.peer, dest.addr)
            self.agent.remove_peer(dest.peer)
        dest.peer, dest.region, dest.pool_id, dest.landing = "", None, "", None

    def _on_begin(self, req: _Req, ok: bool, error: str, data: dict, timed_out: bool) -> None:
        if ok:
            req.begun = True
            if req.settled:   # aborted or failed while we asked
                self._end(req)
                return
            req.granted, req.blocks = True, frozenset(data.get("blocks", ()))
            req.write_until = time.perf_counter() + float(data.get("seconds", 0.0)) - _DEADLINE_MARGIN_S
            if data.get("landing") is not None:
                err = self._land_in(req, data["landing"])
                if err is not None:
                    self._settle(req, False, err)
                    return
            self._pump(req)
            return
        dest = self._dests.get(self._dest_key(req.target))
        if dest is not None and (timed_out or error.startswith("stale pool")):
            self._drop_peer(dest)   # restarted, or silent: open it afresh next time
        self._settle(req, False, error)

    def _land_in(self, req: _Req, granted) -> str | None:
        """Write `req`'s pages into the landing range its begin granted; why not, if it cannot be addressed."""
        dest = self._dests.get(self._dest_key(req.target))
        try:
            if dest is None or dest.landing is None:
                raise ValueError("a range granted by a decode worker that offered no landing region")
            blocks = len(req.blocks)
            want = self.layout.num_layers * 2 * blocks * self._page_bytes()
            if granted["nbytes"] != want:
                raise ValueError(f"a range of {granted['nbytes']} bytes for {blocks} blocks ({want} bytes)")
            req.landing = landing_region(dest.landing, granted["offset"], granted["nbytes"], blocks)
        except (KeyError, TypeError, ValueError) as e:
            return f"bad nixl_begin answer: {e}"
        req.landing_offset = granted["offset"]
        return None

    def _on_monitor(self, key: DestKey, dest: _PeerDest, events: set[int]) -> bool:
        if any(e & HANDSHAKE_FAILED for e in events):
            why = handshake_refused(dest.addr)
        elif zmq.EVENT_DISCONNECTED in events and dest.peer:
            log.warning("kv nixl sender: lost the connection to %s", dest.addr)
            why = "the decode worker disconnected (exited or restarting)"
        else:
            return True
        self._drop_peer(dest)
        for req in [r for r in self._reqs.values() if self._dest_key(r.target) == key]:
            self._settle(req, False, why)
        return True
