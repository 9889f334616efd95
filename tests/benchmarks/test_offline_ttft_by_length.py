"""`python -m benchmarks.offline --ttft-by-length`: short and long prompts arriving
together, time to first token per class in engine steps, first come first
served vs short prompts first; on the CPU the outputs of both runs are equal."""
from __future__ import annotations

import json

from benchmarks import offline
from benchmarks.cli import run


def test_short_prompts_start_sooner_with_the_threshold_and_outputs_are_equal(tiny_model, tmp_path, capsys):
    out = tmp_path / "ttft.json"
    rc = run(offline, ["--ttft-by-length", "--model", str(tiny_model), "--num-requests", "20",
                       "--min-prompt", "16", "--max-prompt", "64", "--min-long-prompt", "300",
                       "--max-long-prompt", "400", "--long-share", "0.2", "--max-num-batched-tokens", "128",
                       "--long-prefill-token-threshold", "128", "--num-blocks", "256", "--max-tokens", "2",
                       "--passes", "1", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["outputs_differ"] == 0
    fcfs, short_first = result["fcfs"], result["short_first"]
    assert (fcfs["threshold"], short_first["threshold"]) == (0, 128)
    assert fcfs["short"]["count"] == short_first["short"]["count"] == 16 and fcfs["long"]["count"] == 4
    assert short_first["short"]["steps_mean"] < fcfs["short"]["steps_mean"]
    assert "| short_first (threshold 128) | short | 16 |" in capsys.readouterr().out
