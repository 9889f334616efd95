"""The children of `pdd up` (pdd.launcher): the router(s) and the workers started as
`pdd serve` processes, each with its environment (device, share of a GPU, CPU
threads), watched until the cluster is ready, restarted, and stopped in order:
the routers first (they drain), then the workers."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdd import sdnotify
from pdd.config import ClusterConfig
from pdd.config_loader import dump_toml
from pdd.lifetime import SUPERVISOR_ENV
from pdd.run_dir import claim_run_dir, run_dir_keys
from pdd.security import write_private

STOP_TIMEOUT_S = 40.0
# A worker that exits this many times within the window is given up on, and the
# cluster stops (as systemd's StartLimitBurst/StartLimitIntervalSec): a crash
# loop, not the odd death over a long life.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 120.0
# Keys of the HTTP API from the environment: the generated config holds them
# with those of the flags, and the children read that config, not this variable.
API_KEYS_ENV = "PDD_SECURITY__API_KEYS"


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    args: list[str]
    env: dict | None
    log_start: int = 0            # the size of its log when this process of it started
    restarts: int = 0
    restarted_at: list[float] = dataclasses.field(default_factory=list)   # monotonic, within the window

    def crash_looping(self, now: float) -> bool:
        """Restarted MAX_RESTARTS times within RESTART_WINDOW_S of `now`."""
        self.restarted_at = [t for t in self.restarted_at if now - t < RESTART_WINDOW_S]
        return len(self.restarted_at) >= MAX_RESTARTS


def last_error(log: Path, start: int = 0) -> str | None:
    """Why a child stopped, as it said it last in its log from `start` on (text
    or JSON lines): a line it printed as `pdd serve: ...`, or the message of its
    last ERROR or CRITICAL record. None if it said nothing of the kind."""
    try:
        with open(log, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("pdd serve: "):
            return line.removeprefix("pdd serve: ")
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("ERROR", "CRITICAL"):
                return str(record.get("msg", ""))
            continue
        parts = line.split(" ", 3)    # date, time, level, "logger: message"
        if len(parts) == 4 and parts[2] in ("ERROR", "CRITICAL"):
            return parts[3].partition(": ")[2] or parts[3]
    return None


def cpu_threads_each(cfg: ClusterConfig, workers: list[tuple[str, str, str | None]],
                     cores: int | None = None) -> int:
    """Torch threads for each worker that runs on the CPU: this host's cores
    shared among them and the router, which relays every token and must not
    wait for a core (0: leave torch's default, as the config or the
    environment already set it, or no worker is on the CPU)."""
    if cfg.engine.cpu_threads or "PDD_ENGINE__CPU_THREADS" in os.environ or cfg.engine.device.startswith("cuda"):
        return 0
    on_cpu = [w for w in workers if not (w[2] or "cpu").startswith("cuda")]
    if not on_cpu:
        return 0
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // (len(on_cpu) + 1))


class Cluster:
    def __init__(self, cfg: ClusterConfig, workers: list[tuple[str, str, str | None]], run_dir: Path):
        """workers: (role, worker_id, device or None)."""
        self.cfg = cfg
        self.workers = workers
        self.run_dir = run_dir
        self.children: list[Child] = []
        self.config_path = run_dir / "cluster.toml"
        self.lock_fd: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.router.host}:{self.cfg.router.port}"

    @property
    def router_names(self) -> list[str]:
        """The routers' child names: "router", or router-0, router-1, ... for several."""
        n = len(self.cfg.router.routers)
        return ["router"] if n == 1 else [f"router-{i}" for i in range(n)]

    def _popen(self, name: str, args: list[str], env: dict | None) -> tuple[subprocess.Popen, int]:
        """The child started, and where in its log (appended at each start) it begins writing."""
        with open(self.run_dir / f"{name}.log", "ab") as log:
            start = log.tell()
            # The level as `up` resolved it (flag, env, config): a child's environment must not undo a flag.
            # -P: the working directory is not put first on sys.path, so a folder
            # named `pdd` where `up` was started cannot stand in for the package.
            cmd = [sys.executable, "-P", "-m", "pdd.cli", "--log-level", self.cfg.log.level,
                   "serve", "--config", str(self.config_path), *args]
            # NOTIFY_SOCKET and the watchdog are this process's to answer, not its children's.
            child_env = {k: v for k, v in os.environ.items() if k != API_KEYS_ENV and k not in sdnotify.ENV_VARS}
            child_env.update(env or {})
            child_env[SUPERVISOR_ENV] = str(os.getpid())   # it stops if this process dies
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                    start_new_session=True)
            return proc, start

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> None:
        proc, start = self._popen(name, args, env)
        self.children.append(Child(name, proc, args, env, start))

    def forget(self, child: Child) -> None:
        """Supervise `child` no more (it exited and is not to be restarted)."""
        self.children.remove(child)

    def restart(self, child: Child) -> None:
        child.restarts += 1
        child.restarted_at.append(time.monotonic())
        child.proc, child.log_start = self._popen(child.name, child.args, child.env)

    def claim(self) -> None:
        """The run directory made or checked, and locked for this process
        (RunDirBusy, RunDirRefused); the keys it holds checked."""
        self.lock_fd = claim_run_dir(self.run_dir, f"pdd up pid {os.getpid()} ({self.url})")
        self.cfg = self._with_defaults(self.cfg)

    def start(self) -> None:
        """The children, each stopped (SIGTERM) by the kernel if the thread
        that starts it dies (pdd.lifetime): start and restart them from one
        thread that lives as long as the cluster."""
        if self.lock_fd is None:
            self.claim()
        write_private(self.config_path, dump_toml(self.cfg))
        for i, name in enumerate(self.router_names):
            self._spawn(name, ["--role", "router", "--set", f"router.index={i}"])
        envs = worker_envs(self.cfg, self.workers)
        for role, wid, _ in self.workers:
            self._spawn(wid, ["--role", role, "--worker-id", wid], envs[wid])

    def _with_defaults(self, cfg: ClusterConfig) -> ClusterConfig:
        """`cfg` with what the config leaves out: a fresh key set, a random admin
        token, the run dir as the router's state dir."""
        sec, router = cfg.security, cfg.router
        if not sec.keys_dir and not sec.insecure:
            sec = dataclasses.replace(sec, keys_dir=str(run_dir_keys(self.run_dir, len(router.routers))))
        if not router.admin_token:
            router = dataclasses.replace(router, admin_token=secrets.token_hex(16))
        if not router.state_dir:   # drains outlive a router the cluster restarts
            router = dataclasses.replace(router, state_dir=str(self.run_dir.resolve()))
        return dataclasses.replace(cfg, security=sec, router=router)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def wait_ready(self, timeout_s: float, stopping=lambda: False) -> None:
        """Until every router reports every worker; RuntimeError if a child dies, time
        runs out, or `stopping()` says a signal came (a cluster that never gets
        ready must still stop on Ctrl-C)."""
        deadline = time.monotonic() + timeout_s
        want = len(self.workers)
        while time.monotonic() < deadline:
            if stopping():
                raise RuntimeError("stopped by a signal before the cluster was ready")
            dead = self.dead_child()
            if dead is not None:
                log = self.run_dir / (dead.name + ".log")
                why = last_error(log, dead.log_start)
                raise RuntimeError(f"{dead.name} exited with code {dead.proc.returncode} during start-up"
                                   f"{': ' + why if why else ''}; see {log}")
            if all(n >= want for n in self.registered()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready after {timeout_s:.0f}s; logs in {self.run_dir}")

    def registered(self) -> list[int]:
        """How many workers each router has registered (0 for one not answering)."""
        if len(self.router_names) == 1:
            health = urllib.request.Request(self.url + "/health")
            if self.cfg.security.api_keys:  # in case /health is not among the open paths
                health.add_header("Authorization", f"Bearer {self.cfg.security.api_keys[0]}")
            try:
                with urllib.request.urlopen(health, timeout=1) as r:
                    return [json.loads(r.read()).get("workers", 0)]
            except OSError:
                return [0]
        # The port is shared (SO_REUSEPORT picks a router per connection): ask each on its admin socket.
        from pdd.admin.client import AdminError, call_with_config
        counts = []
        for i in range(len(self.router_names)):
            try:
                counts.append(len(call_with_config(self.cfg, "workers", timeout_s=1.0, router=i)))
            except AdminError:
                counts.append(0)
        return counts

    def stop(self) -> None:
        """Router first (drains in-flight requests), then the workers."""
        router = [c for c in self.children if c.name in self.router_names]
        rest = [c for c in self.children if c.name not in self.router_names]
        for group in (router, rest):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()


def worker_envs(cfg: ClusterConfig, workers: list[tuple[str, str, str | None]]) -> dict[str, dict[str, str]]:
    """What each worker's environment adds to this process's: its device, its
    share of a GPU it shares, its CPU threads, its part in adaptive placement."""
    threads = cpu_threads_each(cfg, workers)
    sharing = collections.Counter(device for _, _, device in workers if device)
    engine = cfg.engine
    envs = {}
    for role, wid, device in workers:
        env = {"PDD_ENGINE__DEVICE": device} if device else {}
        if sharing[device] > 1 and engine.kv_cache_bytes is None and engine.num_blocks is None:
            # Workers sharing one GPU split its utilization target between them.
            env["PDD_ENGINE__GPU_MEMORY_UTILIZATION"] = f"{engine.gpu_memory_utilization / sharing[device]:.4f}"
        if threads and not (device or "cpu").startswith("cuda"):
            env["PDD_ENGINE__CPU_THREADS"] = str(threads)
        if role == "colocated" and cfg.router.mode == "adaptive":
            # Adaptive placement moves these between prefill and decode work.
            env["PDD_WORKER__PREFILL_FOR_OTHERS"] = "true"
        envs[wid] = env
    return envs
