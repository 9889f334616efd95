"""`pdd serve --role ROLE --config FILE`: run one process of a cluster.

router     HTTP + control bus + admin socket; no model
colocated  a worker that prefills and decodes
prefill / decode   disaggregated workers (same worker code, other config)

Before anything starts, the security set-up is checked (pdd.security.check_start):
missing keys without security.insecure, or an empty or placeholder admin token
on the router, end the process with EXIT_REFUSED (78, EX_CONFIG: systemd's
RestartPreventExitStatus keeps it from restarting in a loop).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from pdd.config import EXIT_REFUSED, ClusterConfig, ConfigError

if TYPE_CHECKING:
    from pdd.model.config import ModelConfig

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0


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
    from pdd.router.router import Router
    from pdd.security import admin_security

    tokenizer = Tokenizer(model_dir)
    eos_token_ids = model.eos_token_ids
    router = Router(cfg)
    await router.start()
    admin = AdminServer(router, cfg.router.admin_addr, cfg.router.admin_token, admin_security(cfg))
    await admin.start(router.ctx)
    runner = await serve_http(build_app(router, tokenizer, cfg.served_model_name(model_dir), eos_token_ids),
                              cfg.router.host, cfg.router.port)
    log.info("router listening on http://%s:%d", cfg.router.host, cfg.router.port)
    _warn_open_http(cfg)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router draining (up to %.0fs)", DRAIN_TIMEOUT_S)
    await router.drain(DRAIN_TIMEOUT_S)
    await runner.cleanup()
    await admin.stop()
    await router.stop()
    return 0


def _warn_open_http(cfg: ClusterConfig) -> None:
    if cfg.security.api_keys:
        return
    loopback = cfg.router.host in ("127.0.0.1", "::1", "localhost")
    log.log(logging.INFO if loopback else logging.WARNING,
            "the HTTP API on %s:%d takes requests without an API key (set security.api_keys)",
            cfg.router.host, cfg.router.port)


async def run_worker(cfg: ClusterConfig) -> int:
    from pdd.worker.worker import Worker

    return await Worker(cfg).serve()


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
