"""The router's admin socket: a ZeroMQ ROUTER bound to localhost by default.

Request:  msgpack {"token": str, "cmd": str, "args": [scalars]}
Reply:    msgpack {"ok": true, "result": ...} | {"ok": false, "error": str}

Two locks on the door: with keys, the socket runs CURVE and lets in only the
authorized admin keys (pdd.security); every request must then carry the admin
token, which the router refuses to start without (placeholders included).
Whatever arrives — garbage, a wrong type anywhere, an oversize message, a
command that raises — gets an error reply and the loop serves on; the token
and other secrets are never logged nor echoed.

Every command leaves an audit line on logger `pdd.audit` (pdd.logs): the
command, its arguments, who sent it (the admin key's name under CURVE, and the
peer's address) and how it ended — at INFO for a command that changes
something (drain, undrain, abort, breaker/faults/log-level with arguments), at
DEBUG for one that only reads (monitors poll `status`). A command that waits on
the workers (cache flush) is answered, and audited, when it is done, while the
socket serves on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import logging

import time

import msgpack
import zmq
import zmq.asyncio

from pdd import logs, security
from pdd.config import SECRET_FIELDS
from pdd.protocol import messages as m
from pdd.router.traces import Timeline, matches
from pdd.security import Curve, HandshakeWatch

log = logging.getLogger(__name__)
audit = logging.getLogger(logs.AUDIT_LOGGER)

MAX_REQUEST_BYTES = 64 * 1024   # larger requests get an error reply
_HARD_LIMIT_BYTES = 1 << 20     # larger ones are not even read: zmq drops the connection
MAX_ARGS = 16
# Commands that only read; the others, and these with arguments where they take
# some (breaker open ..., faults set ..., log-level LEVEL), change something.
READS = frozenset({"status", "workers", "requests", "config", "security", "trace", "version"})
READS_WITHOUT_ARGS = frozenset({"breaker", "faults", "log-level"})


def _error(message: str) -> dict:
    return {"ok": False, "error": message}


class AdminServer:
    def __init__(self, router, addr: str, token: str, security: Curve | None = None):
        self.router = router
        self.addr = addr
        self.token = token.encode("utf-8")
        self.security = security
        self.commands = {
            "status": self._status,
            "workers": router.worker_summaries,
            # requests: in flight; requests slow [N]: the slowest finished, with their phase durations
            "requests": self._requests,
            "trace": self._trace,
            # log-level: the router's; log-level LEVEL [WORKER | all]: set it on the router, one worker, or all
            "log-level": self._log_level,
            # drain/undrain WORKER: no new work for it (kept across a router restart), or again
            "drain": lambda *worker: router.operations.set_draining(_one_worker("drain", worker), True),
            "undrain": lambda *worker: router.operations.set_draining(_one_worker("undrain", worker), False),
            # abort REQUEST_ID: end a request in flight with an error that says so
            "abort": lambda *rid: router.operations.abort_request(_one_request(rid)),
            "version": lambda: router.versions(),
            "config": self._config,
            "security": security_report,
            # breaker: every pair; breaker open|close|auto [PREFILL DECODE | all]: force until auto
            "breaker": lambda *args: router.operations.set_breaker(*args) if args else router.breakers(),
            # faults: what is set where; faults set NAME=VALUE[,...] [WORKER] | clear [WORKER]:
            # only with router.allow_fault_injection
            "faults": lambda *args: router.operations.faults(*args),
            # cache flush [WORKER]: what POST /reset_prefix_cache does, on every worker or one
            "cache": self._cache,
        }
        self._task: asyncio.Task | None = None
        self._answering: set[asyncio.Task] = set()   # replies to commands that wait
        self.sock: zmq.asyncio.Socket | None = None
        self._watch: HandshakeWatch | None = None

    def _status(self) -> dict:
        return self.router.status()

    def _config(self) -> dict:
        return masked_config(self.router.cfg)

    def _requests(self, *args) -> list[dict]:
        if not args:
            return [s.summary() for s in self.router.requests.values()]
        if args[0] != "slow" or len(args) > 2:
            raise ValueError("expected requests, or requests slow [N] (pdd admin requests --slow)")
        n = int(args[1]) if len(args) > 1 else None
        now = time.monotonic()
        return [t.summary(now) for t in self.router.control.traces.slowest(n)]

    def _trace(self, request_id: str) -> list[dict]:
        """The timeline of the request(s) with this id: in flight, or finished and still kept."""
        now, control = time.monotonic(), self.router.control
        live = [Timeline.of(s, now, ended=False) for rid, s in self.router.requests.items() if matches(rid, request_id)]
        found = control.traces.find(request_id) + sorted(live, key=lambda t: t.arrival)
        if not found:
            raise KeyError(f"no request {request_id!r} in flight, nor among the last "
                           f"{control.traces.recent.maxlen} finished or the {control.traces.num_slowest} slowest kept "
                           "(log.trace_recent_requests, log.trace_slow_requests)")
        return [t.to_dict(now) for t in found]

    def _log_level(self, level: str | None = None, worker: str | None = None) -> dict:
        """No level: the router's. Else the router's (no WORKER), one worker's, or
        the router's and every worker's (all), sent over the control bus."""
        if level is None:
            return {"router": logs.current_level()}
        logs.level_number(level)   # a ValueError naming the levels
        workers = self.router.registry.workers
        if worker is not None and worker != "all" and worker not in workers:
            raise KeyError(f"no worker {worker!r}; known: {sorted(workers)}")
        targets = sorted(workers) if worker == "all" else [worker] if worker is not None else []
        for wid in targets:
            self.router.control.send(wid, m.SetLogLevel(level.lower()))
        out = {"level": level.lower(), "sent_to": targets}
        if worker in (None, "all"):
            out["router"] = logs.set_level(level)
        return out

    def _cache(self, action: str | None = None, *worker: str):
        if action != "flush" or len(worker) > 1:
            raise ValueError("expected: pdd admin cache flush [WORKER]")
        return self.router.reset_prefix_cache(*worker)

    def register(self, name: str, fn) -> None:
        self.commands[name] = fn

    async def start(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_BYTES)
        if self.security is not None:
            self.security.serve(self.sock)
            self._watch = HandshakeWatch.for_socket(self.sock, self.security.domain, client=False)
        self.sock.bind(self.addr)
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("admin socket on %s (%s)", self.addr, "CURVE" if self.security else "plaintext")
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._answering) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.sock is not None and not self.sock.closed:
            if self._watch is not None:
                self._watch.close()
            self.sock.close(0)
            if self.security is not None:
                self.security.release(self.sock)

    async def _loop(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
                if len(frames) < 2:
                    continue
                route = [f.bytes for f in frames[:-1]]
                reply = self.handle(frames[-1].bytes, _sender(frames[-1]))
                if inspect.isawaitable(reply):
                    task = asyncio.create_task(self._answer_later(route, reply))
                    self._answering.add(task)
                    task.add_done_callback(self._answering.discard)
                    continue
                await self.sock.send_multipart(route + [self._encode(reply)])
            except asyncio.CancelledError:
                raise
            except Exception:  # nothing a peer sends may stop the admin socket
                log.exception("admin: error serving a request")

    async def _answer_later(self, route: list[bytes], reply) -> None:
        try:
            await self.sock.send_multipart(route + [self._encode(await reply)])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("admin: error answering a request")

    @staticmethod
    def _encode(reply: dict) -> bytes:
        try:
            return msgpack.packb(reply, use_bin_type=True)
        except Exception as e:  # a command returned something msgpack cannot carry
            log.exception("admin: reply cannot be encoded")
            return msgpack.packb(_error(f"the result cannot be encoded ({type(e).__name__})"), use_bin_type=True)

    def handle(self, payload: bytes, sender: dict | None = None):
        """One request in, one reply out — or an awaitable of it, for a command
        that waits; never raises. `sender`: who sent it, for the audit line."""
        try:
            return self._handle(payload, sender or {})
        except Exception:
            log.exception("admin: error handling a request")
            return _error("internal error (logged on the router)")

    def _handle(self, payload: bytes, sender: dict) -> dict:
        if len(payload) > MAX_REQUEST_BYTES:
            return _error(f"request of {len(payload)} bytes exceeds the limit of {MAX_REQUEST_BYTES}")
        try:
            req = msgpack.unpackb(payload, raw=False)
        except Exception:
            return _error("request is not msgpack")
        if not isinstance(req, dict):
            return _error("request must be a map")
        if not self.token:
            return _error("admin is disabled: set router.admin_token in the config")
        token = req.get("token")
        if not isinstance(token, str):
            return _error("token must be a string")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self.token):
            security.count("admin.bad_token")
            log.warning("admin: refused a request with a wrong token")
            return _error("bad admin token")
        cmd, args = req.get("cmd"), req.get("args", [])
        if not isinstance(cmd, str):
            return _error("cmd must be a string")
        if not isinstance(args, list) or len(args) > MAX_ARGS or \
                not all(isinstance(a, (str, int, float, bool)) for a in args):
            return _error(f"args must be a list of at most {MAX_ARGS} strings or numbers")
        fn = self.commands.get(cmd)
        if fn is None:
            reply = _error(f"unknown command {cmd[:64]!r}; commands: {sorted(self.commands)}")
        else:
            reply = self._run(cmd, fn, args)
        if inspect.isawaitable(reply):
            return _settled(cmd[:64], args, reply, sender)
        _audit(cmd[:64], args, reply, sender)
        return reply

    @staticmethod
    def _run(cmd: str, fn, args: list):
        try:
            result = fn(*args)
        except (TypeError, KeyError, ValueError) as e:
            return _failed(cmd, e)
        if inspect.isawaitable(result):
            return _awaited(cmd, result)
        return {"ok": True, "result": result}


async def _awaited(cmd: str, result) -> dict:
    """The reply to a command whose result is awaited; never raises."""
    try:
        return {"ok": True, "result": await result}
    except (TypeError, KeyError, ValueError) as e:
        return _failed(cmd, e)
    except Exception:
        log.exception("admin: error handling %s", cmd[:64])
        return _error("internal error (logged on the router)")


async def _settled(cmd: str, args: list, reply, sender: dict) -> dict:
    """An awaited reply, audited once it is there."""
    reply = await reply
    _audit(cmd, args, reply, sender)
    return reply


def _failed(cmd: str, e: Exception) -> dict:
    if isinstance(e, TypeError):
        return _error(f"{cmd}: bad arguments ({e})")
    return _error(f"{cmd}: {e.args[0] if e.args else e}")


def _sender(frame: zmq.Frame) -> dict:
    """Who sent a request: the admin key's name (CURVE) and the peer's address, where zmq knows them."""
    out = {}
    for prop, key in (("User-Id", "admin_key"), ("Peer-Address", "peer")):
        try:
            value = frame.get(prop)
        except zmq.ZMQError:   # not set on this socket (plaintext: no key)
            continue
        if value:
            out[key] = value
    return out


def _audit(cmd: str, args: list, reply: dict, sender: dict) -> None:
    changes = cmd not in READS and not (cmd in READS_WITHOUT_ARGS and not args)
    fields = {"command": cmd, "arguments": [a[:256] if isinstance(a, str) else a for a in args],
              "ok": reply["ok"], **sender}
    if not reply["ok"]:
        fields["error"] = reply["error"]
    audit.log(logging.INFO if changes else logging.DEBUG, "admin %s%s: %s", cmd,
              "".join(f" {a}" for a in fields["arguments"]), "ok" if reply["ok"] else f"refused ({reply['error']})",
              extra=fields)


def _one_worker(cmd: str, args: tuple) -> str:
    if len(args) != 1:
        raise ValueError(f"name one worker: pdd admin {cmd} WORKER (pdd admin workers lists them)")
    return args[0]


def _one_request(args: tuple) -> str:
    if len(args) != 1 or not isinstance(args[0], str):
        raise ValueError("name one request: pdd admin abort REQUEST_ID (pdd admin requests lists them)")
    return args[0]


def masked_config(cfg) -> dict:
    """The config as a dict, every secret replaced by "***" (an empty one stays empty)."""
    out = dataclasses.asdict(cfg)
    for table, key in SECRET_FIELDS:
        if table in out and out[table].get(key):
            value = out[table][key]
            out[table][key] = ["***"] * len(value) if isinstance(value, (list, tuple)) else "***"
    return out


def security_report() -> dict:
    """Refused handshakes and tokens on this router, by socket and reason."""
    return security.counts()
