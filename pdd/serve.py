"""`pdd serve --role ROLE --config FILE`: run one process of a cluster.

router     HTTP + control bus + admin socket; no model
colocated  a worker that prefills and decodes
prefill / decode   disaggregated workers (same worker code, other config)

Before anything starts, the security set-up is checked (pdd.security.check_start):
missing keys without security.insecure, or an empty or placeholder admin token
on the router, end the process with EXIT_REFUSED (78, EX_CONFIG: systemd's
RestartPreventExitStatus keeps it from restarting in a loop).

Under systemd (`Type=notify`, pdd.sdnotify) each process says READY=1 once it
serves — the router when HTTP is bound and the control bus is up, a worker
once the router has registered it — keeps a STATUS= line, pings the watchdog
only while it makes progress (the router: its event loop runs; a worker: its
engine thread moves, see EngineProgress), and says STOPPING=1 with the time
its drain may take (router.drain_timeout_s, worker.drain_timeout_s).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from pdd import sdnotify, tracing
from pdd.config import EXIT_REFUSED, ROLES, ClusterConfig, ConfigError

if TYPE_CHECKING:
    from pdd.model.config import ModelConfig
    from pdd.worker.engine_thread import EngineThread
    from pdd.worker.worker import Worker

log = logging.getLogger(__name__)

# What a router's stop takes beyond its drain: closing HTTP, the admin socket
# and the control bus (flushed for up to 2 s). Asked of systemd with the drain.
ROUTER_STOP_MARGIN_S = 10.0


def parse_instance(name: str) -> tuple[str, str]:
    """A worker unit's instance name, ROLE-N (pdd-worker@decode-0): its role and
    worker id. ConfigError if it is not one: a unit that cannot start must
    not restart in a loop (EXIT_REFUSED)."""
    workers = ROLES[1:]
    m = re.fullmatch(rf"({'|'.join(workers)})-\d+", name)
    if m is None:
        raise ConfigError(f"worker instance {name!r}: expected ROLE-N, ROLE one of {', '.join(workers)} "
                          "and N a number unique in the cluster (e.g. pdd-worker@decode-0)")
    return m.group(1), name


def install_event_loop() -> None:
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # uvloop is optional off Linux
        pass


async def run_router(cfg: ClusterConfig, model_dir: Path, model: ModelConfig) -> int:
    """model_dir and model: the checkpoint serve() checked (its EOS ids end requests)."""
    from pdd.admin.server import AdminServer
    from pdd.http.app import build_app, serve_http
    from pdd.model.tokenizer import Tokenizer
    from pdd.router import heap
    from pdd.router.router import Router
    from pdd.security import admin_security

    tokenizer = Tokenizer(model_dir)
    eos_token_ids = model.eos_token_ids
    tracing.start(cfg.tracing, "router", f"{cfg.router.router_id}-{socket.gethostname()}-{os.getpid()}")
    router = Router(cfg)
    await router.start()
    admin = AdminServer(router, cfg.router.own_admin_addr, cfg.router.admin_token, admin_security(cfg))
    await admin.start(router.ctx)
    router.served_names = cfg.served_model_names(model_dir)
    app = build_app(router, tokenizer, router.served_names, eos_token_ids,
                    model_root=cfg.model_root(model_dir))
    runner = await serve_http(app, cfg.router.host, cfg.router.port)
    heap.settle_for_serving()
    url = f"http://{cfg.router.host}:{cfg.router.port}"
    own = cfg.router.own_http_port
    log.info("router listening on %s%s", url,
             f" (shared by the cluster's routers; this is {cfg.router.router_id}) and on port {own}, its own"
             if own else "")
    _warn_open_http(cfg)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    notify = sdnotify.notifier()
    notify.ready(f"serving {url}, control bus {router.chan.addr}")
    # The loop that serves is the one that pings: stuck, it falls silent.
    watch = asyncio.create_task(sdnotify.keep_alive(notify, lambda: True, lambda: _router_status(router, url)))
    await stop.wait()
    drain_s = cfg.router.drain_timeout_s
    log.info("router draining (up to %gs)", drain_s)
    notify.stopping(f"draining {len(router.requests)} request(s), up to {drain_s:g}s",
                    within_s=drain_s + ROUTER_STOP_MARGIN_S)
    await router.drain(drain_s)
    watch.cancel()
    await runner.cleanup()
    await admin.stop()
    await router.stop()
    await asyncio.to_thread(tracing.stop)
    return 0


def _router_status(router, url: str) -> str:
    workers = router.registry.workers.values()
    accepting = sum(1 for w in workers if w.accepting)
    return (f"serving {url}: {accepting} of {len(workers)} worker(s) accepting, "
            f"{len(router.requests)} request(s) in flight")


def _warn_open_http(cfg: ClusterConfig) -> None:
    if cfg.security.api_keys:
        return
    loopback = cfg.router.host in ("127.0.0.1", "::1", "localhost")
    log.log(logging.INFO if loopback else logging.WARNING,
            "the HTTP API on %s:%d takes requests without an API key (set security.api_keys)",
            cfg.router.host, cfg.router.port)


async def run_worker(cfg: ClusterConfig) -> int:
    from pdd.worker.worker import Worker

    worker = Worker(cfg)
    tracing.start(cfg.tracing, worker.role, worker.worker_id)
    progress = EngineProgress(cfg.worker.step_timeout_s)
    watch = asyncio.create_task(sdnotify.keep_alive(
        sdnotify.notifier(), lambda: progress.moved(worker.engine_thread), lambda: _worker_status(worker, progress)))
    try:
        return await worker.serve()
    finally:
        watch.cancel()
        await asyncio.to_thread(tracing.stop)


class EngineProgress:
    """Whether a worker's engine thread has moved since the last look: the
    watchdog's evidence that the worker works, not just that its event loop runs
    (which goes on heartbeating while a step hangs).

    The engine thread publishes a new snapshot after each pass of its loop —
    after steps while busy, after each wait for commands while idle — and
    `moved` wakes it for the next look, so an idle engine answers within the
    window too. It has moved if a new snapshot came since the last look and no
    step has run longer than worker.step_timeout_s (the router's measure of a
    hang: from the heartbeat that shows it on, no ping can come)."""

    def __init__(self, step_timeout_s: float):
        self.step_timeout_s = step_timeout_s
        self._seen = None
        self.step_running_s = 0.0

    def moved(self, thread: EngineThread | None) -> bool:
        if thread is None or not thread.is_alive():
            return False
        started = thread.step_started_at   # read once: the engine thread clears it when the step ends
        self.step_running_s = time.monotonic() - started if started is not None else 0.0
        snapshot = thread.snapshot
        moved = self._seen is not None and snapshot is not self._seen
        self._seen = snapshot
        thread.wake()   # an idle engine publishes a snapshot for the next look
        return moved and not self.hung

    @property
    def hung(self) -> bool:
        return self.step_running_s > self.step_timeout_s


def _worker_status(worker: Worker, progress: EngineProgress) -> str:
    where = f"{worker.worker_id} ({worker.role}), {worker.routers_named}"
    if progress.step_running_s >= 1.0:
        hung = " (beyond worker.step_timeout_s: hung)" if progress.hung else ""
        return f"{where}: an engine step has run {progress.step_running_s:.0f}s{hung}"
    if worker.draining:
        return f"{where}: draining"
    if not worker.registered_with():
        return f"{where}: waiting for a router to register it"
    snap = worker.engine_thread.snapshot
    return f"{where}: {snap.running} running, {snap.waiting} waiting, {snap.free_blocks} free blocks"


def serve(role: str, cfg: ClusterConfig) -> int:
    from pdd import faults
    from pdd.security import check_start

    from pdd.model.config import CheckpointError, ModelConfig
    from pdd.model.make_model import resolve_model_dir

    try:
        check_start(cfg, role)
        faults.load_env()   # a bad PDD_FAULTS stops the process here, named
        model_dir = resolve_model_dir(cfg.engine.model)
        model = ModelConfig.from_dir(model_dir)   # a missing or broken checkpoint too
    except (ConfigError, CheckpointError, faults.FaultError) as e:
        # 78 (EX_CONFIG): the units do not restart it; a retry would fail the same way.
        log.error("%s refuses to start: %s", role, e)
        print(f"pdd serve: {e}", file=sys.stderr)
        return EXIT_REFUSED
    install_event_loop()
    try:
        if role == "router":
            return asyncio.run(run_router(cfg, model_dir, model))
        return asyncio.run(run_worker(cfg))
    except (OSError, zmq.ZMQError) as e:
        if e.errno != errno.EADDRINUSE:
            raise
        # Exit 1: restarting may help once the other process has let the address go.
        print(f"pdd serve: {role}: an address it must listen on is in use ({e}); "
              "see router.port, router.control_addr, router.admin_addr and worker.data_addr", file=sys.stderr)
        return 1
