"""pdd.logs: the line formats, the request id in context, repeats limited; the [log] config."""
from __future__ import annotations

import io
import json
import logging

import pytest

from pdd import logs
from pdd.config import ConfigError
from pdd.config_loader import load_cluster_config


@pytest.fixture
def captured():
    """pdd's handler on a buffer, JSON; the root's level and handlers as they were afterwards."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    out = io.StringIO()
    yield out
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_have_stable_keys_fields_and_the_request_id_in_context(captured):
    logs.configure("info", "json", process="decode-0", stream=captured)
    log = logging.getLogger("pdd.test")
    log.info("plain %s", "line")
    with logs.request_context("abc-123"):
        log.warning("about %s", "it", extra={"tokens": 5})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    log.debug("not at info")
    first, second, third = lines(captured)
    assert list(first) == ["ts", "level", "logger", "msg", "process"]
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert (first["level"], first["logger"], first["msg"], first["process"]) == ("INFO", "pdd.test", "plain line",
                                                                                  "decode-0")
    assert second["request_id"] == "abc-123" and second["tokens"] == 5 and second["level"] == "WARNING"
    assert "request_id" not in first and "request_id" not in third
    assert third["msg"] == "failed" and "RuntimeError: boom" in third["exc"]


def test_text_lines_append_fields_and_name_the_request_only_once(captured):
    logs.configure("info", "text", stream=captured)
    log = logging.getLogger("pdd.test")
    with logs.request_context("r-1"):
        log.info("request %s placed", "r-1")
        log.info("applying abort failed")
    log.info("GET /health", extra={"status": 200, "client": "a b"})
    one, two, three = captured.getvalue().splitlines()
    assert one.endswith("INFO pdd.test: request r-1 placed")
    assert two.endswith("INFO pdd.test: applying abort failed request_id=r-1")
    assert three.endswith('GET /health status=200 client="a b"')


def test_a_repeated_message_is_let_through_n_times_per_interval_then_summed_up():
    now = [0.0]
    out: list[logging.LogRecord] = []
    f = logs.RepeatFilter(3, 10.0, out.append, clock=lambda: now[0])

    def record(name: str, msg: str, *args) -> logging.LogRecord:
        return logging.makeLogRecord({"name": name, "msg": msg, "args": args, "levelno": logging.INFO,
                                      "levelname": "INFO"})

    passed = [f.filter(record("pdd.router", "worker %s registered", f"w{i}")) for i in range(6)]
    assert passed == [True, True, True, False, False, False]
    assert all(f.filter(record("pdd.access", "POST /v1/completions")) for _ in range(10))   # never limited
    assert f.filter(record("pdd.router", "another template")) and out == []
    now[0] = 10.0   # the window ended: the next record through brings its summary first
    assert f.filter(record("pdd.other", "x"))
    summary, = out
    assert summary.repeated == 3 and summary.name == "pdd.router" and summary.levelno == logging.INFO
    assert summary.getMessage() == "3 more like this in 10s (log.repeat_limit = 3), the last: worker w5 registered"
    assert f.filter(summary)   # a summary passes its own filter
    assert f.filter(record("pdd.router", "worker %s registered", "w6"))   # a new window
    for _ in range(4):
        f.filter(record("pdd.router", "worker %s registered", "w7"))
    f.flush()   # at exit: what is pending, now
    assert out[-1].repeated == 2   # 5 in the window, 3 let through
    unlimited = logs.RepeatFilter(0, 10.0, out.append, clock=lambda: now[0])
    assert all(unlimited.filter(record("pdd.router", "same")) for _ in range(100))


def test_repeats_are_limited_on_the_handler_with_the_summary_in_the_output(captured):
    logs.configure("info", "json", stream=captured, repeat_limit=2, repeat_interval_s=3600)
    log = logging.getLogger("pdd.test")
    for i in range(5):
        log.warning("worker %s registered", i)
    logs._installed[1].flush()
    got = lines(captured)
    assert [g["msg"] for g in got[:2]] == ["worker 0 registered", "worker 1 registered"]
    assert got[2]["repeated"] == 3 and got[2]["msg"].endswith("the last: worker 4 registered")
    assert len(got) == 3


def test_the_level_changes_at_run_time_and_a_bad_one_is_named(captured):
    logs.configure("warning", "json", stream=captured)
    log = logging.getLogger("pdd.test")
    log.info("hidden")
    assert logs.set_level("DEBUG") == "debug"
    log.debug("shown")
    assert [g["msg"] for g in lines(captured)] == ["shown"]
    with pytest.raises(ValueError, match="expected one of debug, info, warning, error, critical"):
        logs.set_level("verbose")


def test_the_log_table_its_env_overrides_and_the_old_level_variable():
    assert load_cluster_config(env={}).log.level == "info"
    cfg = load_cluster_config(env={"PDD_LOG__FORMAT": "json", "PDD_LOG__LEVEL": "debug"}).log
    assert (cfg.format, cfg.level) == ("json", "debug")
    assert load_cluster_config(env={"PDD_LOG_LEVEL": "WARNING"}).log.level == "WARNING"
    both = {"PDD_LOG_LEVEL": "warning", "PDD_LOG__LEVEL": "error"}
    assert load_cluster_config(env=both).log.level == "error"
    with pytest.raises(ConfigError, match="log.format: must be text or json, got 'yaml'"):
        load_cluster_config(env={"PDD_LOG__FORMAT": "yaml"})
    with pytest.raises(ConfigError, match="log.level: must be one of"):
        load_cluster_config(env={"PDD_LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match="log.repeat_limit"):
        load_cluster_config(env={"PDD_LOG__REPEAT_LIMIT": "-1"})
