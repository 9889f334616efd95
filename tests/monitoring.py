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


DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md"]
# Exported by the router only while tracing is on (tests/e2e/test_tracing.py reads them there).
TRACING_FAMILIES = ("pdd_trace_spans_exported_total", "pdd_trace_spans_dropped_total")


def documented_metrics() -> list[tuple[str, frozenset[str] | None, bool]]:
    """(series name, label names or None, whether they are all of its labels) of every
    `pdd_...` metric README.md and docs/design.md name in backticks, outside tables (the
    README's table of renamed families holds old names). `a_{x,y}_b` is a_x_b and a_y_b;
    a trailing `{l1,l2}` lists the labels, `{l="v"}` one of them; `pdd_process_*`: a prefix."""
    out = []
    for path in DOCS:
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("|"))
        for item in re.findall(r"`(pdd_[^`]+)`", text):
            item = re.sub(r"\s+", "", item)
            m = re.fullmatch(r"(pdd_[a-z0-9_{},*]*?)(\{([a-z_]+(?:=\"[^\"]*\"[|\"a-z_]*)?(?:,[a-z_]+)*)\})?", item)
            if m is None:
                raise AssertionError(f"{path.name}: cannot read the metric {item!r}")
            names = [m.group(1)]
            while any("{" in n for n in names):
                n = next(n for n in names if "{" in n)
                head, alternatives, tail = re.fullmatch(r"([^{]*)\{([^}]*)\}(.*)", n).groups()
                names.remove(n)
                names += [head + a + tail for a in alternatives.split(",")]
            labels = m.group(3)
            exact = labels is not None and "=" not in labels
            label_set = None if labels is None else frozenset(re.findall(r"([a-z_]+)(?:=|,|$)", labels))
            out += [(n, label_set, exact) for n in names if n != "pdd_"]
    return out
