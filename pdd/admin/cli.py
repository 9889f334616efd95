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
sent to every router (pdd.admin.fanout); --addr speaks to one. The socket's
side of it all, one command asked and answered, is pdd.admin.client.
"""
from __future__ import annotations

import json
import os
import sys

import zmq

from pdd.admin import tables
from pdd.admin.client import EXIT_FAILED, EXIT_OK, AdminError, call, follow
from pdd.admin.commands import BY_NAME, DEFAULT_ADDR
from pdd.admin.fanout import ask_every_router
from pdd.argparsing import error_document
from pdd.config import ConfigError
from pdd.security import Curve, admin_client_security, read_secret_file


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
