"""The decode side of the data plane: the data socket, and the checks every
message passes before anything is written.

`DataSocket` is one thread with one bound ROUTER socket (data_addr), the only
way into a decode worker's KV pool from another process:

    [header, payload]  pages (tcp)         -> PageWriter.accept, answered by an ack
    [done]             a request's last message (tcp) -> PageWriter.complete, ack
    [control]          one-sided writers' bookkeeping (pdd.transfer.writers): cuda_ipc
                       (pdd.transfer.ipc.IpcControl), nixl (pdd.transfer.nixl_control,
                       when make_receiver hands it one), answered by a reply

`PageWriter` (shared with the local backend) checks a pages message in this
order: the header decodes, the sender's KV layout equals ours, the pages'
dtype/shape/size fit our pool, and finally, under the lease table's lock, the
lease allows exactly these blocks. Only then are the pages written. A done
message is accepted only if every pages message before it was written under
its still live lease; the lease table then reports the request as landed.

With `security` (pdd.security.data_security) the socket is a CURVE server that
lets in only authorized worker keys: a peer without one never gets a message
through, so it can neither write pages nor ask for the pool. Nothing a peer
sends can stop the thread.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

import torch
import zmq

from pdd import ops
from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, KVReceiver, ReceiverStats
from pdd.transfer.ipc import IpcControl
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import (WireError, bytes_to_tensor, decode_done, decode_header, dtype_name, encode_ack,
                               is_done, peek_ids)
from pdd.transfer.writers import OneSidedControl, answer_control

log = logging.getLogger(__name__)

_POLL_MS = 50  # how often the data socket looks at its stop flag: bounds close()'s wait


def pool_mismatch(pool: torch.Tensor, layout: KVLayout, what: str = "KV pool") -> str | None:
    """Why a pool ([layers, 2, blocks, block_size, kv_heads, head_dim], or one
    layer of it) does not match `layout`, or None."""
    want = [2, None, layout.block_size, layout.num_kv_heads, layout.head_dim]
    if pool.dim() == 6:
        want = [layout.num_layers] + want
    got = list(pool.shape)
    if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
        return f"{what} has shape {got}, layout wants {['*' if w is None else w for w in want]}"
    if dtype_name(pool.dtype) != layout.kv_cache_dtype:
        return f"{what} has dtype {dtype_name(pool.dtype)}, layout wants {layout.kv_cache_dtype}"
    return None


class PageWriter:
    """Checks pages messages against one local pool and writes them under their lease.

    `stats.messages`/`stats.bytes` count what was written; `stats.rejected`
    what was refused (with the last reasons in `stats.rejections`).
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable):
        err = pool_mismatch(kv_cache, layout)
        if err:
            raise ValueError(err)
        self.kv_cache = kv_cache
        self.layout = layout
        self._layout_dict = layout.to_dict()
        self.leases = leases
        self.stats = ReceiverStats()
        self._page_shape = list(kv_cache.shape[3:])  # block_size, kv_heads, head_dim

    def accept(self, raw_header: bytes | memoryview, payload: memoryview | bytes | torch.Tensor,
               ) -> tuple[dict | None, str | None]:
        """(header or None if it did not decode, error or None if written)."""
        try:
            header = decode_header(raw_header)
        except WireError as e:
            return None, self.reject(f"malformed header: {e}")
        err = self._check(header, payload)
        if err is None:
            err = self.write(header, payload)
        if err is not None:
            return header, self.reject(err)
        self.stats.messages += 1
        self.stats.bytes += _nbytes(payload)
        return header, None

    def complete(self, raw: bytes | memoryview) -> tuple[dict | None, str | None]:
        """A done message: (header or None if it did not decode, error or None if accepted)."""
        try:
            header = decode_done(raw)
        except WireError as e:
            return None, self.reject(f"malformed done message: {e}")
        err = self.leases.complete(header["lease_id"], header["request_id"], header["seq"],
                                   Handoff.from_dict(header["handoff"]))
        return header, None if err is None else self.reject(_LeaseRefusal(err))

    def warm_up(self) -> None:
        """One write as _write makes it (a fresh page tensor on the device, the
        ids sent there), of the null block's own pages back into it: the scatter
        kernel compiled before the first transfer (KVReceiver.warm_up)."""
        kv_layer = self.kv_cache[0]
        ids = torch.tensor([0], dtype=torch.long, device=kv_layer.device)
        self._scatter(kv_layer, ids, kv_layer[:, :1].clone())

    def _check(self, h: dict, payload) -> str | None:
        if h["layout"] != self._layout_dict:  # the common case costs one dict compare
            err = self._layout_error(h["layout"])
            if err:
                return err
        if h["layer"] >= self.kv_cache.shape[0]:
            return f"layer {h['layer']} out of range (pool has {self.kv_cache.shape[0]})"
        if h["dtype"] != dtype_name(self.kv_cache.dtype):
            return f"dtype mismatch: pages are {h['dtype']}, pool is {dtype_name(self.kv_cache.dtype)}"
        dst = h["dst_block_ids"]
        want = [2, len(dst)] + self._page_shape
        if h["shape"] != want:
            return f"shape mismatch: pages are {h['shape']}, expected {want}"
        return _check_blocks(dst, self.kv_cache.shape[2]) or self._check_payload(want, payload)

    def _layout_error(self, d: dict) -> str | None:
        try:
            theirs = KVLayout.from_dict(d)
        except (TypeError, ValueError) as e:
            return f"malformed header: bad layout: {e}"
        return theirs.mismatch(self.layout)

    def _check_payload(self, shape: list[int], payload) -> str | None:
        expected = self.kv_cache.element_size()
        for s in shape:
            expected *= s
        if isinstance(payload, torch.Tensor):
            if payload.dtype != self.kv_cache.dtype or list(payload.shape) != shape:
                return (f"payload tensor is {dtype_name(payload.dtype)} {list(payload.shape)}, "
                        f"header says {dtype_name(self.kv_cache.dtype)} {shape}")
        elif memoryview(payload).nbytes != expected:
            return f"payload is {memoryview(payload).nbytes} bytes, header implies {expected}"
        return None

    def write(self, h: dict, payload) -> str | None:
        """Pages that passed the checks, written under their lease; why not, or
        None. pdd.transfer.injected wraps it once a fault is set (transfer.reject)."""
        dst = h["dst_block_ids"]
        pages = payload if isinstance(payload, torch.Tensor) else \
            bytes_to_tensor(payload, self.kv_cache.dtype, h["shape"])
        kv_layer = self.kv_cache[h["layer"]]
        # Staged outside the lock: the host->device copy can be slow.
        pages = pages.to(kv_layer.device)
        ids = torch.tensor(dst, dtype=torch.long, device=kv_layer.device)
        with self.leases.writing(h["lease_id"], h["request_id"], dst) as err:
            if err is not None:
                return _LeaseRefusal(err)
            if dst:
                self._scatter(kv_layer, ids, pages)
        return None

    @staticmethod
    def _scatter(kv_layer: torch.Tensor, ids: torch.Tensor, pages: torch.Tensor) -> None:
        if not kv_layer.is_cuda:
            ops.scatter_blocks(kv_layer, ids, pages)
            return
        # On the pool's device, whatever this thread's current one: the kernel
        # launches there, and Triton keeps its compiled kernels per device (the
        # warm-up compiled this one on the pool's).
        with torch.cuda.device(kv_layer.device):
            ops.scatter_blocks(kv_layer, ids, pages)
            # The write must be done, not merely queued, before the lock is
            # released: a close() that returns hands the blocks to another
            # request, whose writes may run on another stream.
            torch.cuda.current_stream(kv_layer.device).synchronize()

    def reject(self, err: str) -> str:
        msg = self.stats.refused(str(err))
        # A revoked lease is routine (the request was aborted while pages were
        # in flight); anything else means two workers disagree.
        log.log(logging.DEBUG if isinstance(err, _LeaseRefusal) else logging.WARNING, "kv receive refused: %s", err)
        return msg


class _LeaseRefusal(str):
    """A refusal by the lease table (logged quietly)."""


def _check_blocks(dst: list[int], num_blocks: int) -> str | None:
    if len(set(dst)) != len(dst):
        return "duplicate destination block ids"
    for b in dst:
        if b >= num_blocks:
            return f"block {b} out of range (pool has {num_blocks})"
    return None


def _nbytes(payload) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return memoryview(payload).nbytes


# A one-sided family's decode side, made for this socket's pool, leases and stats.
ControlFactory = Callable[[torch.Tensor, KVLayout, LeaseTable, ReceiverStats], OneSidedControl]


class DataSocket(KVReceiver):
    """The data socket: a ROUTER bound at `addr` (port 0 picks a free port;
    `address` is the one to give senders). Serves tcp and cuda_ipc senders,
    and the senders of each family in `controls` (pdd.transfer.make_receiver
    hands it nixl's, pdd.transfer.nixl_control, where that is served)."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                 addr: str = "tcp://127.0.0.1:0", security=None, controls: Sequence[ControlFactory] = ()):
        self._bind_addr = addr
        self.security = security
        self.writer = PageWriter(kv_cache, layout, leases)
        self.stats = self.writer.stats
        self.ipc = IpcControl(kv_cache, layout, leases, self.stats)
        self._controls: dict[str, OneSidedControl] = {"ipc": self.ipc}
        for make in controls:
            control = make(kv_cache, layout, leases, self.stats)
            self._controls[control.family] = control
        self.nixl = self._controls.get("nixl")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kv-data-socket", daemon=True)
        self._thread.start()
        ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise ValueError(f"kv receiver cannot bind {self._bind_addr}: {self._start_error}")

    def warm_up(self) -> None:
        self.writer.warm_up()
        for control in self._controls.values():
            control.warm_up()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for control in self._controls.values():
            control.close()

    def _run(self, ready: threading.Event) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        served = False
        try:
            if self.security is not None:
                self.security.serve(sock)   # before bind: no plaintext peer may slip in
                served = True
            sock.bind(self._bind_addr)
            self.address = _public_endpoint(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except (zmq.ZMQError, RuntimeError) as e:
            self._start_error = e
        ready.set()
        try:
            while self._start_error is None and not self._stop.is_set():
                if sock.poll(self._wait_ms(), zmq.POLLIN):
                    self._drain(sock)
                for control in self._controls.values():
                    try:
                        due = control.due()
                    except Exception:  # one family's fault must not end the socket every sender uses
                        log.exception("kv receiver: %s control failed; its senders time out", control.family)
                        continue
                    for ident, frame in due:
                        self._reply(sock, ident, frame)
        finally:
            sock.close(linger=0)
            if served:
                self.security.release(sock)
            ctx.term()

    def _wait_ms(self) -> int:
        return min([_POLL_MS] + [w for c in self._controls.values() if (w := c.wait_ms()) is not None])

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(64):  # bounded, so a flood cannot starve the stop flag
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(sock, frames)
            except Exception:  # a bad message must never take the receiver down
                log.exception("kv receiver: error handling a message")

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        ident, body = frames[0], frames[1:]
        if len(body) == 1 and not is_done(body[0].buffer):
            reply = answer_control(body[0].buffer, self._controls, ident.bytes)
            if reply is not None:
                self._reply(sock, ident, reply)
            return
        try:
            header, err = self._accept(body)
        except Exception as e:  # e.g. a scatter failing: refuse, keep serving
            log.exception("kv receiver: write failed")
            header, err = None, self.writer.reject(f"receiver error: {type(e).__name__}: {e}")
        if header is not None:
            rid, seq = header["request_id"], header["seq"]
        else:
            rid, seq = peek_ids(body[0].buffer) if body else ("", -1)
        self._reply(sock, ident, encode_ack(rid, seq, err is None, err or ""))

    def _accept(self, body: list[zmq.Frame]) -> tuple[dict | None, str | None]:
        if len(body) == 2:
            return self.writer.accept(body[0].buffer, body[1].buffer)
        if len(body) == 1:
            return self.writer.complete(body[0].buffer)
        return None, self.writer.reject(f"malformed message: {len(body)} frames, expected 2 (pages) "
                                         "or 1 (done, control)")

    @staticmethod
    def _reply(sock: zmq.Socket, ident, frame: bytes) -> None:
        try:
            sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the sender is gone or not reading: it will time out
            log.debug("kv receiver: reply not sent: %s", e)


def _public_endpoint(endpoint: str) -> str:
    """LAST_ENDPOINT as a peer must dial it: a wildcard bind becomes this host's address."""
    for wildcard in ("0.0.0.0", "[::]"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(wildcard, _host_address(), 1)
    return endpoint


def _host_address() -> str:
    # The source address of a route to a public address (no packet is sent);
    # falls back to the hostname's address.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
