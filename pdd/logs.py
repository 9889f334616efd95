"""Logging of every pdd process: one handler on the root logger, text or JSON lines.

- Text (the default): `2026-12-01 12:00:00,123 INFO pdd.router.control: message key=value ...`.
  JSON (`log.format = "json"`): one object per line with stable keys — `ts` (UTC, ISO 8601,
  milliseconds), `level`, `logger`, `msg`, `process` (router or the worker id) — and the
  structured fields of the record (`request_id`, and what an access or audit line carries).
- The request id: a line logged while a request is being handled (`request_context`) carries
  it as `request_id`, without each call site passing it.
- Repeats: the same message template from the same logger is let through `log.repeat_limit`
  times per `log.repeat_interval_s`; then one line says how many more there were
  (RepeatFilter, on the handler: no call site does its own limiting). The access and audit
  loggers are exempt: each of their lines is a record, not a symptom.
- The level can change at run time (`pdd admin log-level`): `set_level`.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone

import orjson

from pdd.config import LOG_LEVELS

ACCESS_LOGGER = "pdd.access"    # one line per HTTP request (pdd.http.app)
AUDIT_LOGGER = "pdd.audit"      # one line per admin command (pdd.admin.server)
UNLIMITED_LOGGERS = (ACCESS_LOGGER, AUDIT_LOGGER)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_request_id: ContextVar[str | None] = ContextVar("pdd_request_id", default=None)
# What a LogRecord holds of its own; anything else on it came as `extra=` (a structured field).
_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def level_number(name: str | int) -> int:
    """`name` ("info", "WARNING", 20) as a logging level; ValueError naming the levels."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if not isinstance(name, str) or name.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {name!r}: expected one of {', '.join(LOG_LEVELS)}")
    return logging.getLevelName(name.upper())


def set_level(name: str | int) -> str:
    """Set this process's level (every logger of pdd follows the root's); returns it by name."""
    logging.getLogger().setLevel(level_number(name))
    return current_level()


def current_level() -> str:
    return logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Lines logged inside carry `request_id` (in this task or thread only)."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def current_request_id() -> str | None:
    return _request_id.get()


def fields(record: logging.LogRecord) -> dict:
    """The structured fields of a record: its `extra=` values, and the request id in context."""
    out = {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")}
    if "request_id" not in out:
        rid = _request_id.get()
        if rid is not None:
            out["request_id"] = rid
    return out


class TextFormatter(logging.Formatter):
    """The classic line, then the structured fields as key=value (the request id
    only where the message does not already name it)."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = fields(record)
        rid = extra.get("request_id")
        if rid is not None and str(rid) in record.getMessage():
            del extra["request_id"]
        if not extra:
            return line
        head, sep, tail = line.partition("\n")   # a traceback stays below the fields
        return head + "".join(f" {k}={_text_value(v)}" for k, v in extra.items()) + sep + tail


def _text_value(v) -> str:
    s = v if isinstance(v, str) else orjson.dumps(v, default=str).decode()
    return s if s and not any(c in s for c in ' "=\n') else orjson.dumps(s).decode()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, process, then the fields."""

    def __init__(self, process: str = ""):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if self.process:
            obj["process"] = self.process
        for k, v in fields(record).items():
            obj.setdefault(k, v)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(obj, default=str).decode()


@dataclass
class _Window:
    start: float
    passed: int = 0
    dropped: int = 0
    last: logging.LogRecord | None = None


class RepeatFilter(logging.Filter):
    """Per (logger, level, message template): the first `limit` records of each
    `interval_s` window pass; the rest are counted, and when the window has
    ended one summary record goes to `emit` (seen at the next record through
    this filter, or at `flush`) naming how many were left out and the last of them."""

    def __init__(self, limit: int, interval_s: float, emit: Callable[[logging.LogRecord], object],
                 clock: Callable[[], float] = time.monotonic, exempt: tuple[str, ...] = UNLIMITED_LOGGERS):
        super().__init__()
        self.limit, self.interval_s, self.emit, self.clock = limit, interval_s, emit, clock
        self.exempt = frozenset(exempt)
        self._windows: dict[tuple, _Window] = {}
        self._order: deque[tuple[float, tuple]] = deque()   # (window start, key), oldest first
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.limit == 0 or record.name in self.exempt or getattr(record, "_repeat_summary", False):
            return True
        now = self.clock()
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            due = self._ended(now)
            w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window(now)
                self._order.append((now, key))
            if w.passed < self.limit:
                w.passed += 1
                keep = True
            else:
                w.dropped, w.last, keep = w.dropped + 1, record, False
        for summary in due:
            self.emit(summary)
        return keep

    def flush(self) -> None:
        """Every pending summary now (at exit)."""
        with self._lock:
            due = self._ended(float("inf"))
        for summary in due:
            self.emit(summary)

    def _ended(self, now: float) -> list[logging.LogRecord]:
        out = []
        while self._order and now - self._order[0][0] >= self.interval_s:
            _, key = self._order.popleft()
            w = self._windows.pop(key)
            if w.dropped:
                out.append(self._summary(w))
        return out

    def _summary(self, w: _Window) -> logging.LogRecord:
        last = w.last
        record = logging.makeLogRecord({
            "name": last.name, "levelno": last.levelno, "levelname": last.levelname,
            "pathname": last.pathname, "lineno": last.lineno, "funcName": last.funcName,
            "msg": "%d more like this in %gs (log.repeat_limit = %d), the last: %s",
            "args": (w.dropped, self.interval_s, self.limit, last.getMessage()),
            "repeated": w.dropped, "_repeat_summary": True})
        return record


_installed: tuple[logging.Handler, RepeatFilter] | None = None


def configure(level: str | int = "warning", fmt: str = "text", process: str = "", repeat_limit: int = 10,
              repeat_interval_s: float = 10.0, stream=None) -> None:
    """This process's one log handler (replacing the one set before), its format and level."""
    global _installed
    root = logging.getLogger()
    if _installed is not None:
        old, old_filter = _installed
        old_filter.flush()
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else TextFormatter())
    repeats = RepeatFilter(repeat_limit, repeat_interval_s, handler.handle)
    handler.addFilter(repeats)
    root.addHandler(handler)
    root.setLevel(level_number(level))
    if _installed is None:
        atexit.register(_flush_installed)   # runs before logging's own shutdown (registered first)
    _installed = (handler, repeats)


def configure_from(cfg, process: str, level: str | None = None) -> None:
    """`configure` from a [log] table (pdd.config.LogConfig); `level` (a flag) wins over it."""
    configure(level or cfg.level, cfg.format, process, cfg.repeat_limit, cfg.repeat_interval_s)


def _flush_installed() -> None:
    if _installed is not None:
        handler, repeats = _installed
        if getattr(handler.stream, "closed", False):   # a stream closed before exit (a test's capture)
            return
        repeats.flush()
