"""A real local cluster for tests: `pdd up` in a subprocess, on loopback ports."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

from pdd import lifetime
from pdd.admin.client import call_with_config
from pdd.bench.layouts import interrupt
from pdd.config_loader import load_cluster_config
from pdd.launcher import free_port
from pdd.security import control_security


class UpCluster:
    """`pdd up` with `args` on a free port. `with UpCluster(...) as c:` starts
    it, and at the end stops it and asserts a clean exit (the logs otherwise)."""

    def __init__(self, run_dir: Path, model: Path, *args: str, start_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.run_dir = run_dir
        self.cwd = cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # -P: `up` itself imports the installed pdd wherever it is started (`cwd`).
        self.cmd = [sys.executable, "-P", "-m", "pdd.cli", "up", "--model", str(model), "--port", str(self.port),
                    "--run-dir", str(run_dir), *args]
        self.start_timeout_s = start_timeout_s
        self.lines: queue.Queue[str] = queue.Queue()
        self.model_name = str(model)   # served as given, as vLLM serves under its --model
        self.env = env or {}

    def start(self) -> "UpCluster":
        env = {**os.environ, "PDD_LOG_LEVEL": "INFO", **self.env}
        if not torch.cuda.is_available():
            # Named, so that `pdd up` need not import torch to count no GPU before
            # it starts a child (seconds of every start on a busy 2-core box); the
            # workers run on the CPU either way. `pdd up` without a device is
            # tested where it is run directly (tests/test_up_safety.py).
            env.setdefault("PDD_ENGINE__DEVICE", "cpu")
        # The router's own saturation limits read its loop's lag, which a busy 2-core
        # box's scheduler makes half a second now and then: a test that asserts 200s
        # must not meet a 429 for that. Tests of those limits set them
        # (tests/e2e/test_load_admission.py; tests/router/test_saturation.py).
        for limit in ("PDD_ROUTER__MAX_LOOP_LAG_S", "PDD_ROUTER__MAX_INBOUND_LAG_S"):
            env.setdefault(limit, "0")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=self.cwd)
        threading.Thread(target=self._pump, daemon=True).start()
        seen = []
        for line in self._lines_for(self.start_timeout_s):
            seen.append(line)
            if "ready at" in line:
                self.cfg = load_cluster_config(self.run_dir / "cluster.toml")
                return self
        self.stop()
        raise RuntimeError(f"cluster did not start: {''.join(seen)}\n{self.logs()}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def _lines_for(self, timeout_s: float):
        """`pdd up`'s own output lines as they come, until `timeout_s` passes or it exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                yield self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    return

    def wait_line(self, text: str, timeout_s: float = 120.0) -> str:
        """The next line of `pdd up`'s own output that holds `text` (AssertionError
        with the logs if none comes in time, or `up` exits)."""
        for line in self._lines_for(timeout_s):
            if text in line:
                return line
        raise AssertionError(f"pdd up never said {text!r}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.run_dir.glob("*.log")))

    def admin(self, cmd: str, *args, router: int = 0):
        """An admin command to one router (of several: `router`), with the cluster's
        admin key and token (from its cluster.toml)."""
        return call_with_config(self.cfg, cmd, *args, router=router)

    def router_url(self, i: int) -> str:
        """Router i's own HTTP address (`--routers N`: router.http_ports)."""
        return f"http://127.0.0.1:{self.cfg.router.http_ports[i]}"

    def control_socket(self, identity: bytes) -> zmq.Socket:
        """A DEALER on the control bus with the cluster's worker key: an
        authenticated peer, free to send anything (tests of what the router drops)."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        keys = control_security(self.cfg, "worker")
        if keys is not None:
            keys.dial(sock)
        sock.connect(self.cfg.router.control_addr)
        return sock

    def workers(self, router: int = 0) -> dict[str, dict]:
        return {w["worker_id"]: w for w in self.admin("workers", router=router)}

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Until no request is in flight and every worker reports all blocks free
        (a busy box's heartbeats may say so seconds late); the last reading either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.workers()
            idle = not self.admin("requests") and all(
                w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["num_blocks"]
                for w in workers.values())
            if idle or time.monotonic() > deadline:
                return workers
            time.sleep(0.05)

    def child_pid(self, role: str, router: int | None = None) -> int:
        """The pid of `pdd up`'s child running `pdd serve --role ROLE` (the router,
        say; of several, number `router`)."""
        for pid, argv in lifetime.children(self.proc.pid):
            if lifetime.serving(argv, role, router):
                return pid
        raise LookupError(f"no {role} child of pdd up ({self.proc.pid})")

    def restarted(self, role: str, old_pid: int, router: int | None = None) -> bool:
        """Whether `pdd up` runs a `pdd serve --role ROLE` child again under
        another pid than `old_pid` (False while none runs: between an exit and
        the restart that follows it)."""
        try:
            return self.child_pid(role, router) != old_pid
        except LookupError:
            return False

    def stop(self) -> int:
        return interrupt(self.proc, 60.0)

    def __enter__(self) -> "UpCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        assert self.stop() == 0, self.logs()


def _wait_for(cond, timeout_s=20.0, what="condition"):
    """cond() until it is truthy (returned), or AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    return [child for child, _ in lifetime.children(pid)]
