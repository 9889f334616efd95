"""One decode worker's data socket as a sender's I/O thread holds it
(pdd.transfer.sender.IoSender): a DEALER dialing it (with keys, a CURVE
client of the key the decode worker registered), the frames zmq could not
take yet (`Outgoing`), and, if the backend asks, a monitor of the
connection: a failed handshake it reports (`HANDSHAKE_FAILED`) fails that
destination's requests at once (tcp, nixl), with `handshake_refused`'s
reason. Backends extend `Dest` with what they know of the peer (cuda_ipc,
nixl: its pool) and `Outgoing` with what a message carries until its ack (tcp).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

# Connection events of a data socket that refused our CURVE handshake.
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_refused(addr: str) -> str:
    """Why a request fails when the decode worker's data socket refused our handshake."""
    return (f"CURVE handshake with the decode worker at {addr} failed: this worker's key is not authorized "
            "there, or the key it registered is not the one it serves with")


@dataclass
class Outgoing:
    """Frames for a destination, from when they are queued until zmq takes them."""

    request_id: str
    frames: list

    def ready(self) -> float | None:
        """Make sure the frames' memory holds what they send (a backend's
        staging); None if they may go now, else the time (perf_counter) before
        which they must not (an injected delay: the I/O thread serves on meanwhile)."""
        return None


class Dest:
    """One DEALER dialing one decode worker's data socket, the frames zmq
    could not take yet, and (if `monitor_events`) a monitor of the connection."""

    def __init__(self, ctx: zmq.Context, addr: str, security=None, server_key: str = "", monitor_events: int = 0):
        self.addr = addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Queue only onto a live connection: with no receiver, sends fail with
        # Again and the frames stay in `pending`, where a deadline can drop them.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)   # bounded by what we hold anyway
        if security is not None:
            security.dial(self.sock, server_key)
        self.monitor = self.sock.get_monitor_socket(monitor_events) if monitor_events else None
        self.sock.connect(addr)
        self.pending: deque[Outgoing] = deque()

    def events(self) -> set[int]:
        """The monitor's events since the last look."""
        seen = set()
        while True:
            try:
                seen.add(recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)["event"])
            except zmq.Again:
                return seen

    def flush(self, poller: zmq.Poller) -> float | None:
        """Hand zmq what it takes now; poll for writability while frames wait.
        Returns when frames held back may go (None: none are)."""
        held = None
        while self.pending:
            out = self.pending[0]
            held = out.ready()
            if held is not None:
                break
            try:
                self.sock.send_multipart(out.frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.pending.popleft()
        poller.register(self.sock, zmq.POLLIN | (zmq.POLLOUT if self.pending and held is None else 0))
        return held

    def drop(self, request_id: str) -> None:
        """Forget the request's frames zmq has not taken."""
        if self.pending:
            self.pending = deque(out for out in self.pending if out.request_id != request_id)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


DestKey = tuple[str, str]   # (address, the server key dialed: "" without security)
