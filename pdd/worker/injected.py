"""A worker's faults on its request path (pdd.faults), put in only once one is
set (faults.when_armed), so that a worker no fault was ever set for runs no
fault check there:

    <role>.step_delay_s, hang_after_steps, gil_hold_s   around each engine step (inject_step_faults)
    reserve.drop_rate                                    the Reserves handed to the engine (drop_reserves)

Each replaces one seam attribute of its owner with a wrapper of it; the
owners are named by duck type (pdd.worker.engine_thread imports this module).
"""
from __future__ import annotations

import logging
import time

from pdd import faults
from pdd.protocol import messages as m

log = logging.getLogger(__name__)


def inject_step_faults(thread) -> None:
    """An EngineThread's `run_step`: sleep step_delay_s before the step, then,
    its clock started (the heartbeats' step_running_s), block while a hang is
    due and hold the interpreter once per gil_hold_s setting."""
    role = thread.role

    def faulty_step():
        delay = faults.get(f"{role}.step_delay_s")
        if delay:
            time.sleep(delay)   # before the clock: a delayed step is not one that runs long
        thread.step_started_at = time.monotonic()
        faults.hang(role, thread.stats.steps_completed)   # blocks while heartbeats go on
        faults.hold_interpreter(role)                      # blocks the heartbeats too
        return thread.engine.step()

    thread.run_step = faulty_step


def drop_reserves(worker) -> None:
    """A Worker's `to_engine`: a Reserve is dropped unanswered at reserve.drop_rate
    (the router's reserve timer fires)."""
    to_engine = worker.to_engine

    def dropping(link, msg: m.Message) -> None:
        if isinstance(msg, m.Reserve) and faults.should_fail("reserve"):
            log.warning("fault injection (reserve.drop_rate): dropped the Reserve of %s", msg.request_id)
            return
        to_engine(link, msg)

    worker.to_engine = dropping
