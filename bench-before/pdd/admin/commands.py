"""The commands of `pdd admin`: each one's arguments, help and what it sends.

A command is one `Command`: its name (the admin socket's command,
pdd.admin.server), its help, a function adding its own arguments to its
sub-parser, and one turning them into the arguments the socket takes. Output
is pdd.admin.tables' (or --json); errors and exit codes are pdd.admin.client's.
A new command is one entry in COMMANDS (and, for a better view than the
generic table, a formatter in pdd.admin.tables).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from pdd.argparsing import Parser
from pdd.config import LOG_LEVELS

DEFAULT_ADDR = "tcp://127.0.0.1:7101"
DEFAULT_DRAIN_TIMEOUT_S = 300.0


def _none(p: argparse.ArgumentParser) -> None:
    pass


def _no_args(args: argparse.Namespace) -> list:
    return []


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] = _none
    wire: Callable[[argparse.Namespace], list] = _no_args
    # how long the client waits for the answer: a command that waits on the workers
    # is answered within the router's own deadline (pdd.router.router.RESET_TIMEOUT_S)
    timeout_s: float = 5.0


def _worker_arg(what: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("worker", metavar="WORKER", help=f"the worker to {what} (pdd admin workers lists them)")
    return add


def _drain_args(p: argparse.ArgumentParser) -> None:
    _worker_arg("drain")(p)
    p.add_argument("--wait", action="store_true",
                   help="then wait until the worker has no request in flight (exit 4 if --timeout passes first)")
    p.add_argument("--timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="with --wait: seconds to wait")


def _requests_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slow", action="store_true",
                   help="the slowest finished requests, with the time each spent in each phase, "
                        "instead of those in flight")
    p.add_argument("count", nargs="?", type=int, metavar="N",
                   help="with --slow: the N slowest (default: all kept, log.trace_slow_requests)")


def _requests_wire(args: argparse.Namespace) -> list:
    if args.count is not None and not args.slow:
        raise ValueError("requests N goes with --slow: pdd admin requests --slow N")
    return ["slow", *([args.count] if args.count is not None else [])] if args.slow else []


def log_level_type(value: str) -> str:
    """An argparse type: a log level's name, lower-cased."""
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def _log_level_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("level", nargs="?", type=log_level_type, metavar="LEVEL",
                   help=f"{', '.join(LOG_LEVELS)}; none: show the router's")
    p.add_argument("--worker", metavar="ID|all",
                   help="set it on this worker, or on the router and every worker (all) (default: the router)")


def _log_level_wire(args: argparse.Namespace) -> list:
    if args.worker is not None and args.level is None:
        raise ValueError("--worker goes with a LEVEL: pdd admin log-level LEVEL --worker ID|all")
    return [x for x in (args.level, args.worker) if x is not None]


def _breaker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("state", nargs="?", choices=["open", "close", "auto"],
                   help="force the named breakers open or closed, or give them back to the failure counts "
                        "(auto); none: list every breaker")
    p.add_argument("pair", nargs="*", metavar="PREFILL DECODE | all",
                   help="with a state: one prefill -> decode pair, or all (the path's breaker and every pair's)")


def _breaker_wire(args: argparse.Namespace) -> list:
    if args.pair and args.state is None:
        raise ValueError("name a state first: pdd admin breaker open|close|auto PREFILL DECODE | all")
    return [args.state, *args.pair] if args.state else []


def _faults_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["set", "clear"],
                   help="set or clear faults (router.allow_fault_injection must be on); none: what is set where")
    p.add_argument("rest", nargs="*", metavar="NAME=VALUE[,...] [WORKER] | [WORKER]",
                   help="set: the faults and optionally one worker (default: every worker); clear: optionally "
                        "one worker")


def _faults_wire(args: argparse.Namespace) -> list:
    if args.rest and args.action is None:
        raise ValueError("name an action first: pdd admin faults set NAME=VALUE[,...] [WORKER] | clear [WORKER]")
    return [args.action, *args.rest] if args.action else []


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["flush"], help="flush: drop every cached prefix block no request holds")
    p.add_argument("worker", nargs="?", metavar="WORKER", help="only this worker (default: every worker)")


def _request_id_arg(what: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("request_id", metavar="REQUEST_ID",
                       help=f"the request to {what}: its X-Request-Id, or the id the router gave it "
                            "(pdd admin requests lists those in flight)")
    return add


COMMANDS: list[Command] = [
    Command("status", "the cluster at a glance: readiness, workers, placement, departed workers"),
    Command("workers", "every registered worker's load, and each prefill -> decode pair's KV transfer backend"),
    Command("requests", "the requests in flight, or with --slow the slowest finished ones", _requests_args,
            _requests_wire),
    Command("trace", "one request's timeline: every phase, worker and re-placement", _request_id_arg("trace"),
            lambda a: [a.request_id]),
    Command("abort", "end a request in flight: its client gets an error saying the operator aborted it, its "
                     "workers free its KV blocks", _request_id_arg("abort"), lambda a: [a.request_id]),
    Command("drain", "give a worker no new requests (kept across a router restart, with router.state_dir); "
                     "those in flight finish", _drain_args, lambda a: [a.worker]),
    Command("undrain", "give a drained worker new requests again", _worker_arg("undrain"), lambda a: [a.worker]),
    Command("breaker", "list the circuit breakers, or force some open or closed until auto", _breaker_args,
            _breaker_wire),
    Command("faults", "what faults are injected where, or set or clear them (test and staging clusters)",
            _faults_args, _faults_wire),
    Command("log-level", "show the router's log level, or set it on the router, a worker or all", _log_level_args,
            _log_level_wire),
    Command("cache", "flush the prefix cache of every worker or of one (as POST /reset_prefix_cache); exit 1 "
                     "if a worker did not answer", _cache_args,
            lambda a: [a.action, *([a.worker] if a.worker else [])], timeout_s=20.0),
    Command("config", "the router's config, secrets masked"),
    Command("security", "refused handshakes and tokens on the router, by socket and reason"),
    Command("version", "the pdd version and build of this client, the router and every worker"),
]
BY_NAME = {c.name: c for c in COMMANDS}


def _add_json(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--json", action="store_true", default=default,
                   help="machine-readable output, errors included ({\"error\": {...}} on stdout, non-zero exit)")


def add_admin_parser(sub) -> argparse.ArgumentParser:
    """`pdd admin`, its connection options and one sub-parser per command."""
    p = sub.add_parser("admin", help="operate a running cluster through the router's admin socket",
                       description="Operate a running cluster through the router's admin socket. Exit codes: "
                                   "0 done; 1 refused or failed (the message says why); 2 bad usage; "
                                   "3 no answer from the router; 4 drain --wait timed out.")
    p.json_switch = True   # `pdd admin ... --json ...`: usage errors as JSON too
    p.add_argument("--addr", help=f"one router's admin socket (default: every router --config lists, else "
                                  f"{DEFAULT_ADDR})")
    p.add_argument("--router", type=int, default=0, metavar="I",
                   help="with --addr and keys: the router there is number I of several (it proves itself "
                        "with router-I.key)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-file", metavar="FILE",
                       help="file holding the admin token (default: $PDD_ADMIN_TOKEN, else --config's)")
    token.add_argument("--token", help="the admin token on the command line, where other users can read it (warned)")
    p.add_argument("--config", metavar="FILE", help="the cluster's TOML config: admin address, token and keys")
    p.add_argument("--keys", metavar="DIR", help="keys directory with admin.key_secret and router.key "
                                                 "(default: --config's security.keys_dir)")
    _add_json(p, False)
    commands = p.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    for c in COMMANDS:
        cp = commands.add_parser(c.name, help=c.help, description=c.help[0].upper() + c.help[1:] + ".")
        c.arguments(cp)
        _add_json(cp, argparse.SUPPRESS)   # after the command too; before it, the one above holds
    return p
