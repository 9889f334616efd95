"""Worker ids over a worker's life, with real processes (`pdd up` plus `pdd
serve` workers the test starts and stops): a process started under a live
worker's id replaces it and the old one exits for good; a worker that leaves
is forgotten (breakers, estimates, metric series) after router.forget_after_s
unless it comes back under its id before that."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pdd import SamplingParams
from pdd.config import EXIT_REPLACED
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster
from tests.e2e.streams import stream_all
from tests.e2e.test_disagg_faults import _wait_for
from tests.engine.helpers import random_prompts

START_S = 180.0    # a worker process loading the model on a busy machine


def serve(c: UpCluster, role: str, worker_id: str, log: Path) -> subprocess.Popen:
    """`pdd serve` as a unit would run it, on the cluster's config, logging to `log`."""
    return subprocess.Popen([sys.executable, "-m", "pdd.cli", "serve", "--role", role, "--worker-id", worker_id,
                             "--config", str(c.run_dir / "cluster.toml")],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PDD_LOG_LEVEL": "INFO"})


def registered(c: UpCluster, worker_id: str, pid: int) -> bool:
    return c.workers().get(worker_id, {}).get("pid") == pid


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(60)


def served(c: UpCluster, offline, seed: int, n: int = 3) -> bool:
    """n streams, each with the text a fault-free run gives."""
    prompts = random_prompts([5 + 7 * i for i in range(n)], seed=seed)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * n
    expected = [(e.text, "length", []) for e in offline.generate(prompts, params)]
    return [tuple(r) for r in stream_all(c, prompts, params)] == expected


def test_a_process_started_under_a_live_workers_id_replaces_it_and_the_old_one_exits(tmp_path, tiny_model,
                                                                                      offline):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1").start()
    procs = []
    try:
        old = serve(c, "colocated", "extra-0", tmp_path / "old.log")
        procs.append(old)
        _wait_for(lambda: registered(c, "extra-0", old.pid), START_S, "the first extra-0 registered")
        new = serve(c, "colocated", "extra-0", tmp_path / "new.log")
        procs.append(new)
        assert old.wait(START_S) == EXIT_REPLACED      # told at its first word after the new one registered
        assert "another process registered under this worker id" in (tmp_path / "old.log").read_text()
        assert registered(c, "extra-0", new.pid)
        c.admin("drain", "colocated-0")                # what is served now, the new extra-0 serves
        assert served(c, offline, seed=31)
        # Its heartbeat after those steps says so (the status is as of the last heartbeat).
        _wait_for(lambda: c.workers()["extra-0"]["steps_completed"] > 0, START_S, "extra-0 reports its steps")
        assert new.poll() is None
    finally:
        stop(*procs)
        assert c.stop() == 0, c.logs()


def test_a_departed_worker_is_forgotten_after_the_grace_period_and_one_back_in_time_is_not(tmp_path, tiny_model,
                                                                                            offline):
    """extra-0 and extra-1 decode for prefill-0; both leave (extra-1 killed,
    extra-0 stopped until the router counts it lost), extra-0 comes back. Once
    the router forgets extra-1, its breakers and series are gone from `pdd
    admin status` and /metrics; extra-0's are all there."""
    # extra-0 registers again within moments of its SIGCONT: 6 s of grace leave a
    # busy machine room, and extra-1 is forgotten without a long wait.
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env={"PDD_ROUTER__FORGET_AFTER_S": "6"}).start()
    extras = {wid: serve(c, "decode", wid, tmp_path / f"{wid}.log") for wid in ("extra-0", "extra-1")}
    try:
        for wid, proc in extras.items():
            _wait_for(lambda: registered(c, wid, proc.pid), START_S, f"{wid} registered")
        c.admin("drain", "decode-0")
        for seed, (busy, idle) in enumerate((("extra-0", "extra-1"), ("extra-1", "extra-0"))):
            c.admin("drain", idle)
            assert served(c, offline, seed=40 + seed)
            c.admin("undrain", idle)
        _wait_for(lambda: all(f'decode="{wid}"' in metrics(c) and f'worker="{wid}"' in metrics(c)
                              for wid in extras), 60.0, "breaker and step series of both extra workers")
        before = {wid: kept(c, wid) for wid in extras}
        os.kill(extras["extra-0"].pid, signal.SIGSTOP)
        extras["extra-1"].kill()
        _wait_for(lambda: not set(extras) & set(c.workers()), 60.0, "both extra workers counted lost")
        assert {d["worker_id"] for d in c.admin("status")["departed"]} == set(extras)
        os.kill(extras["extra-0"].pid, signal.SIGCONT)
        _wait_for(lambda: registered(c, "extra-0", extras["extra-0"].pid), 60.0, "extra-0 back")
        _wait_for(lambda: 'extra-1"' not in metrics(c), 120.0, "extra-1 forgotten")
        status = c.admin("status")
        assert status["departed"] == []
        assert kept(c, "extra-1") == {"breakers": [], "series": set()}
        back = kept(c, "extra-0")   # nothing of it lost (its series may have grown since: heartbeats, late transfers)
        assert back["breakers"] == before["extra-0"]["breakers"] and back["series"] >= before["extra-0"]["series"]
        assert served(c, offline, seed=50)
    finally:
        stop(*extras.values())
        assert c.stop() == 0, c.logs()


def metrics(c: UpCluster) -> str:
    return http_util.get(c.url + "/metrics").body.decode()


# Series the router keeps of a worker while it is away (the rest, such as its
# free pages, are read from its registration and go with it at once).
KEPT_FAMILIES = ("pdd_breaker_", "pdd_scheduler_iteration_latency_seconds", "pdd_prefill_chunk_size_tokens",
                 "pdd_decode_batch_size_requests", "pdd_prefix_cache_", "pdd_time_to_first_token_seconds",
                 "pdd_inter_token_latency_seconds", "pdd_time_per_output_token_seconds",
                 "pdd_prefill_to_decode_kv_transfer_seconds", "pdd_kv_transfer_bytes")


def kept(c: UpCluster, worker_id: str) -> dict:
    """Its breaker pairs in `pdd admin status`, and the families of its kept series in /metrics."""
    pairs = sorted((b["prefill"], b["decode"]) for b in c.admin("status")["breakers"] if worker_id in
                   (b["prefill"], b["decode"]))
    families = {line.split("{")[0] for line in metrics(c).splitlines()
                if line.startswith(KEPT_FAMILIES) and f'"{worker_id}"' in line}
    return {"breakers": pairs, "series": families}
