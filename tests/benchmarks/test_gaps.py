"""`python -m benchmarks.gaps` on constructed request records: which gaps are first gaps, and the tail's share."""
import json

from benchmarks import gaps
from benchmarks.cli import run
from benchmarks.gaps import anatomy


def _record(itl_ms, success=True):
    return {"success": success, "itl_ms": itl_ms}


def test_first_gaps_are_told_from_later_ones_and_counted_in_the_tail():
    # 99 requests whose hand-over is slow (100 ms) and whose decode steps are 10 ms, one failed
    records = [_record([100.0] + [10.0] * 9) for _ in range(99)] + [_record([500.0, 10.0], success=False)]
    a = anatomy(records)
    assert a.requests == 99
    assert a.first_median_ms == 100.0 and a.first_max_ms == 100.0
    assert a.later_median_ms == 10.0 and a.later_p99_ms == 10.0
    assert a.itl_p99_ms == 100.0
    assert a.tail_gaps == 99 and a.tail_first_share == 1.0


def test_a_decode_tail_is_not_blamed_on_first_gaps():
    records = [_record([10.0] + [10.0] * 97 + [80.0, 80.0]) for _ in range(10)]
    a = anatomy(records)
    assert a.itl_p99_ms == 80.0 and a.first_max_ms == 10.0
    assert a.tail_gaps == 20 and a.tail_first_share == 0.0


def test_no_samples_gives_empty_figures():
    a = anatomy([_record([]), _record([5.0], success=False)])
    assert a.requests == 0 and a.itl_p99_ms is None and a.tail_first_share is None


def test_the_cli_reads_saved_results(tmp_path, capsys):
    path = tmp_path / "rate-12.json"
    path.write_text(json.dumps({"requests": [_record([30.0, 10.0, 10.0])]}))
    assert run(gaps, [str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[str(path)]["first_median_ms"] == 30.0
    assert out[str(path)]["later_median_ms"] == 10.0
