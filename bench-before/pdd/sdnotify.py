"""systemd's notification protocol (sd_notify(3)), for `Type=notify` units.

A service started by systemd with `Type=notify` finds `$NOTIFY_SOCKET` in its
environment: a unix datagram socket (a path, or `@name` in the abstract
namespace). Each message is one datagram of newline-separated `KEY=VALUE`
lines: `READY=1` once it serves, `STATUS=...` a line for `systemctl status`,
`STOPPING=1` when it begins to stop, `EXTEND_TIMEOUT_USEC=N` for a stop that
will take that long, and `WATCHDOG=1`: with `WatchdogSec=` in the unit,
`$WATCHDOG_USEC` says how often systemd must hear it, or it kills and restarts
the service. Pings go out at half that, and only where the caller sees real
progress: a hung process must fall silent.

Without `$NOTIFY_SOCKET` every call does nothing, so the same code runs under
systemd, `pdd up`, a shell or a test. Nothing here raises: a manager that is
gone, or a full socket, loses the message (sent without blocking), never the
service.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# What a process under systemd finds in its environment; `pdd up` keeps them
# from its children, whose messages systemd would ignore (NotifyAccess=main).
ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# How often a STATUS line is refreshed when the unit has no watchdog.
STATUS_PERIOD_S = 5.0


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self.address = _address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_s(environ) if self.address else None
        self._sock: socket.socket | None = None
        self._status: str | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def ping_interval_s(self) -> float | None:
        """Half the watchdog timeout (None: no watchdog)."""
        return self.watchdog_s / 2 if self.watchdog_s else None

    def send(self, *lines: str) -> bool:
        """One datagram of `KEY=VALUE` lines; False if it could not go."""
        if self.address is None or not lines:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self.address)
        except OSError as e:
            if not self._failed:   # once: a manager that is gone would fill the log
                self._failed = True
                log.warning("sd_notify: cannot send to NOTIFY_SOCKET (%s); later messages may be lost too", e)
            return False
        return True

    def ready(self, status: str) -> None:
        self._status = status
        self.send("READY=1", f"STATUS={_one_line(status)}")

    def status(self, status: str, watchdog: bool = False) -> None:
        """STATUS= when it changed, and WATCHDOG=1 with it when `watchdog`."""
        lines = ["WATCHDOG=1"] if watchdog else []
        if status != self._status:
            self._status = status
            lines.append(f"STATUS={_one_line(status)}")
        self.send(*lines)

    def stopping(self, status: str, within_s: float | None = None) -> None:
        """The stop began; with `within_s`, systemd's stop timeout is extended
        to it, so a drain the config allows is not cut short by the unit's."""
        lines = ["STOPPING=1", f"STATUS={_one_line(status)}"]
        if within_s is not None:
            lines.append(f"EXTEND_TIMEOUT_USEC={int(within_s * 1e6)}")
        self._status = status
        self.send(*lines)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def keep_alive(notifier: Notifier, alive: Callable[[], bool], status: Callable[[], str]) -> None:
    """Until cancelled, every half watchdog timeout (STATUS_PERIOD_S without
    one): WATCHDOG=1 if `alive()` says the process made progress, and the
    `status()` line if it changed. Runs on the event loop it vouches for: a
    loop that is stuck runs nothing, this included."""
    if not notifier.enabled:
        return
    period = notifier.ping_interval_s or STATUS_PERIOD_S
    while True:
        await asyncio.sleep(period)
        live = notifier.watchdog_s is not None and alive()
        notifier.status(status(), watchdog=live)


_notifier: Notifier | None = None


def notifier() -> Notifier:
    """This process's notifier, from its environment at the first call."""
    global _notifier
    if _notifier is None:
        _notifier = Notifier()
    return _notifier


def _address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()   # abstract namespace
    if value.startswith("/"):
        return value
    if value:
        log.warning("sd_notify: ignoring NOTIFY_SOCKET=%r (neither a path nor @name)", value)
    return None


def _watchdog_s(environ: Mapping[str, str]) -> float | None:
    """WATCHDOG_USEC in seconds, if the watchdog is meant for this process."""
    pid = environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None   # set for another process (the one that started this one)
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


def _one_line(text: str) -> str:
    return " ".join(text.split())
