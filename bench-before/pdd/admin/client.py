"""`pdd admin [--addr ADDR] [--token-file FILE] [--keys DIR | --config FILE] [--json] COMMAND [ARGS]`:
talks to the router's admin socket (the commands: pdd.admin.commands).

Output: a table or a few lines for people (pdd.admin.tables), or with --json
the command's result as JSON on stdout. An error is one line on stderr, or
with --json `{"error": {"command", "kind", "message", "exit_code"}}` on
stdout; either way the exit code says what kind of error it is:

    0  done
    1  refused or failed: the router said no (unknown worker or request, bad
       arguments) or this side could not ask (no keys, an unreadable token file)
    2  bad usage (argparse's)
    3  no answer from the router, or its door refused ours (CURVE)
    4  drain --wait: the worker still had requests when --timeout passed

The token comes from --token-file, $PDD_ADMIN_TOKEN or the config: a --token
on the command line works too, but any user of the host can read it there.

With keys the socket runs CURVE: the client needs the admin key pair
(admin.key_secret) and the router's public key (router.key), from --keys DIR or
the config's security.keys_dir.

A config that lists several routers (router.admin_addrs) has every command
sent to every router (pdd.admin.fanout); --addr speaks to one.
"""
from __future__ import annotations

import json
import os
import sys
import time

import msgpack
import zmq

from pdd import build_info
from pdd.admin import tables
from pdd.admin.commands import BY_NAME, DEFAULT_ADDR
from pdd.argparsing import EXIT_USAGE, error_document
from pdd.config import ConfigError
from pdd.security import Curve, admin_client_security, read_secret_file

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


def _connections(args) -> list[tuple[str, str, str, Curve | None]]:
    """(router name, address, token, CURVE identity or None) of each router to
    ask, from the flags, the config and the environment: --addr's one, else
    every router the config lists."""
    token = _flag_token(args) or os.environ.get("PDD_ADMIN_TOKEN", "")
    keys_dir, insecure = args.keys or os.environ.get("PDD_SECURITY__KEYS_DIR", ""), False
    # What the operator gave, named in an error about the keys (the loader names the setting).
    keys_from = f"--keys {args.keys}" if args.keys else "PDD_SECURITY__KEYS_DIR" if keys_dir else None
    addrs = [args.addr] if args.addr else []
    if args.config:
        from pdd.config_loader import load_cluster_config
        cfg = load_cluster_config(args.config)
        addrs = addrs or [admin for _, admin in cfg.router.routers]
        token = token or cfg.router.admin_token
        keys_dir = keys_dir or cfg.security.keys_dir
        keys_from = keys_from or f"{args.config}: security.keys_dir"
        insecure = cfg.security.insecure
    addrs = addrs or [DEFAULT_ADDR]
    names = [f"router-{i}" for i in range(len(addrs))] if len(addrs) > 1 else ["router"]
    if keys_dir:
        try:
            # --addr: the router at it is number --router (router.key: router 0's pair, or the one they share).
            number = getattr(args, "router", 0)
            return [(name, addr, token, admin_client_security(keys_dir, number if args.addr else i))
                    for i, (name, addr) in enumerate(zip(names, addrs))]
        except ConfigError as e:
            raise AdminError(str(e).replace("security.keys_dir", keys_from, 1), "local") from None
    if insecure:
        return [(name, addr, token, None) for name, addr in zip(names, addrs)]
    raise AdminError("no keys: pass --keys DIR (holding admin.key_secret and router.key) or --config FILE "
                     "with security.keys_dir", "local")


def _flag_token(args) -> str:
    """The token of --token-file, or of --token (with a warning), or ""."""
    if getattr(args, "token", None):
        print("pdd admin: warning: --token puts the admin token on the command line, where every user of this "
              "host can read it (ps); use --token-file FILE or PDD_ADMIN_TOKEN", file=sys.stderr)
        return args.token
    if not getattr(args, "token_file", None):
        return ""
    try:
        tokens = read_secret_file(args.token_file, "--token-file")
    except ValueError as e:
        raise AdminError(str(e), "local") from None
    if len(tokens) > 1:
        raise AdminError(f"--token-file {args.token_file}: holds {len(tokens)} lines; want the one token", "local")
    return tokens[0]


def main(args) -> int:
    """Run one command; print its result or its error; the exit code (see the module's docstring)."""
    command = BY_NAME[args.admin_command]
    try:
        try:
            wire = command.wire(args)
        except ValueError as e:
            raise AdminError(str(e), "usage") from None
        targets = _connections(args)
        if len(targets) > 1:
            from pdd.admin.fanout import ask_every_router
            result = ask_every_router(args, command, wire, targets)
        else:
            _, addr, token, keys = targets[0]

            def ask(cmd: str, *cmd_args):
                return call(addr, token, cmd, *cmd_args, security=keys, timeout_s=BY_NAME[cmd].timeout_s)

            result = ask(command.name, *wire)
            result = follow(args, result, ask)
    except AdminError as e:
        if args.json:
            _out(json.dumps(error_document(e.kind, str(e), e.exit_code, args.admin_command, **e.detail), indent=2))
        else:
            print(f"pdd admin: {e}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError, zmq.ZMQError) as e:   # a config or key file that cannot be read, a bad --addr
        if args.json:
            _out(json.dumps(error_document("local", str(e), EXIT_FAILED, args.admin_command), indent=2))
        else:
            print(f"pdd admin: {e}", file=sys.stderr)
        return EXIT_FAILED
    _out(json.dumps(result, indent=2) if args.json else tables.render(command.name, result, args))
    routers = result["routers"] if len(targets) > 1 else None
    if routers is not None and any("error" in r for r in routers):
        return max(r["exit_code"] for r in routers if "error" in r)   # said per router above
    results = [r["result"] for r in routers] if routers is not None else [result]
    if command.name == "cache" and any(r["no_answer"] for r in results):
        return EXIT_FAILED   # a flush some worker did not confirm
    return EXIT_OK


def _out(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:   # `pdd admin workers | head`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit


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
