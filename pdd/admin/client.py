"""The router's admin socket from this side: one command asked and answered
(`call`), what a command does here after the answer (`follow`), and the
errors with the exit codes they mean (`AdminError`). `pdd admin` itself, its
flags and output, is pdd.admin.cli."""
from __future__ import annotations

import time

import msgpack
import zmq

from pdd import build_info
from pdd.argparsing import EXIT_USAGE
from pdd.security import Curve, admin_client_security

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_TIMEOUT = 0, 1, 3, 4
_EXIT_OF = {"refused": EXIT_FAILED, "local": EXIT_FAILED, "usage": EXIT_USAGE, "unreachable": EXIT_UNREACHABLE,
            "timeout": EXIT_TIMEOUT}


class AdminError(RuntimeError):
    """`kind`: refused (the router said no), local (this side could not ask),
    usage, unreachable (no answer), timeout (drain --wait); it sets the exit code."""

    def __init__(self, message: str, kind: str = "refused", detail: dict | None = None):
        super().__init__(message)
        self.kind, self.detail = kind, detail or {}

    @property
    def exit_code(self) -> int:
        return _EXIT_OF[self.kind]


def call(addr: str, token: str, cmd: str, *args, timeout_s: float = 5.0, security: Curve | None = None):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
    try:
        if security is not None:
            security.dial(sock)
        sock.connect(addr)
        try:
            sock.send(msgpack.packb({"token": token, "cmd": cmd, "args": list(args)}, use_bin_type=True),
                      flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a refused handshake leaves nowhere to queue it: the monitor below says so
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        events = dict(poller.poll(int(timeout_s * 1000)))
        if sock not in events and monitor in events:
            raise AdminError(f"{addr} refused the connection (CURVE handshake failed): the admin key is not "
                             "authorized there, the router key is wrong, or one side runs without keys",
                             "unreachable")
        if sock not in events:
            raise AdminError(f"no answer from {addr} within {timeout_s:.0f}s (is the router running?)", "unreachable")
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    if not reply.get("ok"):
        raise AdminError(reply.get("error", "unknown error"))
    return reply.get("result")


def call_with_config(cfg, cmd: str, *args, timeout_s: float = 5.0, router: int | None = None):
    """`call` with the address, token and keys a cluster config names: of router
    number `router` (default: the config's own, router.index)."""
    i = cfg.router.index if router is None else router
    keys = None if cfg.security.insecure else admin_client_security(cfg.security.keys_dir, i)
    return call(cfg.router.routers[i][1], cfg.router.admin_token, cmd, *args, timeout_s=timeout_s, security=keys)


def follow(args, result, ask):
    """What a command does on this side after the router answered."""
    if args.admin_command == "version":
        return {"client": build_info(), **result}
    if args.admin_command == "drain" and args.wait:
        return wait_idle(args.worker, args.timeout, lambda: ask("workers"), result)
    return result


def wait_idle(worker_id: str, timeout_s: float, workers, drained: dict, poll_s: float = 0.2) -> dict:
    """Until `worker_id` has no request in flight: none owned at the router, none
    running or waiting in its last heartbeat (or it is gone). AdminError
    (timeout) if that takes longer than `timeout_s`."""
    start = time.monotonic()
    while True:
        now = next((w for w in workers() if w["worker_id"] == worker_id), None)
        busy = 0 if now is None else max(now["inflight"], now["running"] + now["waiting"])
        if not busy:
            return {**drained, **(now or {}), "waited_s": round(time.monotonic() - start, 3)}
        if time.monotonic() - start >= timeout_s:
            raise AdminError(f"{worker_id} still has {busy} request(s) in flight after {timeout_s:g}s; it stays "
                             f"drained (pdd admin undrain {worker_id} takes it back)", "timeout",
                             {"worker": now})
        time.sleep(poll_s)
