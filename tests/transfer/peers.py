"""The other side of a transfer test, in its own process (CUDA IPC cannot open
a handle in the process that exported it; NIXL's two agents are two workers):

    Peer          a decode pool, its data socket's receiver and lease table
                  (serve_pool), driven over a multiprocessing pipe
    SenderPeer    a prefill pool and a sender (serve_sender), likewise

and what the one-sided backends' tests (nixl, cuda_ipc) do with a Peer: a
target under a fresh lease, a request's pages sent, one whole request sent
and compared.
"""
from __future__ import annotations

import json
import multiprocessing.connection as mp_connection
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer import make_receiver, make_sender
from pdd.transfer.base import TransferTarget
from pdd.transfer.leases import LeaseTable
from tests.transfer.conftest import make_pool


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def _send(conn, obj) -> None:
    """Plain pickle: a CPU tensor sent the multiprocessing way is moved into
    shared memory (away from where NIXL registered it, for the pool) and handed
    over by a resource sharer that only multiprocessing's own children can ask."""
    conn.send_bytes(pickle.dumps(obj))


def serve_pool(conn, layout: dict, device: str, seed: int, keys_dir: str | None = None, backend: str = "tcp",
               addr: str | None = None, writer_grace_s: float | None = None, landing_bytes: int = 0,
               blocks: int | None = None) -> None:
    """Sends (address, the data socket's public key or "") once it listens;
    `keys_dir`: the data socket runs CURVE with that cluster's keys.
    `writer_grace_s`: shortens pdd.transfer.leases.WRITER_GRACE_S (a test's
    silent writer need not hold blocks for the production grace).
    `landing_bytes`: nixl's landing region. `blocks`: of the pool (default BLOCKS)."""
    if writer_grace_s is not None:
        import pdd.transfer.leases
        pdd.transfer.leases.WRITER_GRACE_S = writer_grace_s
    layout = KVLayout.from_dict(layout)
    pool = (make_pool(layout, seed) if blocks is None else make_pool(layout, seed, blocks)).to(device)
    leases = LeaseTable()
    security = None
    if keys_dir is not None:
        from pdd.security import data_security
        from tests.security.conftest import secure_config
        security = data_security(secure_config(keys_dir))
    receiver = make_receiver(backend, pool, layout, leases, addr=addr, security=security,
                             nixl_landing_bytes=landing_bytes)
    receiver.start()
    _send(conn, (receiver.address, security.public_key if security else ""))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "grant":
                _send(conn, leases.grant(*args))
            elif cmd == "close":
                _send(conn, leases.close(*args))
            elif cmd == "released":
                _send(conn, [lease.lease_id for lease in leases.released()])
            elif cmd == "expired":   # what the decode worker does with leases past their deadline
                _send(conn, [(lid, leases.close(lid)) for lid, _ in leases.expired()])
            elif cmd == "pool":
                if pool.is_cuda:
                    torch.cuda.synchronize(device)
                _send(conn, pool.cpu())
            elif cmd == "stats":
                s = receiver.stats
                nixl = getattr(receiver, "nixl", None)
                _send(conn, {"messages": s.messages, "rejected": s.rejected, "last_error": s.last_error,
                           "held": leases.num_held, "leases": len(leases), "rss": rss_bytes(),
                           "tallies": len(nixl._tallies) if nixl is not None else 0,
                           "writers": nixl.num_writers if nixl is not None else receiver.ipc.num_writers,
                           "landing_ranges": nixl.ranges_held if nixl is not None else 0,
                           "landing_out": nixl.landing.held if nixl is not None and nixl.landing else 0,
                           "landed_requests": nixl.landed_requests if nixl is not None else 0})
            else:
                _send(conn, None)
                return
    finally:
        receiver.close()


def serve_sender(conn, layout: dict, seed: int, backend: str, timeout_s: float) -> None:
    """A prefill side: ("send", target fields, src blocks) prepares and sends
    every layer; ("finish", rid); ("result", rid) waits for it."""
    layout = KVLayout.from_dict(layout)
    src = make_pool(layout, seed)
    sender = make_sender(backend, layout, timeout_s=timeout_s)
    _send(conn, "ready")
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "send":
                target, src_blocks = TransferTarget(**args[0]), args[1]
                sender.prepare(target)
                for layer in range(src.shape[0]):
                    sender.send_layer(target, layer, src[layer], src_blocks, list(range(len(src_blocks))))
                _send(conn, None)
            elif cmd == "finish":
                sender.finish(args[0])
                _send(conn, None)
            elif cmd == "result":
                _send(conn, wait_result(sender, args[0]))
            else:
                _send(conn, None)
                return
    finally:
        sender.close()


class _Child:
    """`target(conn, *args, **kwargs)` in a child process, asked over a pipe.
    `prefix`: a command that runs the child elsewhere (`ip netns exec NS`: on
    another host of tests/e2e/netns.py); the pipe is then a Unix socket, which
    no network namespace hides. `env`: extra environment of the child."""

    def __init__(self, target, args: tuple, kwargs: dict | None = None, prefix: list[str] | None = None,
                 env: dict | None = None):
        with socket.socket(socket.AF_UNIX) as listener:
            path = os.path.join(tempfile.mkdtemp(prefix="pdd-peer-"), "sock")
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(120)
            argv = [sys.executable, "-m", "tests.transfer.peers", path, target.__name__,
                    json.dumps([list(args), kwargs or {}])]
            self.proc = subprocess.Popen((prefix or []) + argv, env={**os.environ, **(env or {})})
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                self.kill()
                raise AssertionError("peer did not start") from None
        self.conn = mp_connection.Connection(sock.detach())
        assert self.conn.poll(120), "peer did not start"
        self.hello = pickle.loads(self.conn.recv_bytes())

    def __call__(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(60), f"peer did not answer {cmd[0]}"
        return pickle.loads(self.conn.recv_bytes())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self("stop")
        self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class Peer(_Child):
    """serve_pool in a child process: peer("grant", rid, blocks, ttl_s), ..."""

    def __init__(self, layout: KVLayout, device: str = "cpu", backend: str = "tcp", addr: str | None = None,
                 writer_grace_s: float | None = None, seed: int = 2, landing_bytes: int = 0,
                 blocks: int | None = None, **child):
        self.layout, self.backend = layout, backend
        super().__init__(serve_pool, (layout.to_dict(), device, seed),
                         {"backend": backend, "addr": addr, "writer_grace_s": writer_grace_s,
                          "landing_bytes": landing_bytes, "blocks": blocks}, **child)
        self.address, self.key = self.hello


class SenderPeer(_Child):
    """serve_sender in a child process."""

    def __init__(self, layout: KVLayout, backend: str, seed: int = 1, timeout_s: float = 10.0, **child):
        super().__init__(serve_sender, (layout.to_dict(), seed, backend, timeout_s), **child)


def target(peer: Peer, rid: str, dst: list[int], ttl_s: float = 30.0) -> TransferTarget:
    """The peer's `dst` blocks under a lease granted for `rid` now, for the peer's backend."""
    return TransferTarget(rid, peer("grant", rid, dst, ttl_s), "d", peer.address, tuple(dst), backend=peer.backend)


def send(sender, target: TransferTarget, src: torch.Tensor, src_blocks: list[int], layers=None, indices=None) -> None:
    """One step's pages of src's src_blocks, every layer (or `layers`), as
    the target's blocks 0.. (or `indices`)."""
    for layer in range(src.shape[0]) if layers is None else layers:
        sender.send_layer(target, layer, src[layer], src_blocks,
                          list(range(len(src_blocks))) if indices is None else indices)
    sender.step_done()


def send_and_compare(peer: Peer, sender, src: torch.Tensor, rid: str, dst: list[int], src_blocks: list[int]):
    """One whole request of src's src_blocks into the peer's dst blocks: it
    succeeds, and the peer's pool changed in those blocks only, to the pages
    sent. Returns its result and target."""
    before = peer("pool")
    t = target(peer, rid, dst)
    sender.prepare(t)
    send(sender, t, src, src_blocks)
    sender.finish(rid)
    r = wait_result(sender, rid)
    assert r.ok, r.error
    expected = before.clone()
    expected[:, :, dst] = src[:, :, src_blocks].cpu()
    assert torch.equal(peer("pool"), expected)
    return r, t


_polled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # sender -> results not asked for yet


def wait_result(sender, rid: str, timeout: float = 60.0):
    """The sender's result for `rid` (a generous bound: only a broken transfer
    takes this long); others polled meanwhile are kept for their turn."""
    kept = _polled.setdefault(sender, [])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kept += sender.poll()
        for r in kept:
            if r.request_id == rid:
                kept.remove(r)
                return r
        time.sleep(0.005)
    raise AssertionError(f"no result for {rid}")


if __name__ == "__main__":   # a _Child: SOCKET FUNCTION [ARGS, KWARGS]
    _args, _kwargs = json.loads(sys.argv[3])
    globals()[sys.argv[2]](mp_connection.Client(sys.argv[1], family="AF_UNIX"), *_args, **_kwargs)
