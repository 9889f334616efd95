"""A prefill worker's sender with pdd.faults' transfer faults in it, so that
the worker's request path calls no fault hook: `transfer.fail_rate` withholds
a doomed transfer's handoff (as a lost last message would: the decode worker
does not start) and reports it failed; `transfer.delay_s` holds results back.
With no fault set each call costs one look at the settings."""
from __future__ import annotations

from pdd import faults
from pdd.transfer import MultiSender
from pdd.transfer.base import Handoff, TransferResult


class FaultInjectingSender(MultiSender):
    def finish(self, request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        super().finish(request_id, blocks_skipped, None if faults.fail_transfer(request_id) else handoff)

    def poll(self) -> list[TransferResult]:
        return faults.transfer_results(super().poll())
