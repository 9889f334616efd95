"""What a pdd router's /metrics says, as the benchmarks read it: its sample
lines, and the series of given names by "name{labels}"."""
from __future__ import annotations

import urllib.request


def metric_lines(url: str, timeout_s: float = 10.0) -> list[str]:
    """The lines of `url`/metrics; none when it does not answer (a benchmark
    reports without them rather than fail: the server may not be pdd)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace").splitlines()
    except (OSError, ValueError):
        return []


def series(lines: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """The value of each series (its "name{labels}") whose name starts with one of `names`."""
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith(names):
            key, _, value = line.rpartition(" ")
            out[key] = out.get(key, 0.0) + float(value)
    return out
