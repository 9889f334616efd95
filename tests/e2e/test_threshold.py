"""The threshold policy with real processes: `pdd up --mode disagg` with
PDD_ROUTER__MODE=threshold (as the README says to select it), one prefill and
one decode worker, KV over tcp on loopback."""
from __future__ import annotations

import subprocess
import sys

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import PATIENT, metric, run_all
from tests.engine.helpers import random_prompts

# PATIENT: the test counts placements, which a worker suspect for a moment would change.
THRESHOLD = {"PDD_ROUTER__MODE": "threshold", "PDD_ROUTER__THRESHOLD__MAX_LOCAL_PREFILL_TOKENS": "64", **PATIENT}


def test_threshold_layout_prefills_short_prompts_locally_and_shows_its_queues(tmp_path, tiny_model, offline):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env=THRESHOLD).start()
    try:
        assert c.cfg.router.mode == "threshold"
        short, long = random_prompts([12, 300], seed=7)
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for prompt in (short, long):          # one at a time: the decisions are the prompts', not the queue's
            (text, reason), = run_all(c, [prompt], [sp])
            assert (text, reason) == (offline.generate([prompt], sp)[0].text, "length")
        assert metric(c, "pdd_placement_total", '{kind="local_prefill",reason="short_prompt"}') == 1
        assert metric(c, "pdd_placement_total", '{kind="disagg",reason="long_prompt"}') == 1
        placement = c.admin("status")["placement"]
        assert placement["policy"] == "threshold"
        assert placement["settings"] == {"max_local_prefill_tokens": 64, "max_prefill_queue_tokens": 32_768}
        assert placement["decisions"] == {"local_prefill": {"short_prompt": 1}, "disagg": {"long_prompt": 1}}
        assert placement["estimates"]["prefill-0"]["queue_full"] is False
        assert placement["estimates"]["prefill-0"]["queued_prefill_tokens"] >= 0
        assert "load" in placement["estimates"]["decode-0"]
        shown = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(c.run_dir / "cluster.toml"),
                                "status"], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert ("placement: policy=threshold  max_local_prefill_tokens=64  max_prefill_queue_tokens=32768"
                in shown.stdout.splitlines()), shown.stdout
        assert "decisions: disagg/long_prompt=1  local_prefill/short_prompt=1" in shown.stdout.splitlines()
    finally:
        assert c.stop() == 0, c.logs()
