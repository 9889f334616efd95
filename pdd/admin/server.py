"""The router's admin socket: a ZeroMQ ROUTER bound to localhost by default.

Request:  msgpack {"token": str, "cmd": str, "args": [scalars]}
Reply:    msgpack {"ok": true, "result": ...} | {"ok": false, "error": str}

Two locks on the door: with keys, the socket runs CURVE and lets in only the
authorized admin keys (pdd.security); every request must then carry the admin
token, which the router refuses to start without (placeholders included).
Whatever arrives — garbage, a wrong type anywhere, an oversize message, a
command that raises — gets an error reply and the loop serves on; the token
and other secrets are never logged nor echoed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging

import msgpack
import zmq
import zmq.asyncio

from pdd import security
from pdd.security import Curve, HandshakeWatch

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024   # larger requests get an error reply
_HARD_LIMIT_BYTES = 1 << 20     # larger ones are not even read: zmq drops the connection
MAX_ARGS = 16
# (table, key) of the config values the `config` command masks.
SECRET_FIELDS = (("router", "admin_token"), ("security", "api_keys"))


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
            "workers": lambda: [w.summary() for w in router.registry.workers.values()],
            "requests": lambda: [s.summary() for s in router.requests.values()],
            "drain": lambda *worker: router.set_draining(_one_worker("drain", worker), True),
            "undrain": lambda *worker: router.set_draining(_one_worker("undrain", worker), False),
            "config": self._config,
            "security": security_report,
            # breaker: every pair; breaker open|close|auto [PREFILL DECODE | all]: force until auto
            "breaker": lambda *args: router.set_breaker(*args) if args else router.breakers(),
            # faults: what is set where; faults set NAME=VALUE[,...] [WORKER] | clear [WORKER]:
            # only with router.allow_fault_injection
            "faults": lambda *args: router.faults(*args),
        }
        self._task: asyncio.Task | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self._watch: HandshakeWatch | None = None

    def _status(self) -> dict:
        return self.router.status()

    def _config(self) -> dict:
        return masked_config(self.router.cfg)

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
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.sock is not None and not self.sock.closed:
            if self._watch is not None:
                self._watch.close()
            self.sock.close(0)
            if self.security is not None:
                self.security.release(self.sock)

    async def _loop(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart()
                if len(frames) < 2:
                    continue
                await self.sock.send_multipart(frames[:-1] + [self._encode(self.handle(frames[-1]))])
            except asyncio.CancelledError:
                raise
            except Exception:  # nothing a peer sends may stop the admin socket
                log.exception("admin: error serving a request")

    @staticmethod
    def _encode(reply: dict) -> bytes:
        try:
            return msgpack.packb(reply, use_bin_type=True)
        except Exception as e:  # a command returned something msgpack cannot carry
            log.exception("admin: reply cannot be encoded")
            return msgpack.packb(_error(f"the result cannot be encoded ({type(e).__name__})"), use_bin_type=True)

    def handle(self, payload: bytes) -> dict:
        """One request in, one reply out; never raises."""
        try:
            return self._handle(payload)
        except Exception:
            log.exception("admin: error handling a request")
            return _error("internal error (logged on the router)")

    def _handle(self, payload: bytes) -> dict:
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
            return _error(f"unknown command {cmd[:64]!r}; commands: {sorted(self.commands)}")
        try:
            return {"ok": True, "result": fn(*args)}
        except TypeError as e:
            return _error(f"{cmd}: bad arguments ({e})")
        except (KeyError, ValueError) as e:
            return _error(f"{cmd}: {e.args[0] if e.args else e}")


def _one_worker(cmd: str, args: tuple) -> str:
    if len(args) != 1:
        raise ValueError(f"name one worker: pdd admin {cmd} WORKER (pdd admin workers lists them)")
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
