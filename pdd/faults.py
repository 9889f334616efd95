"""Fault injection: named faults that break or slow one place each, off unless set.

Set at process start with `PDD_FAULTS="transfer.fail_rate=1,decode.hang_after_steps=50"`
(every process of `pdd up` inherits it), or at run time through the router
(`pdd admin faults set NAME=VALUE [WORKER]`, only with
router.allow_fault_injection = true), which forwards them to the workers
over the control bus (SetFaults). The request path asks nothing here until a
fault is first set: its seams put their fault-injecting wrappers in then
(`when_armed`; pdd.transfer.injected, pdd.worker.injected).

Known faults (each acts in the roles named; elsewhere it is inert):
  transfer.fail_rate=P      prefill   that share of KV transfers fails: the last message
                                      does not start the decode worker, and the result
                                      comes back failed (PrefillFailed, as for a real failure)
  transfer.delay_s=S        prefill   a transfer's result is held S seconds more
  transfer.send_delay_s=S   prefill   the tcp sender holds each page message S before it goes
                                      (its I/O thread serves on: a large S is a stalled
                                      transfer, failed at worker.transfer_timeout_s)
  transfer.reject=1         decode    the KV receiver refuses every page
  reserve.drop_rate=P       decode    that share of Reserves is dropped unanswered
                                      (the router's reserve timer fires)
  <role>.step_delay_s=S     <role>    sleep S before each engine step
  <role>.hang_after_steps=N <role>    from the N-th engine step on, the step blocks
                                      (heartbeats go on, step_running_s grows) until
                                      the fault is cleared or the worker stops
  <role>.gil_hold_s=S       <role>    the next engine step holds the interpreter lock
                                      S seconds, once per setting (as a compile or a C
                                      call that keeps the GIL does): no other thread of
                                      the process runs, its heartbeats wait
  seed=N                    any       seed of the draws behind the *_rate faults
<role> is prefill, decode or colocated. Draws come from one RNG per process,
seeded by `seed` (default 0): a run repeats itself.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode", "colocated")


class FaultError(ValueError):
    """A fault setting pdd cannot use; the message names what is wrong."""


@dataclass(frozen=True)
class _Spec:
    kind: str                  # rate: [0, 1]; seconds: >= 0; count: integer >= 1; flag: 0 or 1; int
    roles: tuple[str, ...]     # where it acts


_FIXED = {
    "transfer.fail_rate": _Spec("rate", ("prefill",)),
    "transfer.delay_s": _Spec("seconds", ("prefill",)),
    "transfer.send_delay_s": _Spec("seconds", ("prefill",)),
    "transfer.reject": _Spec("flag", ("decode",)),
    "reserve.drop_rate": _Spec("rate", ("decode",)),
    "seed": _Spec("int", WORKER_ROLES),
}
_PER_ROLE = {"step_delay_s": "seconds", "hang_after_steps": "count", "gil_hold_s": "seconds"}
KNOWN = {**_FIXED, **{f"{role}.{what}": _Spec(kind, (role,))
                      for role in WORKER_ROLES for what, kind in _PER_ROLE.items()}}


def check(name: str, value) -> float:
    """`value` for fault `name`, checked; FaultError naming what is wrong."""
    spec = KNOWN.get(name)
    if spec is None:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(sorted(KNOWN))}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise FaultError(f"{name}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or v != v:
        raise FaultError(f"{name}: expected a number, got {value!r}")
    if spec.kind == "rate" and not 0.0 <= v <= 1.0:
        raise FaultError(f"{name}: a rate must be in [0, 1], got {value!r}")
    if spec.kind == "seconds" and not 0.0 <= v < float("inf"):
        raise FaultError(f"{name}: seconds must be >= 0, got {value!r}")
    if spec.kind in ("count", "int", "flag") and v != int(v):
        raise FaultError(f"{name}: expected a whole number, got {value!r}")
    if spec.kind == "count" and v < 1:
        raise FaultError(f"{name}: must be >= 1 (the step it starts at), got {value!r}")
    if spec.kind == "flag" and v not in (0.0, 1.0):
        raise FaultError(f"{name}: expected 0 or 1, got {value!r}")
    return v


def parse(text: str) -> dict[str, float]:
    """`NAME=VALUE[,NAME=VALUE...]` (PDD_FAULTS, `pdd admin faults set`), every item checked."""
    out = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise FaultError(f"{item!r}: expected NAME=VALUE, e.g. transfer.fail_rate=0.3")
        if name in out:
            raise FaultError(f"{name}: set twice")
        out[name] = check(name, value.strip())
    return out


def check_all(values: dict) -> dict[str, float]:
    """A name -> value map (off the wire), every item checked."""
    return {name: check(name, value) for name, value in values.items()}


def acts_in(name: str, role: str) -> bool:
    return role in KNOWN[name].roles


def format_values(values: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(values.items()))


# ---------------------------------------------------------------- this process's settings

class _Registry:
    """What is set in this process. `values` is replaced whole, never mutated:
    the engine thread and the data plane's threads read it without a lock."""

    def __init__(self, values: dict[str, float]):
        self.values = values
        self.rng = random.Random(int(values.get("seed", 0)))
        self.rng_lock = threading.Lock()
        self.released = threading.Event()   # set while no hang is due: a hung step wakes on it
        self.released.set()
        self.delayed: list[tuple[float, object]] = []   # (due, transfer result): engine thread only
        self.doomed: set[str] = set()     # transfers failed at their finish: engine thread only
        self.hang_logged = False
        self.gil_held = False     # gil_hold_s acted since it was set


_registry: _Registry | None = None
_init_lock = threading.Lock()


def _get() -> _Registry:
    global _registry
    if _registry is None:
        with _init_lock:
            if _registry is None:
                _registry = _Registry(_from_env(os.environ))
        _arm(_registry.values)
    return _registry


# ---------------------------------------------------------------- the seams' wrappers, put in once

_armed = False     # a fault has been set in this process
_unarmed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # owner -> its install, until armed
_arm_lock = threading.Lock()


def when_armed(owner, install: Callable) -> None:
    """`install(owner)` once a fault is set in this process: now if one has
    been, else when load_env or apply first sets one. A seam on the request
    path puts its fault-injecting wrapper in this way, so that a process no
    fault was ever set in runs no fault check there. A wrapper stays in once
    put in: a transfer result it holds back must still come out after its
    fault is cleared. `owner` is held weakly (a seam that goes is forgotten)."""
    _get()   # PDD_FAULTS, if nothing read it yet
    with _arm_lock:
        if not _armed:
            _unarmed[owner] = install
            return
    install(owner)


def _arm(values: dict[str, float]) -> None:
    global _armed
    if not values:
        return
    with _arm_lock:
        if _armed:
            return
        _armed = True
        pending = list(_unarmed.items())
        _unarmed.clear()
    for owner, install in pending:
        install(owner)


def _from_env(environ) -> dict[str, float]:
    try:
        return parse(environ.get("PDD_FAULTS", ""))
    except FaultError as e:
        raise FaultError(f"PDD_FAULTS: {e}") from None


def load_env(environ=None) -> dict[str, float]:
    """Read PDD_FAULTS now (process start), so that a bad value stops the
    process with an error instead of surfacing at the first query."""
    global _registry
    values = _from_env(os.environ if environ is None else environ)
    with _init_lock:
        _registry = _Registry(values)
    if values:
        log.warning("fault injection on (PDD_FAULTS): %s", format_values(values))
    _set_hang_state(_registry)
    _arm(values)
    return values


def current() -> dict[str, float]:
    return dict(_get().values)


def apply(values: dict[str, float], clear: bool = False) -> dict[str, float]:
    """Set faults at run time (after clearing every one, with clear=True);
    returns what is set now. A hang that is no longer set is released."""
    r = _get()
    new = {} if clear else dict(r.values)
    new.update(check_all(values))
    if "seed" in values:
        with r.rng_lock:
            r.rng.seed(int(new["seed"]))
    r.values = new
    r.hang_logged = False
    if any(k.endswith(".gil_hold_s") for k in values):
        r.gil_held = False
    _set_hang_state(r)
    _arm(new)
    log.warning("fault injection: now %s", format_values(new) or "none")
    return dict(new)


def release_hangs() -> None:
    """The worker stops: a step blocked by hang_after_steps must end."""
    r = _get()
    r.values = {k: v for k, v in r.values.items() if not k.endswith(".hang_after_steps")}
    _set_hang_state(r)


def _set_hang_state(r: _Registry) -> None:
    if any(k.endswith(".hang_after_steps") for k in r.values):
        r.released.clear()
    else:
        r.released.set()


# ---------------------------------------------------------------- queries (from the wrappers)

def get(name: str) -> float:
    return _get().values.get(name, 0.0)


def should_fail(what: str) -> bool:
    """One draw against `transfer.fail_rate` or `reserve.drop_rate`."""
    r = _get()
    rate = r.values.get("transfer.fail_rate" if what == "transfer" else f"{what}.drop_rate", 0.0)
    if rate <= 0.0:
        return False
    with r.rng_lock:   # draws come from several threads
        return r.rng.random() < rate


def fail_transfer(request_id: str) -> bool:
    """Whether the transfer about to finish fails (one draw against
    transfer.fail_rate): then its last message must not start the decode
    worker, and transfer_results reports it failed. Engine thread only."""
    if not should_fail("transfer"):
        return False
    _get().doomed.add(request_id)
    return True


def transfer_results(results: list) -> list:
    """The sender's finished transfers (pdd.transfer.base.TransferResult) as the
    faults make them: those fail_transfer doomed failed, each held back
    transfer.delay_s (released at a later call; the engine thread calls at
    least every heartbeat interval). Engine thread only."""
    r = _get()
    delay = r.values.get("transfer.delay_s", 0.0)
    if not r.delayed and not delay and not r.doomed:
        return results
    now = time.monotonic()
    for res in results:
        if res.request_id in r.doomed:
            r.doomed.discard(res.request_id)
            res = dataclasses.replace(res, ok=False, error=f"injected fault (transfer.fail_rate="
                                                            f"{r.values.get('transfer.fail_rate', 0):g})")
        r.delayed.append((now + delay, res))
    due = [res for t, res in r.delayed if t <= now]
    r.delayed = [(t, res) for t, res in r.delayed if t > now]
    return due


def hang(role: str, steps_completed: int) -> None:
    """Block the engine step about to run (step steps_completed + 1) while
    `<role>.hang_after_steps` is due. Engine thread only."""
    if not _hang_due(role, steps_completed):
        return
    r = _get()
    if not r.hang_logged:
        r.hang_logged = True
        log.warning("fault injection: %s.hang_after_steps: engine step %d blocks until the fault is cleared",
                    role, steps_completed + 1)
    # Re-checked after each wake: the fault may have been set again (or to a later step) meanwhile.
    while _hang_due(role, steps_completed):
        _get().released.wait(1.0)


def _hang_due(role: str, steps_completed: int) -> bool:
    n = _get().values.get(f"{role}.hang_after_steps")
    return n is not None and steps_completed + 1 >= n


def hold_interpreter(role: str) -> None:
    """Hold the interpreter lock `<role>.gil_hold_s` seconds, once per setting,
    in one C call made through ctypes.PyDLL (which keeps the GIL, as a compiled
    extension that does not release it would). Engine thread only."""
    r = _get()
    seconds = r.values.get(f"{role}.gil_hold_s", 0.0)
    if not seconds or r.gil_held:
        return
    r.gil_held = True
    log.warning("fault injection: %s.gil_hold_s: this engine step holds the interpreter for %gs", role, seconds)
    whole = int(seconds)
    nanosleep(ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9))), None)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


nanosleep = ctypes.PyDLL(None).nanosleep    # PyDLL: the call keeps the GIL
