"""What the router's state machine logs (tests/router/sim.py: no sockets)."""
from __future__ import annotations

import io
import json
import logging

import pytest

from pdd import logs
from tests.router.sim import SimCluster
from tests.router.test_control import prefilling


@pytest.fixture
def control_log():
    """The lines of pdd.router.control, .membership and .worker_messages, as JSON objects, at DEBUG."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    loggers = [logging.getLogger(name) for name in ("pdd.router.control", "pdd.router.membership",
                                                     "pdd.router.worker_messages")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_registration_repeated_by_the_same_process_is_logged_once_at_info(control_log):
    c = SimCluster()
    w = c.add_worker("d0", "decode")
    for _ in range(5):   # its Registers queued up while the router was busy
        c.control.handle("d0", w.register_message())
    registered = [line["level"] for line in control_log() if line["msg"].startswith("worker d0 registered")]
    assert registered == ["INFO"] + ["DEBUG"] * 5
    c.restart("d0")      # a new process under the id: a registration worth saying
    assert [line["level"] for line in control_log() if line["msg"].startswith("worker d0 registered")][-1] == "INFO"


def test_a_line_logged_while_handling_a_workers_message_carries_its_request_id(control_log):
    c, p0, d0, s = prefilling()
    c.act(p0, (s.request_id, s.epoch), "fail")
    failed, = [line for line in control_log() if "failed" in line["msg"]]
    assert failed["request_id"] == s.request_id and failed["level"] == "WARNING"
