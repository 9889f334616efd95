"""`pdd admin [--addr ADDR] [--token T | --config FILE] COMMAND [ARGS]` — talks to the router's admin socket."""
from __future__ import annotations

import json
import os
import sys

import msgpack
import zmq


class AdminError(RuntimeError):
    pass


def call(addr: str, token: str, cmd: str, *args, timeout_s: float = 5.0):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(msgpack.packb({"token": token, "cmd": cmd, "args": list(args)}, use_bin_type=True))
        if not sock.poll(int(timeout_s * 1000)):
            raise AdminError(f"no answer from {addr} within {timeout_s:.0f}s (is the router running?)")
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
    if not reply.get("ok"):
        raise AdminError(reply.get("error", "unknown error"))
    return reply.get("result")


def _format_workers(workers: list[dict]) -> str:
    cols = ["worker_id", "role", "device", "accepting", "inflight", "running", "waiting", "free_blocks",
            "num_blocks", "prefix_hit_rate", "last_seen_s_ago"]
    rows = [[str(w.get(c, "")) if not isinstance(w.get(c), float) else f"{w[c]:.3f}" for c in cols]
            for w in workers]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(cols, widths))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(args) -> int:
    addr, token = args.addr, args.token or os.environ.get("PDD_ADMIN_TOKEN", "")
    if args.config:
        from pdd.config import load_cluster_config
        cfg = load_cluster_config(args.config)
        addr = addr or cfg.router.admin_addr
        token = token or cfg.router.admin_token
    addr = addr or "tcp://127.0.0.1:7101"
    try:
        result = call(addr, token, args.admin_command, *args.args)
    except AdminError as e:
        print(f"pdd admin: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.admin_command == "status":
        print(f"model {result['model']}  ready={result['ready']}  accepting={result['accepting']}  "
              f"in flight={result['requests_in_flight']}  uptime={result['uptime_s']}s")
        print(_format_workers(result["workers"]))
    elif args.admin_command == "workers":
        print(_format_workers(result))
    else:
        print(json.dumps(result, indent=2))
    return 0
