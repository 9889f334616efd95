"""The router's admin socket: a ZeroMQ ROUTER bound to localhost by default.

Request:  msgpack {"token": str, "cmd": str, "args": [..]}
Reply:    msgpack {"ok": true, "result": ...} | {"ok": false, "error": str}
Every request must carry the configured admin token; with no token
configured every command is refused (an open admin socket is never the default).
"""
from __future__ import annotations

import asyncio
import hmac
import logging

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


class AdminServer:
    def __init__(self, router, addr: str, token: str):
        self.router = router
        self.addr = addr
        self.token = token
        self.commands = {
            "status": self._status,
            "workers": lambda: [w.summary() for w in router.registry.workers.values()],
            "requests": lambda: [s.summary() for s in router.requests.values()],
            "drain": lambda worker_id: router.set_draining(worker_id, True),
            "undrain": lambda worker_id: router.set_draining(worker_id, False),
            "config": self._config,
        }
        self._task: asyncio.Task | None = None

    def _status(self) -> dict:
        return self.router.status()

    def _config(self) -> dict:
        import dataclasses
        cfg = dataclasses.asdict(self.router.cfg)
        cfg["router"]["admin_token"] = "***"
        return cfg

    def register(self, name: str, fn) -> None:
        self.commands[name] = fn

    async def start(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.addr)
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("admin socket on %s", self.addr)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(0)

    async def _loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) < 2:
                continue
            reply = self.handle(frames[-1])
            await self.sock.send_multipart(frames[:-1] + [msgpack.packb(reply, use_bin_type=True)])

    def handle(self, payload: bytes) -> dict:
        try:
            req = msgpack.unpackb(payload, raw=False)
        except Exception:
            return {"ok": False, "error": "request is not msgpack"}
        if not isinstance(req, dict):
            return {"ok": False, "error": "request must be a map"}
        if not self.token:
            return {"ok": False, "error": "admin is disabled: set router.admin_token in the config"}
        if not hmac.compare_digest(str(req.get("token", "")), self.token):
            return {"ok": False, "error": "bad admin token"}
        cmd, args = req.get("cmd"), req.get("args") or []
        fn = self.commands.get(cmd)
        if fn is None:
            return {"ok": False, "error": f"unknown command {cmd!r}; commands: {sorted(self.commands)}"}
        try:
            return {"ok": True, "result": fn(*args)}
        except TypeError as e:
            return {"ok": False, "error": f"{cmd}: bad arguments ({e})"}
        except (KeyError, ValueError) as e:
            return {"ok": False, "error": f"{cmd}: {e.args[0] if e.args else e}"}
