"""Adaptive placement with real processes: `pdd up --adaptive` with two colocated
workers that also prefill for each other, KV over tcp on loopback."""
from __future__ import annotations

import json
import threading
import urllib.request

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg import metric, run_all
from tests.engine.helpers import random_prompts


# A shared 2-core CPU misses the GPU-sized default targets whatever the
# placement; out of their way, the choice is by cost alone.
CPU_SLOS = {"PDD_ROUTER__ADAPTIVE__TTFT_SLO_S": "600", "PDD_ROUTER__ADAPTIVE__TPOT_SLO_S": "60",
            "PDD_ROUTER__ADAPTIVE__ITL_SLO_S": "60"}


def stream(cluster, prompt: list[int], max_tokens: int, first_chunk: threading.Event, out: dict) -> None:
    """A streaming completion; sets `first_chunk` when its first token arrives."""
    body = json.dumps({"model": cluster.model_name, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(cluster.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
                first_chunk.set()
    out["text"] = "".join(text)


def test_adaptive_layout_serves_and_shows_its_decisions(tmp_path, tiny_model, offline):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "2", "--adaptive",
                  env=CPU_SLOS).start()
    try:
        assert c.cfg.router.mode == "adaptive"
        workers = c.workers()
        assert all(w["prefills_for_others"] for w in workers.values())
        # One of the two leans to prefill from the start; short prompts decode on the other.
        status = c.admin("status")
        assert status["placement"]["prefill_leaning"] == ["colocated-0"]
        assert status["placement"]["policy"] == "adaptive"
        assert status["placement"]["estimates"]["colocated-0"]["leaning"] == "prefill"
        short, long = random_prompts([12, 700], seed=5)
        greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        expected_short = offline.generate([short], greedy)[0].text
        started, out = threading.Event(), {}
        t = threading.Thread(target=stream, args=(c, short, 100, started, out))
        t.start()
        assert started.wait(120)
        # A long prompt while colocated-1 decodes: computed on the prefill-leaning
        # worker (nothing decodes there), its KV shipped to colocated-1.
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        (text, reason), = run_all(c, [long], [sp])
        t.join(300)
        assert out["text"] == expected_short
        assert (text, reason) == (offline.generate([long], sp)[0].text, "length")
        assert metric(c, "pdd_placement_total", '{kind="local_prefill",reason="short_prompt"}') == 1
        # The long prompt is priced; on an idle machine the prefill-leaning worker
        # wins (no decode to disturb there), but the estimates come from measured
        # step times, and a busy CI box may price a local prefill lower.
        status = c.admin("status")
        decisions = status["placement"]["decisions"]
        assert decisions.get("local_prefill", {}).get("short_prompt") == 1, decisions
        assert sum(sum(r.values()) for r in decisions.values()) == 2, decisions
        disaggregated = int(bool(decisions.get("disagg")))     # the long one went over
        assert metric(c, "pdd_requests_total", '{finish_reason="length",mode="disagg"}') == disaggregated
        assert metric(c, "pdd_requests_total", '{finish_reason="length",mode="colocated"}') == 2 - disaggregated
        estimates = {w["worker_id"]: w["estimate"] for w in status["workers"]}
        assert estimates["colocated-0"]["leaning"] == "prefill" and estimates["colocated-1"]["leaning"] == "decode"
        # Its decode steps reach the router with its next heartbeat, which may
        # come after the requests end (on an idle machine they take well under
        # a heartbeat interval).
        _wait_for(lambda: next(w["estimate"] for w in c.admin("status")["workers"]
                               if w["worker_id"] == "colocated-1")["step_groups_measured"] > 0, 30.0,
                  "colocated-1's decode steps measured")
        idle = c.wait_idle(timeout_s=30)
        assert all(w["free_blocks"] == w["num_blocks"] for w in idle.values()), idle
    finally:
        assert c.stop() == 0, c.logs()
