"""[log] and [tracing]: what every process logs, and the spans it exports."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pdd.config.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class LogConfig:
    """[log]: what every process logs, how, and the request traces the router keeps (pdd.logs)."""
    # `pdd serve` and `pdd up`'s children; `pdd serve --log-level` wins, and
    # `pdd admin log-level` changes it at run time.
    level: str = "info"                  # debug | info | warning | error | critical
    format: str = "text"                 # text | json (one object per line)
    # A message logged again and again (same logger, same template) is let
    # through `repeat_limit` times per `repeat_interval_s`, then summed up in
    # one "... N more like this" line (0: no limit). Access and audit lines are never limited.
    repeat_limit: int = 10
    repeat_interval_s: float = 10.0
    # The router keeps the phase timeline of this many recently finished
    # requests, and of this many of the slowest apart (`pdd admin trace`,
    # `pdd admin requests --slow`).
    trace_recent_requests: int = 1000
    trace_slow_requests: int = 100

    def validate(self) -> "LogConfig":
        if self.level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ConfigError(f"log.format: must be text or json, got {self.format!r}")
        if self.repeat_limit < 0:
            raise ConfigError("log.repeat_limit: must be >= 0 (0: no limit)")
        if self.repeat_interval_s <= 0:
            raise ConfigError("log.repeat_interval_s: must be > 0")
        if self.trace_recent_requests < 0 or self.trace_slow_requests < 0:
            raise ConfigError("log.trace_recent_requests and log.trace_slow_requests: must be >= 0 (0: none kept)")
        return self


@dataclass(frozen=True)
class TracingConfig:
    """[tracing]: request spans exported to an OpenTelemetry collector (pdd.tracing). Unset
    keys fall back to the standard OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS
    and OTEL_SERVICE_NAME; PDD_TRACING__* and the file win over them."""
    # The collector's OTLP/HTTP base URL (spans go to <it>/v1/traces as JSON),
    # e.g. http://127.0.0.1:4318. Empty: no spans, no traceparent in responses.
    otlp_endpoint: str = ""
    service_name: str = "pdd"            # each process is service <service_name>-<role>
    # Share of new traces recorded; a request with a traceparent is recorded as its caller says.
    sample_ratio: float = 1.0
    # Sent with every export, "name=value" each (e.g. an Authorization header).
    headers: tuple[str, ...] = ()
    batch_size: int = 512                # spans per export
    # Spans waiting for export at most; more are dropped and counted
    # (pdd_trace_spans_dropped_total): a slow or down collector never slows serving.
    queue_size: int = 4096
    export_interval_s: float = 1.0       # a batch that is not full goes after this long
    export_timeout_s: float = 5.0        # one export's limit; past it the batch is dropped

    def header_dict(self) -> dict[str, str]:
        return {name.strip(): value for name, _, value in (h.partition("=") for h in self.headers)}

    def validate(self) -> "TracingConfig":
        def bad(key, why):
            raise ConfigError(f"tracing.{key}: {why}")
        if self.otlp_endpoint and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", self.otlp_endpoint):
            bad("otlp_endpoint", f"must be an http:// or https:// URL (the collector's base, e.g. "
                                 f"http://127.0.0.1:4318), got {self.otlp_endpoint!r}")
        if not self.service_name:
            bad("service_name", "must not be empty")
        if not 0.0 <= self.sample_ratio <= 1.0:
            bad("sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")
        for i, h in enumerate(self.headers):
            name, eq, value = h.partition("=")
            if not eq or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name.strip()) or "\n" in value:
                bad(f"headers[{i}]", "must be name=value with a valid HTTP header name")
        if self.batch_size < 1:
            bad("batch_size", "must be >= 1")
        if self.queue_size < self.batch_size:
            bad("queue_size", f"must be >= batch_size ({self.batch_size})")
        for key in ("export_interval_s", "export_timeout_s"):
            if getattr(self, key) <= 0:
                bad(key, "must be > 0")
        return self
