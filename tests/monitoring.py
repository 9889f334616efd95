"""What tests of the monitoring set-up share: promtool (from PATH, or Debian's
`prometheus` package unpacked, never installed, into the repo's git-ignored
cache; a test that cannot get it is skipped with the reason), and the metric
names conf/grafana/pdd.json and conf/prometheus/pdd-rules.yml query."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".pdd-cache" / "promtool"
DASHBOARD = ROOT / "conf" / "grafana" / "pdd.json"
RULES = ROOT / "conf" / "prometheus" / "pdd-rules.yml"


def promtool() -> Path:
    """The promtool binary, or pytest.skip naming why there is none."""
    found = shutil.which("promtool")
    if found:
        return Path(found)
    cached = CACHE / "promtool"
    if cached.exists():
        return cached
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("promtool: not on PATH, and no apt-get/dpkg to unpack Debian's prometheus package")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(["apt-get", "download", "prometheus"], cwd=tmp, capture_output=True, text=True,
                             timeout=300)
        debs = list(Path(tmp).glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            pytest.skip(f"promtool: `apt-get download prometheus` failed ({got.stderr.strip()[-300:]}); "
                        "install prometheus or put promtool on PATH")
        subprocess.run(["dpkg", "-x", str(debs[0]), str(Path(tmp) / "root")], check=True, timeout=300)
        CACHE.mkdir(parents=True, exist_ok=True)
        staged = CACHE / f"promtool.{os.getpid()}"
        shutil.copy2(Path(tmp) / "root" / "usr" / "bin" / "promtool", staged)
        os.replace(staged, cached)    # atomic: a concurrent run sees all of it or none
    return cached


def check(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`promtool check ARGS`; its output in the result."""
    return subprocess.run([str(promtool()), "check", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def queried_series(text: str) -> set[str]:
    """The pdd series names (`pdd_...`, not recording rules' `pdd:...`) in PromQL text."""
    return set(re.findall(r"\bpdd_[a-z0-9_]+", text))


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exposed_series(scrape: str) -> set[str]:
    """The series names a /metrics text can have: those of its families,
    including families with no series yet (a labelled counter before its first event)."""
    return {family.name + suffix for family in text_string_to_metric_families(scrape)
            for suffix in _SUFFIXES.get(family.type, ("",))}
