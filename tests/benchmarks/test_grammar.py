"""`python -m benchmarks.grammar` runs end to end (on the tiny model's tokenizer: the 128k
one it trains takes a minute) and reports every figure it promises."""
import json

from benchmarks import grammar
from benchmarks.cli import run


def test_the_bench_reports_masks_apply_and_handover(tmp_path, tiny_model):
    out = tmp_path / "grammar.json"
    assert run(grammar, ["--tokenizer", str(tiny_model / "tokenizer.json"), "--vocab", "1024",
                          "--batches", "1,4", "--tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for b in ("1", "4"):
        lg = report["mask"][b]["llguidance"]
        assert lg["per_token_us"] > 0 and lg["fill_mean_ms"] >= 0
        assert report["apply_ms"][b] > 0
    assert set(report["handover"]) == {"replay_1_ms"}
