"""`pdd bench frontdoor`'s clients count a read's events at once: the first gap of
a read is the time since the last, the others of that read are 0, and the sample
stays uniform and bounded past GAP_SAMPLE."""
from __future__ import annotations

from pdd.bench import frontdoor


def test_a_reads_gaps_are_its_wait_then_zeros_and_the_sample_stays_bounded(monkeypatch):
    tally = {"gaps": [], "n_gaps": 0}
    frontdoor._sample_gaps(tally, None, 2)      # a stream's first read, three events: its TTFT, then 0, 0
    frontdoor._sample_gaps(tally, 0.02, 1)      # a read 20 ms later, two events
    assert tally == {"gaps": [0.0, 0.0, 0.02, 0.0], "n_gaps": 4}
    monkeypatch.setattr(frontdoor, "GAP_SAMPLE", 4)
    for _ in range(50):
        frontdoor._sample_gaps(tally, 0.5, 0)
    assert len(tally["gaps"]) == 4 and tally["n_gaps"] == 54
