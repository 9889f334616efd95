"""`pdd admin [--addr ADDR] [--token-file FILE] [--keys DIR | --config FILE] COMMAND [ARGS]`:
talks to the router's admin socket.

The token comes from --token-file, $PDD_ADMIN_TOKEN or the config: a --token
on the command line works too, but any user of the host can read it there.

With keys the socket runs CURVE: the client needs the admin key pair
(admin.key_secret) and the router's public key (router.key), from --keys DIR or
the config's security.keys_dir.
"""
from __future__ import annotations

import json
import os
import sys

import msgpack
import zmq

from pdd.security import Curve, admin_client_security, read_secret_file

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class AdminError(RuntimeError):
    pass


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
                             "authorized there, the router key is wrong, or one side runs without keys")
        if sock not in events:
            raise AdminError(f"no answer from {addr} within {timeout_s:.0f}s (is the router running?)")
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    if not reply.get("ok"):
        raise AdminError(reply.get("error", "unknown error"))
    return reply.get("result")


def call_with_config(cfg, cmd: str, *args, timeout_s: float = 5.0):
    """`call` with the address, token and keys a cluster config names."""
    keys = None if cfg.security.insecure else admin_client_security(cfg.security.keys_dir)
    return call(cfg.router.admin_addr, cfg.router.admin_token, cmd, *args, timeout_s=timeout_s, security=keys)


def _format_workers(workers: list[dict]) -> str:
    """The workers, then each prefill -> decode pair's KV transfer backend and why."""
    table = _table(workers, ["worker_id", "role", "device", "accepting", "inflight", "running", "waiting",
                             "free_blocks", "num_blocks", "prefix_hit_rate", "last_seen_s_ago"])
    pairs = [{"prefill": w["worker_id"], "decode": d, "backend": t["backend"] or "none", "why": t["reason"]}
             for w in workers for d, t in sorted(w.get("transfer_to", {}).items())]
    return table + ("\n\n" + _table(pairs, ["prefill", "decode", "backend", "why"]) if pairs else "")


def _table(rows: list[dict], cols: list[str]) -> str:
    cells = [[str(r.get(c, "")) if not isinstance(r.get(c), float) else f"{r[c]:.3f}" for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(cols, widths))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _format_placement(placement: dict) -> str:
    """The policy and its settings, its decisions so far, and what it reads of each worker."""
    settings = "  ".join(f"{k}={v}" for k, v in placement.get("settings", {}).items())
    decisions = "  ".join(f"{kind}/{reason}={n}" for kind, reasons in sorted(placement.get("decisions", {}).items())
                          for reason, n in sorted(reasons.items()))
    lines = [f"placement: policy={placement.get('policy')}" + (f"  {settings}" if settings else ""),
             f"decisions: {decisions or 'none yet'}"]
    if placement.get("prefill_leaning"):
        lines.append(f"leaning to prefill: {', '.join(placement['prefill_leaning'])}  "
                     f"demand={placement.get('prefill_demand_tokens_s')} prompt tokens/s")
    estimates = placement.get("estimates", {})
    cols = list(dict.fromkeys(k for e in estimates.values() for k in e))
    if cols:
        lines.append(_table([{"worker_id": wid, **e} for wid, e in sorted(estimates.items())], ["worker_id", *cols]))
    return "\n".join(lines)


SLOW_COLUMNS = ["request_id", "mode", "finish_reason", "duration_s", "ttft_s", "queued_s", "reserving_s",
                "prefilling_s", "decoding_s", "prefill_worker", "decode_worker", "fallbacks", "migrations"]


def _format_trace(t: dict) -> str:
    """One request's timeline: its figures, the time in each phase, then each event."""
    ttft = f"{t['ttft_s']:.3f}s" if t.get("ttft_s") is not None else "-"
    head = (f"request {t['request_id']}  mode={t['mode']}  finish={t['finish_reason'] or '-'}"
            f"{'  (in flight)' if t.get('in_flight') else ''}  started {t['started_at']}\n"
            f"prompt={t['prompt_tokens']} cached={t['cached_tokens']} output={t['output_tokens']}  "
            f"ttft={ttft}  total={t['duration_s']:.3f}s  migrations={t['migrations']}\n"
            "time in phase: " + "  ".join(f"{p}={t[p + '_s']:.3f}s"
                                          for p in ("queued", "reserving", "prefilling", "decoding")))
    events = [{**e, "t_s": f"+{e['t_s']:.3f}", "prefill": e["prefill"] or "-", "decode": e["decode"] or "-"}
              for e in t["events"]]
    return head + "\n" + _table(events, ["t_s", "event", "epoch", "prefill", "decode", "note"])


def _format_log_level(r: dict) -> str:
    parts = [f"router: {r['router']}"] if "router" in r else []
    if r.get("sent_to"):
        parts.append(f"{r['level']} sent to {', '.join(r['sent_to'])}")
    return "; ".join(parts) or "no worker to send it to"


def _connection(args) -> tuple[str, str, Curve | None]:
    """(address, token, CURVE identity or None) from the flags, the config and the environment."""
    addr, token = args.addr, _flag_token(args) or os.environ.get("PDD_ADMIN_TOKEN", "")
    keys_dir, insecure = args.keys or os.environ.get("PDD_SECURITY__KEYS_DIR", ""), False
    if args.config:
        from pdd.config import load_cluster_config
        cfg = load_cluster_config(args.config)
        addr = addr or cfg.router.admin_addr
        token = token or cfg.router.admin_token
        keys_dir = keys_dir or cfg.security.keys_dir
        insecure = cfg.security.insecure
    addr = addr or "tcp://127.0.0.1:7101"
    if keys_dir:
        return addr, token, admin_client_security(keys_dir)
    if insecure:
        return addr, token, None
    raise AdminError("no keys: pass --keys DIR (holding admin.key_secret and router.key) or --config FILE "
                     "with security.keys_dir")


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
        raise AdminError(str(e)) from None
    if len(tokens) > 1:
        raise AdminError(f"--token-file {args.token_file}: holds {len(tokens)} lines; want the one token")
    return tokens[0]


def _format_cache_flush(result: dict) -> str:
    reset = ", ".join(f"{wid} ({n} blocks)" for wid, n in sorted(result["reset"].items())) or "no worker"
    lines = [f"prefix cache flushed on {reset}"]
    if result["no_answer"]:
        lines.append(f"no answer within {result['timeout_s']:g}s from {', '.join(result['no_answer'])}")
    return "\n".join(lines)


def _wire_args(args) -> list:
    """The command's arguments as the admin socket takes them (its flags become arguments)."""
    out = list(args.args)
    if getattr(args, "slow", False):
        if args.admin_command != "requests":
            raise AdminError("--slow goes with requests: pdd admin requests --slow")
        out = ["slow", *out]
    if getattr(args, "worker", None) is not None:
        if args.admin_command != "log-level" or not out:
            raise AdminError("--worker goes with log-level LEVEL: pdd admin log-level LEVEL --worker ID|all")
        out.append(args.worker)
    return out


# Commands that wait on the workers: the router answers within its own deadline
# (pdd.router.router.RESET_TIMEOUT_S for a cache flush), the client waits a little longer.
COMMAND_TIMEOUT_S = {"cache": 20.0}


def main(args) -> int:
    try:
        addr, token, keys = _connection(args)
        result = call(addr, token, args.admin_command, *_wire_args(args), security=keys,
                      timeout_s=COMMAND_TIMEOUT_S.get(args.admin_command, 5.0))
    except AdminError as e:
        print(f"pdd admin: {e}", file=sys.stderr)
        return 1
    try:
        _print(args, result)
    except BrokenPipeError:   # `pdd admin workers | head`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
    if args.admin_command == "cache" and result["no_answer"]:
        return 1   # a flush that some worker did not confirm
    return 0


def _print(args, result) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.admin_command == "status":
        print(f"model {result['model']}  ready={result['ready']}  accepting={result['accepting']}  "
              f"in flight={result['requests_in_flight']}  uptime={result['uptime_s']}s")
        print(_format_workers(result["workers"]))
        if "placement" in result:
            print(_format_placement(result["placement"]))
        for d in result.get("departed", []):
            print(f"departed {d['worker_id']}: gone {d['gone_s']}s, forgotten in {d['forget_in_s']}s "
                  f"unless it registers again")
    elif args.admin_command == "workers":
        print(_format_workers(result))
    elif args.admin_command == "requests" and getattr(args, "slow", False):
        print(_table(result, SLOW_COLUMNS) if result else "no finished request kept yet")
    elif args.admin_command == "trace":
        print("\n\n".join(_format_trace(t) for t in result))
    elif args.admin_command == "log-level":
        print(_format_log_level(result))
    elif args.admin_command == "cache":
        print(_format_cache_flush(result))
    else:
        print(json.dumps(result, indent=2))
