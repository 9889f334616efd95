"""Request tracing exported to an OpenTelemetry collector (OTLP/HTTP, JSON), off by default.

With `tracing.otlp_endpoint` set, every process of a cluster exports spans:

- the router, when a request ends, one root span `request` (a child of the
  client's `traceparent` span, if it sent one) and one child span per phase of
  its timeline (pdd.router.traces: `queued`, `reserving`, `prefilling`,
  `decoding`, per placement) plus a `fallback` span per re-placement; the
  timeline's other events (placed, first_token, kv_landed, transfer, error)
  are events of the root span (pdd.tracing.requests);
- each worker, spans of its own part, children of the router's phase span
  in which the command came: `prefill` (the prompt computing), `kv_send` (a
  prefill worker's transfer to its decode worker), `kv_wait` (a decode
  worker's reservation until the KV lands) and `decode` (pdd.tracing.placements).

The trace context travels in the control messages that start work on a worker
(`traceparent` of Reserve, Prefill, KVTarget, Admit, PrefillLocally); a
message without one starts no worker span. Resource: service.name
`<tracing.service_name>-<role>`, service.instance.id the worker id (the
router's: router-<host>-<pid>), service.version.

This module holds the process's one exporter (pdd.tracing.otlp): `start` at
process start, `emit` from any thread, never blocking.
"""
from __future__ import annotations

import logging

from pdd import __version__
from pdd.config import TracingConfig
from pdd.tracing.context import SpanContext, server_span
from pdd.tracing.otlp import Exporter, Span

log = logging.getLogger(__name__)

_exporter: Exporter | None = None
_process: dict[str, str] = {}      # this process's role and id, added to its spans
_sample_ratio = 1.0


def start(cfg: TracingConfig, role: str, instance_id: str) -> bool:
    """Export this process's spans as cfg says (False: tracing is off)."""
    global _exporter, _sample_ratio
    stop()
    if not cfg.otlp_endpoint:
        return False
    resource = {"service.name": f"{cfg.service_name}-{role}", "service.instance.id": instance_id,
                "service.version": __version__, "service.namespace": cfg.service_name}
    _exporter = Exporter(cfg.otlp_endpoint, resource, cfg.header_dict(), cfg.batch_size, cfg.queue_size,
                         cfg.export_interval_s, cfg.export_timeout_s)
    _process.update({"pdd.role": role, "pdd.worker_id": instance_id})
    _sample_ratio = cfg.sample_ratio
    log.info("tracing: spans of %s go to %s (sample ratio %g)", instance_id, _exporter.url, cfg.sample_ratio)
    return True


def stop(timeout_s: float = 2.0) -> None:
    """Post what is queued (bounded), then stop exporting."""
    global _exporter
    if _exporter is not None:
        _exporter.stop(timeout_s)
        _exporter = None
    _process.clear()


def enabled() -> bool:
    return _exporter is not None


def emit(span: Span) -> None:
    if _exporter is not None:
        _exporter.emit(span)


def process_attributes() -> dict[str, str]:
    """pdd.role and pdd.worker_id of this process, for its spans."""
    return _process


def stats() -> dict[str, int] | None:
    """The exporter's counts (None: tracing is off)."""
    return _exporter.stats() if _exporter is not None else None


def incoming(traceparent: str | None) -> SpanContext | None:
    """The context of a request's root span at the router (None: tracing is off)."""
    return server_span(traceparent, _sample_ratio) if _exporter is not None else None
