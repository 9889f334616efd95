"""The data plane's faults (pdd.faults), put in by the factories where a fault
may act and only once one is set (faults.when_armed), so that the request
path of a process no fault was ever set in runs no fault check:

    transfer.fail_rate, transfer.delay_s   a prefill worker's sender (inject_transfer_faults):
                                           a doomed transfer's handoff is withheld (as a lost
                                           last message would be: the decode worker does not
                                           start) and its result reported failed; results are
                                           held back
    transfer.send_delay_s                  the tcp sender (hold_pages): each pages message
                                           waits at the head of its queue, the I/O thread
                                           serving on
    transfer.reject                        a receiver's page writer (refuse_pages)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pdd import faults
from pdd.transfer.base import Handoff, KVSender, TransferResult
from pdd.transfer.receiver import PageWriter
from pdd.transfer.tcp import TcpMessage, TcpSender

REJECTED = "refused by fault injection (PDD_FAULTS transfer.reject)"


def inject_transfer_faults(sender: KVSender) -> None:
    """A prefill worker's sender (pdd.transfer.plan.open_sender) with the
    transfer faults in its finish() and poll()."""
    finish, poll = sender.finish, sender.poll

    def failing_finish(request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        finish(request_id, blocks_skipped, None if faults.fail_transfer(request_id) else handoff)

    def delaying_poll() -> list[TransferResult]:
        return faults.transfer_results(poll())

    sender.finish, sender.poll = failing_finish, delaying_poll


@dataclass
class HeldMessage(TcpMessage):
    """A tcp message held transfer.send_delay_s once it is at the head of its
    queue (the delay read then), its pages landed."""

    not_before: float | None = None

    def ready(self) -> float | None:
        if self.staged is None:
            return None
        if self.not_before is None:
            super().ready()
            self.not_before = time.perf_counter() + faults.get("transfer.send_delay_s")
        return self.not_before if time.perf_counter() < self.not_before else None


def hold_pages(sender: TcpSender) -> None:
    sender.message_class = HeldMessage   # read by the I/O thread at each message it makes


def refuse_pages(writer: PageWriter) -> None:
    """transfer.reject: every pages message that passed the writer's checks is refused, unwritten."""
    write = writer.write

    def refusing_write(header: dict, payload) -> str | None:
        return REJECTED if faults.get("transfer.reject") else write(header, payload)

    writer.write = refusing_write
