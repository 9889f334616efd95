"""Cluster lifecycle with real processes: clean shutdown drains, a worker of
another layout is refused, a worker killed mid-stream loses no token."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster


def stream_tokens(url: str, model: str, prompt: str, max_tokens: int, on_chunk=None) -> tuple[str, str]:
    """Blocking SSE client; returns (text, finish_reason)."""
    import urllib.request
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    text, reason = [], None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            reason = chunk["choices"][0]["finish_reason"] or reason
            if on_chunk:
                on_chunk(len(text))
    return "".join(text), reason


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, tiny_model):
    # Shared: the refused worker never joins, and the one killed mid-stream is
    # restarted by `pdd up`; either test holds in a cluster the other has used.
    c = UpCluster(tmp_path_factory.mktemp("two"), tiny_model, "--mode", "colocated", "--workers", "2").start()
    yield c
    c.stop()


def test_sigint_drains_in_flight_requests(tmp_path, tiny_model, offline):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated").start()
    expected = offline.generate(["drain me"], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))[0]
    result = {}
    started = threading.Event()
    t = threading.Thread(target=lambda: result.update(out=stream_tokens(
        c.url, c.model_name, "drain me", 120, on_chunk=lambda n: started.set())))
    t.start()
    assert started.wait(30)
    assert c.stop() == 0                      # SIGINT to `pdd up`: router drains, then workers stop
    t.join(60)
    assert result["out"] == (expected.text, "length")
    log = (tmp_path / "run" / "router.log").read_text()
    assert "draining" in log


def test_worker_with_another_layout_is_refused(two_workers):
    c = two_workers
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "serve", "--role", "colocated", "--config", str(c.run_dir / "cluster.toml"),
         "--worker-id", "odd-one", "--set", "engine.block_size=32"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "block_size" in proc.stderr
    assert "odd-one" not in c.workers()


def test_worker_killed_mid_stream_loses_no_token(two_workers, offline):
    c = two_workers
    expected = offline.generate(["keep going"], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))[0]
    victim = {}

    def on_chunk(n):
        if n == 20 and not victim:
            (req,) = c.admin("requests")
            victim["worker"] = req["worker_id"]
            pid = c.workers()[req["worker_id"]]["pid"]
            os.kill(pid, signal.SIGKILL)

    text, reason = stream_tokens(c.url, c.model_name, "keep going", 400, on_chunk)
    assert victim, "the stream ended before a worker could be killed"
    assert (text, reason) == (expected.text, "length")
    metrics = __import__("urllib.request").request.urlopen(c.url + "/metrics").read().decode()
    assert "pdd_request_migrations_total 1.0" in metrics
