"""A sender's record of its requests: what each has delivered so far and when
its transfer counts as stalled (Progress), and the requests that failed
before finish() (Tombstones). Every sender backend keeps both (local, tcp,
cuda_ipc, nixl): a Progress per request in flight, and one Tombstones.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdd.transfer.base import TransferResult


@dataclass
class Progress:
    """What has been delivered of one request so far, and when its transfer
    counts as stalled.

    The transfer deadline runs only while the data plane owes the request
    something (a backend's message handed over and not yet acknowledged), and
    counts from the transfer's last progress: the handover that started the
    wait, or the latest acknowledgement. While nothing is owed the transfer
    waits on the prompt's compute, which is no stall (a hung engine step is
    the router's hang detection's to see); so a long prefill whose pages keep
    landing is never cut off, however long it runs.
    """

    request_id: str
    t_first: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    blocks: set[int] = field(default_factory=set)
    t_last: float = 0.0
    moved_at: float | None = None   # last progress while something is owed; None: nothing owed

    def owe(self, since: float) -> None:
        """Something was handed to the data plane at `since` (perf_counter): the
        deadline starts then, unless an earlier handover already runs it."""
        if self.moved_at is None:
            self.moved_at = since

    def delivered(self, nbytes: int, dst: list[int], now: float | None = None, still_owed: bool = False) -> None:
        """An acknowledgement: progress. `still_owed`: other handovers await theirs."""
        self.bytes += nbytes
        self.blocks.update(dst)
        self.t_last = time.perf_counter() if now is None else now
        self.moved_at = self.t_last if still_owed else None

    def deadline(self, timeout_s: float) -> float | None:
        """When the transfer stalled (`timeout_s` after its last progress), or
        None while the data plane owes it nothing."""
        return None if self.moved_at is None else self.moved_at + timeout_s

    def result(self, ok: bool, error: str = "", blocks_skipped: int = 0) -> TransferResult:
        end = self.t_last if ok and self.t_last else time.perf_counter()
        return TransferResult(self.request_id, ok, error, self.bytes, max(0.0, end - self.t_first),
                              len(self.blocks), blocks_skipped)


class Tombstones:
    """Requests that already failed before finish(): their later pages are
    dropped and finish() reports nothing more. Bounded, oldest forgotten first."""

    def __init__(self, cap: int = 10_000):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._cap = cap

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self._cap:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> bool:
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids
