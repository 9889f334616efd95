"""Fault injection for tests, and only for tests.

`PDD_FAULTS="prefill.step_delay_s=0.3,transfer.send_delay_s=0.2"` in a
process's environment slows or breaks the named places so a test can catch a
request in a given phase (queued, prefilling, transferring) or force a
failure. Unset (always, in production) every fault is 0 and costs one dict
lookup.

Known faults:
  <role>.step_delay_s      sleep before each engine step of a worker of that role
  transfer.send_delay_s    the KV sender waits this long before each page message
  transfer.reject          1 = the KV receiver refuses every page (transfer failure)
"""
from __future__ import annotations

import os
from functools import lru_cache


@lru_cache(maxsize=1)
def _faults() -> dict[str, float]:
    out = {}
    for item in os.environ.get("PDD_FAULTS", "").split(","):
        name, _, value = item.strip().partition("=")
        if name:
            out[name] = float(value or 1)
    return out


def get(name: str) -> float:
    return _faults().get(name, 0.0)
