"""The base classes of the sender backends.

For all (local too), `SenderBase`: the result queue behind poll(). What else
they share has a module of its own: a layer's pages, checked and staged
(pdd.transfer.staging); each request's progress, and the requests that
failed before finish() (pdd.transfer.progress).

For the backends with sockets (tcp, cuda_ipc, nixl), `IoSender`: one I/O
thread owns every socket (zmq sockets are not thread-safe). The engine thread
hands it commands through a `Mailbox`; the thread keeps one `Dest` per decode
worker (pdd.transfer.dest: a DEALER dialing its data socket, with the frames
zmq could not take yet and a monitor of the connection), polls them with the
mailbox, sleeps until the backend's next deadline, and reports results. A
backend says what its commands, incoming frames, connection events and
deadlines mean. The one-sided backends (cuda_ipc, nixl) ask the decode
worker's data socket control messages (pdd.transfer.writers) through
`ControlSender`. The backends that keep a state per request on the I/O thread
(tcp, nixl) make it, and meet its finish, through `RequestTable`.
"""
from __future__ import annotations

import abc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, KVSender, TransferResult, TransferTarget
from pdd.transfer.dest import Dest, DestKey, Outgoing
from pdd.transfer.progress import Progress, Tombstones
from pdd.transfer.staging import dst_blocks_for
from pdd.transfer.wire import WireError, decode_reply, encode_control

log = logging.getLogger(__name__)

_MAX_WAIT_MS = 1000  # longest poll when nothing is due


class Mailbox:
    """Commands from the engine thread to a sender's I/O thread, plus a pipe
    the I/O thread polls next to its sockets so a command wakes it up."""

    def __init__(self) -> None:
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self.closed = False
        self._idle = False  # set by the I/O thread just before it polls

    @property
    def fd(self) -> int:
        return self._wake_r

    def put(self, cmd: tuple) -> bool:
        """Queue a command; False once a ("close",) was queued. The lock keeps a
        late put() from writing to the pipe as it is closed."""
        with self._lock:
            if self.closed:
                return False
            self.closed = cmd[0] == "close"
            self._cmds.put(cmd)
            # Wake the I/O thread only if it is (about to be) asleep: a busy one
            # drains the queue before it sleeps again. Fewer syscalls in the
            # engine thread, fewer GIL hand-offs to the I/O thread.
            if self._idle:
                self._idle = False
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # pipe full: a wake-up is pending anyway
                    pass
            return True

    def going_idle(self) -> bool:
        """Announce sleep, then look: True if commands wait (do not sleep). A
        command queued after the look finds the flag set and writes to the pipe."""
        self._idle = True
        return not self._cmds.empty()

    def woken(self, readable: bool) -> None:
        """After the poll; `readable`: the poll reported our fd."""
        self._idle = False
        if not readable:
            return
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._cmds.get_nowait())
            except queue.Empty:
                return out

    def close_fds(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


class SenderBase(KVSender):
    """The result queue: backends call _emit(), the engine calls poll()."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.layout_dict = layout.to_dict()  # sent with every message: build it once
        self._results: list[TransferResult] = []
        self._results_lock = threading.Lock()

    def poll(self) -> list[TransferResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    def _emit(self, result: TransferResult) -> None:
        with self._results_lock:
            self._results.append(result)
        self._wake()


class IoSender(SenderBase):
    """A sender whose I/O thread owns its sockets (see the module docstring).
    Subclasses set their state up before calling this __init__ (it starts the
    thread) and implement the hooks at the end of the class."""

    backend = "kv"               # the backend's name, in errors
    thread_name = "kv-sender"
    monitor_events = 0           # connection events a Dest's monitor reports to _on_monitor
    dest_class = Dest
    decode_answer: Callable[[bytes], dict]   # the backend's wire decoder for what destinations send back

    def __init__(self, layout: KVLayout, timeout_s: float, security=None):
        super().__init__(layout)
        self.timeout_s = timeout_s
        self.security = security   # pdd.security.Curve (data), None: plaintext
        self._mail = Mailbox()
        # I/O-thread state from here on.
        self._ctx = zmq.Context()
        self._dests: dict[DestKey, Dest] = {}
        self._poller = zmq.Poller()
        self._held_until: float | None = None   # the earliest time frames held back may go
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    # -- engine side ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._mail.closed or not self._thread.is_alive():
            raise RuntimeError("sender is closed" if self._mail.closed else "kv sender I/O thread died (see log)")

    def _put(self, cmd: tuple) -> None:
        if not self._mail.put(cmd):
            raise RuntimeError("sender is closed")

    def _dst_blocks_over_tcp(self, target: TransferTarget, src_layer: torch.Tensor,
                             src_block_ids: list[int], block_indices: list[int]) -> list[int]:
        """send_layer's checks for a backend that reaches its peer over tcp://:
        the sender is open, the address is one it can dial, and the blocks map."""
        self._check_open()
        if not target.dst_addr.startswith("tcp://"):
            raise ValueError(f"{self.backend} sender cannot reach {target.dst_addr!r}")
        return dst_blocks_for(self.layout, target, src_layer, src_block_ids, block_indices)

    def finish(self, request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        self._mail.put(("finish", request_id, blocks_skipped, handoff))

    def abort(self, request_id: str) -> None:
        self._mail.put(("abort", request_id))

    def close(self) -> None:
        if not self._mail.put(("close",)):
            return  # already closed
        self._thread.join()
        self._mail.close_fds()

    # -- I/O thread ----------------------------------------------------------

    def _run(self) -> None:
        self._poller.register(self._mail.fd, zmq.POLLIN)
        try:
            while True:
                timeout = 0 if self._mail.going_idle() else self._wait_ms()
                events = dict(self._poller.poll(timeout))
                self._mail.woken(self._mail.fd in events)
                cmds = self._mail.take()
                for cmd in cmds:
                    if cmd[0] == "close":
                        return
                    self._command(cmd)
                held = []
                for key, dest in list(self._dests.items()):
                    if events.get(dest.sock, 0) & zmq.POLLIN:
                        self._recv(dest)
                    if dest.monitor is not None and events.get(dest.monitor, 0) & zmq.POLLIN \
                            and not self._on_monitor(key, dest, dest.events()):
                        continue   # the backend closed it
                    until = dest.flush(self._poller)
                    if until is not None:
                        held.append(until)
                self._held_until = min(held, default=None)
                self._expire(time.perf_counter())
        except Exception:  # never expected; make it loud, fail what is in flight
            log.exception("%s I/O thread crashed", self.thread_name)
            self._crashed("kv sender I/O thread crashed")
        finally:
            for dest in self._dests.values():
                dest.close()
            self._ctx.term()

    def _wait_ms(self) -> int:
        due = min((t for t in (self._next_deadline(), self._held_until) if t is not None), default=None)
        if due is None:
            return _MAX_WAIT_MS
        return max(1, min(_MAX_WAIT_MS, int((due - time.perf_counter()) * 1000) + 1))

    def _recv(self, dest: Dest) -> None:
        while True:
            try:
                frames = dest.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                answer = self.decode_answer(frames[-1])
            except WireError as e:
                log.warning("%s: dropped a malformed answer: %s", type(self).__name__, e)
                continue
            self._on_answer(dest, answer)

    def _dest_key(self, target: TransferTarget) -> DestKey:
        return target.dst_addr, target.dst_public_key if self.security is not None else ""

    def _dest(self, target: TransferTarget) -> Dest:
        """The destination of `target`, dialed on first use."""
        key = self._dest_key(target)
        dest = self._dests.get(key)
        if dest is None:
            dest = self._dests[key] = self.dest_class(self._ctx, key[0], self.security, key[1],
                                                      self.monitor_events)
            self._poller.register(dest.sock, zmq.POLLIN)
            if dest.monitor is not None:
                self._poller.register(dest.monitor, zmq.POLLIN)
        return dest

    def _missing_key(self, target: TransferTarget) -> str | None:
        """Why `target` cannot be dialed securely, or None."""
        if self.security is not None and not target.dst_public_key:
            return "the decode worker registered no data-socket key (it runs without keys?)"
        return None

    def _close_dest(self, key: DestKey) -> None:
        dest = self._dests.pop(key)
        self._poller.unregister(dest.sock)
        if dest.monitor is not None:
            self._poller.unregister(dest.monitor)
        dest.close()

    # -- what a backend says -------------------------------------------------

    @abc.abstractmethod
    def _command(self, cmd: tuple) -> None:
        """Apply one engine call (in the order they were made)."""

    @abc.abstractmethod
    def _on_answer(self, dest: Dest, answer: dict) -> None:
        """One message from `dest` (an ack, a reply), decoded by `decode_answer`."""

    def _on_monitor(self, key: DestKey, dest: Dest, events: set[int]) -> bool:
        """Connection events of `dest`; False if the backend closed it."""
        return True

    @abc.abstractmethod
    def _next_deadline(self) -> float | None:
        """The next time (perf_counter) _expire has something to do, or None."""

    @abc.abstractmethod
    def _expire(self, now: float) -> None:
        """Fail what waited past its deadline."""

    @abc.abstractmethod
    def _crashed(self, error: str) -> None:
        """The I/O thread is going down: fail everything in flight with `error`."""


class ControlSender(IoSender):
    """An IoSender whose answers are control replies (pdd.transfer.writers): it
    asks a destination something under a fresh token, and each ask gets its
    reply (_on_reply) or, `timeout_s` later, a failure (_unanswered)."""

    decode_answer = staticmethod(decode_reply)

    def __init__(self, layout: KVLayout, timeout_s: float, security=None):
        self._token = 0
        self._asked: dict[int, tuple[str, object, float]] = {}   # token -> (kind, what it is about, deadline)
        super().__init__(layout, timeout_s, security)

    def _next_token(self) -> int:
        self._token += 1
        return self._token

    def _ask(self, dest: Dest, kind: str, key: object, **fields) -> None:
        """Send control message `kind`; its reply goes to _on_reply(kind, key, ...)."""
        token = self._next_token()
        self._asked[token] = (kind, key, time.perf_counter() + self.timeout_s)
        self._send(dest, fields.get("request_id", ""), encode_control(kind, token, **fields))

    def _tell(self, dest: Dest, kind: str, **fields) -> None:
        """Send control message `kind`, its reply unheeded."""
        self._send(dest, fields.get("request_id", ""), encode_control(kind, self._next_token(), **fields))

    def _send(self, dest: Dest, request_id: str, frame: bytes) -> None:
        dest.pending.append(Outgoing(request_id, [frame]))
        dest.flush(self._poller)

    def _on_answer(self, dest: Dest, reply: dict) -> None:
        asked = self._asked.pop(reply["token"], None)
        if asked is not None:
            self._on_reply(asked[0], asked[1], reply["ok"], reply["error"], reply["data"])

    def _expire_asked(self, now: float) -> None:
        for token, (kind, key, deadline) in list(self._asked.items()):
            if now >= deadline:
                del self._asked[token]
                self._unanswered(kind, key, f"no answer to {kind} from the decode worker in {self.timeout_s:g}s")

    def _asked_deadline(self) -> float | None:
        return min((d for _, _, d in self._asked.values()), default=None)

    @abc.abstractmethod
    def _on_reply(self, kind: str, key, ok: bool, error: str, data: dict) -> None:
        """The reply to the control message `kind` asked about `key`."""

    @abc.abstractmethod
    def _unanswered(self, kind: str, key, why: str) -> None:
        """The control message `kind` asked about `key` got no reply in time."""


class RequestTable(abc.ABC):
    """Mixed into an IoSender that keeps one state per request on its I/O
    thread (tcp, nixl): the states by request id, the requests that failed
    before finish(), and how a request's first command and its finish are
    met. The backend sets `_reqs` and `_failed` up in its __init__, names its
    state's class, and says how a request fails and what it does first and
    once finished.

    A state has at least `target`, `progress`, `finished` and `blocks_skipped`;
    failing a request takes it out of `_reqs`."""

    request_class: type          # made as request_class(target=..., progress=...)
    _reqs: dict[str, Any]
    _failed: Tombstones

    def _request(self, target: TransferTarget):
        """The request's state, made (and begun) on its first command; None once it failed."""
        rid = target.request_id
        if rid in self._failed:
            return None
        req = self._reqs.get(rid)
        if req is None:
            req = self._reqs[rid] = self.request_class(target=target, progress=Progress(rid))
            why = self._missing_key(target)
            if why:
                self._refuse(req, why)
                return None
            self._begin(req)
        return req if self._reqs.get(rid) is req else None   # _begin may have failed it

    def _on_finish(self, rid: str, blocks_skipped: int, handoff: Handoff | None) -> None:
        if self._failed.discard(rid):
            return  # its failure was already reported
        req = self._reqs.get(rid)
        if req is None:  # never prepared, no page: there is no receiver to tell
            self._emit(Progress(rid).result(True, blocks_skipped=blocks_skipped))
            return
        req.finished, req.blocks_skipped = True, blocks_skipped
        self._after_finish(req, handoff)

    def _begin(self, req) -> None:
        """A new request's first step (it may fail the request)."""

    @abc.abstractmethod
    def _refuse(self, req, why: str) -> None:
        """Fail a request that cannot start: `why`."""

    @abc.abstractmethod
    def _after_finish(self, req, handoff: Handoff | None) -> None:
        """finish() reached a live request: what ends its transfer."""
