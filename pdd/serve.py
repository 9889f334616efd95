"""`pdd serve --role ROLE --config FILE`: run one process of a cluster.

router     HTTP + control bus + admin socket; no model
colocated  a worker that prefills and decodes
prefill / decode   disaggregated workers (same worker code, other config)
"""
from __future__ import annotations

import asyncio
import logging
import signal

from pdd.config import ClusterConfig

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0


def install_event_loop() -> None:
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # uvloop is optional off Linux
        pass


async def run_router(cfg: ClusterConfig, ready_file: str | None = None) -> int:
    from pdd.admin.server import AdminServer
    from pdd.model.make_model import resolve_model_dir
    from pdd.http.app import build_app, serve_http
    from pdd.model.tokenizer import Tokenizer
    from pdd.router.router import Router

    model_dir = resolve_model_dir(cfg.engine.model)
    tokenizer = Tokenizer(model_dir)
    router = Router(cfg)
    await router.start()
    admin = AdminServer(router, cfg.router.admin_addr, cfg.router.admin_token)
    await admin.start(router.ctx)
    runner = await serve_http(build_app(router, tokenizer, cfg.served_model_name(model_dir)),
                              cfg.router.host, cfg.router.port)
    log.info("router listening on http://%s:%d", cfg.router.host, cfg.router.port)

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


async def run_worker(cfg: ClusterConfig) -> int:
    from pdd.worker.worker import Worker

    return await Worker(cfg).serve()


def serve(role: str, cfg: ClusterConfig) -> int:
    install_event_loop()
    if role == "router":
        return asyncio.run(run_router(cfg))
    return asyncio.run(run_worker(cfg))
