"""Two hosts on one machine: two network namespaces joined by a veth pair.

Host "a" is 10.77.0.1/24 and host "b" 10.77.0.2/24, on the veth pair's two
ends and nowhere else: traffic between them crosses that link, as it would
cross a wire between two machines (each namespace also has its own loopback,
up, for what a host serves to itself). Processes run in a host through
`ip netns exec`; a function runs there in a thread that entered the
namespace (`TwoHosts.call`), so a test can speak HTTP to a host's loopback.

Needs root and iproute2 (`why_unavailable` says what is missing). Names carry
the process id, so concurrent test runs do not collide; `close()` deletes the
namespaces, and with them the veth pair.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import shutil
import subprocess
import uuid

ADDRESSES = {"a": "10.77.0.1", "b": "10.77.0.2"}
_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def why_unavailable() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"pdd-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    def __init__(self) -> None:
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.ns = {"a": f"pdd-a-{tag}", "b": f"pdd-b-{tag}"}
        self.addr = dict(ADDRESSES)
        self._threads: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        veth = f"pv{uuid.uuid4().hex[:8]}"   # interface names: at most 15 characters
        self.dev = {"a": veth + "a", "b": veth + "b"}

    def __enter__(self) -> "TwoHosts":
        try:
            for host in ("a", "b"):
                _ip("netns", "add", self.ns[host])
            _ip("link", "add", self.dev["a"], "netns", self.ns["a"], "type", "veth",
                "peer", "name", self.dev["b"], "netns", self.ns["b"])
            for host in ("a", "b"):
                ns = self.ns[host]
                _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", self.dev[host])
                _ip("-n", ns, "link", "set", self.dev[host], "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exec(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host`."""
        return ["ip", "netns", "exec", self.ns[host]]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.exec(host) + argv, **kw)

    def run(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec(host) + argv, **kw)

    def call(self, host: str, fn, *args, **kw):
        """fn(*args, **kw) in a thread that lives in `host`'s network namespace
        (sockets it opens are that host's): its result, or its exception."""
        pool = self._threads.get(host)
        if pool is None:
            pool = self._threads[host] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"netns-{host}", initializer=_enter, initargs=(self.ns[host],))
        return pool.submit(fn, *args, **kw).result()

    def close(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self._threads = {}
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)


def _enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (its own thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
