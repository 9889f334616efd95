"""Child processes that do not outlive the process that started them.

A parent killed with -9 (the OOM killer, say) runs no clean-up of its own: its
children would go on unsupervised, holding their ports. On Linux the child
asks the kernel to signal it when its parent dies (PR_SET_PDEATHSIG), then
checks that its parent is still the one that started it: a parent that died
before the request is not reported by the kernel.
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# `pdd up` puts its pid here in the environment of the `pdd serve` processes it starts.
SUPERVISOR_ENV = "PDD_SUPERVISOR_PID"


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent `parent_pid`
    dies; sent now if that parent is already gone. False where the kernel
    offers no such request (not Linux)."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:   # it died first: this process was handed to another parent
        log.warning("the process that started this one (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), sig)
    return True


def follow_supervisor(environ: Mapping[str, str] = os.environ) -> None:
    """In a `pdd serve` that `pdd up` started: stop when `pdd up` dies.

    SIGTERM, not SIGKILL: each process then takes the path a Ctrl-C of `pdd up`
    gives it (the router drains the streams in flight, a worker finishes its
    requests and says goodbye); the stop is bounded (the router's drain timeout,
    the worker's engine stop timeout)."""
    pid = environ.get(SUPERVISOR_ENV, "")
    if pid.isdigit():
        die_with_parent(int(pid), signal.SIGTERM)


def children(pid: int) -> list[tuple[int, list[bytes]]]:
    """The processes whose parent is `pid`, with their command lines (Linux's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")))
        except (OSError, ValueError, IndexError):   # gone meanwhile
            continue
    return found


def serving(argv: list[bytes], role: str, router: int | None = None) -> bool:
    """Whether a command line is `pdd serve --role ROLE` (of several routers: number `router`)."""
    return (b"--role" in argv and argv.index(b"--role") + 1 < len(argv) and argv[argv.index(b"--role") + 1] ==
            role.encode() and (router is None or f"router.index={router}".encode() in argv))
