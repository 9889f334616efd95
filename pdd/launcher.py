"""`pdd up`: a whole local cluster from one command.

Starts the router and the workers as child processes (the same `pdd serve`
a systemd unit runs), waits until the router reports every worker ready (a
child that exits first stops the start, with the error it logged last: an
address in use, say), prints the URL, and on SIGINT/SIGTERM shuts down in order: the router drains
(finishes what is in flight, refuses new requests), then the workers stop.
A worker that dies is restarted (as systemd's Restart=on-failure would; the
router moves its requests meanwhile); if the router dies, `up` stops and fails.

Unless the config names keys (or waives them), the cluster gets a CURVE key
set of its own in the run directory (made at the first start, used again
after) and a random admin token at each start; the config, which holds the
token and API keys, is written 0600. What `up` does to the run directory, and
how it keeps one cluster to it: pdd.run_dir. Before it touches any file, `up`
makes sure the router's addresses are free: a second `pdd up` on a running
cluster's port changes nothing of it.

The children die with `up`, however it ends (pdd.lifetime): a `pdd up` killed
with -9 leaves no router or worker running unsupervised.

This module is the command: the cluster `up` plans from its flags and the config,
and the loop that supervises it; pdd.supervisor starts, restarts and stops the children.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import time
from collections.abc import Collection
from pathlib import Path

from pdd import sdnotify
from pdd.config import EXIT_REFUSED, EXIT_REPLACED, ClusterConfig
from pdd.config_loader import load_cluster_config
from pdd.run_dir import RunDirBusy, RunDirRefused
from pdd.security import admin_token_problem, read_secret_file
from pdd.supervisor import API_KEYS_ENV, STOP_TIMEOUT_S, Cluster


_handed_out: set[int] = set()


def free_port(avoid: Collection[int] = ()) -> int:
    """A loopback port free now, never one this process handed out before nor
    one of `avoid`: the kernel may give a port that was picked and closed
    again to the next bind to port 0, and a cluster's addresses must differ."""
    held = []
    try:
        while True:
            s = socket.socket()
            held.append(s)   # open until the end: the next bind gets another port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _handed_out and port not in avoid:
                _handed_out.add(port)
                return port
    finally:
        for s in held:
            s.close()


def address_in_use(cfg: ClusterConfig) -> str | None:
    """Which TCP address the router of `cfg` listens on is taken, if one is (as "port 8000")."""
    wanted = [(f"port {cfg.router.port}", cfg.router.host, cfg.router.port)]
    wanted += [(f"router.http_ports {p}", cfg.router.host, p) for p in cfg.router.http_ports]
    for control, admin in cfg.router.routers:
        for key, addr in (("control_addr", control), ("admin_addr", admin)):
            host, _, port = addr.removeprefix("tcp://").rpartition(":")
            if addr.startswith("tcp://") and port.isdigit() and int(port):
                wanted.append((f"router.{key} {addr}", host.strip("[]").replace("*", ""), int(port)))
    for name, host, port in wanted:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE)[0]
        except socket.gaierror:
            continue   # the router names what is wrong with it
        with socket.socket(family, kind, proto) as s:
            # As the router binds: a port whose last connections linger in TIME_WAIT is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return name
    return None


def build_cluster(args) -> Cluster:
    overrides: dict = {"engine": {}, "router": {}, "log": {}}
    if getattr(args, "log_level", None):
        overrides["log"]["level"] = args.log_level
    if args.model:
        overrides["engine"]["model"] = args.model
    if getattr(args, "served_model_name", None):
        overrides["router"]["served_model_name"] = args.served_model_name
    overrides["router"]["port"] = args.port
    # A P+D layout runs the router in auto: disaggregated while it can be, a local
    # prefill on the decode worker when it cannot (breaker open, no prefill worker).
    # --adaptive: either layout, placement priced per request (pdd.router.placement).
    if getattr(args, "adaptive", False):
        overrides["router"]["mode"] = "adaptive"
    else:
        overrides["router"]["mode"] = "colocated" if args.mode == "colocated" else "auto"
    if getattr(args, "tool_call_parser", None):
        overrides["router"]["tool_call_parser"] = args.tool_call_parser
    if getattr(args, "reasoning_parser", None):
        overrides["router"]["reasoning_parser"] = args.reasoning_parser
    base = load_cluster_config(args.config) if args.config else load_cluster_config()
    # Fresh loopback ports for the control and admin sockets unless the config
    # names them, so two clusters (or a test run) on one host never collide.
    routers = getattr(args, "routers", 1)
    if routers < 1:
        raise ValueError(f"--routers: want at least one router, got {routers}")
    if not args.config:
        named = {args.port}   # (the port another process picked for us may come back from the kernel)
        control = [f"tcp://127.0.0.1:{free_port(named)}" for _ in range(routers)]
        admin = [f"tcp://127.0.0.1:{free_port(named)}" for _ in range(routers)]
        overrides["router"]["control_addr"], overrides["router"]["admin_addr"] = control[0], admin[0]
        if routers > 1:
            overrides["router"]["control_addrs"], overrides["router"]["admin_addrs"] = control, admin
            overrides["router"]["http_ports"] = [free_port(named) for _ in range(routers)]
    elif routers > 1 and len(base.router.routers) != routers:
        raise ValueError(f"--routers {routers}: {args.config} names {len(base.router.routers)} router(s); "
                         "list every router in router.control_addrs and router.admin_addrs (or drop --routers)")
    why = base.router.admin_token and admin_token_problem(base.router.admin_token)
    if why:
        raise ValueError(f"{args.config}: {why}; remove it (pdd up makes a random one) or set a random one")
    overrides["security"] = {"api_keys": _api_keys(args, base)}
    cfg = load_cluster_config(args.config, env={k: v for k, v in os.environ.items() if k != API_KEYS_ENV},
                              overrides=overrides)
    workers = _plan_workers(args, cfg)
    path = Path(args.run_dir or Path.home() / ".cache" / "pdd" / "run" / f"up-{cfg.router.port}")
    return Cluster(cfg, workers, path)


def _api_keys(args, base: ClusterConfig) -> list[str]:
    """Every HTTP API key given, in order, once: the config's (its file or
    PDD_SECURITY__API_KEYS), each --api-key-file's, each --api-key."""
    keys = list(base.security.api_keys)
    for path in getattr(args, "api_key_file", None) or []:
        keys += read_secret_file(path, "--api-key-file")
    if getattr(args, "api_key", None):
        print("pdd up: warning: --api-key puts the key on the command line, where every user of this host can "
              f"read it (ps); use --api-key-file FILE or {API_KEYS_ENV}", file=sys.stderr)
        keys += args.api_key
    return list(dict.fromkeys(keys))


def _plan_workers(args, cfg: ClusterConfig) -> list[tuple[str, str, str | None]]:
    devices = _devices(cfg)
    if args.mode == "disagg":
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    else:
        roles = ["colocated"] * args.workers
    plan, per_role = [], {}
    for i, role in enumerate(roles):
        n = per_role[role] = per_role.get(role, -1) + 1
        device = devices[i % len(devices)] if devices else None
        plan.append((role, f"{role}-{n}", device))
    return plan


# Device nodes of a GPU driver (NVIDIA, and AMD's for a ROCm torch): without any,
# there is no GPU to count, and importing torch to say so costs seconds of every start.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd")


def _devices(cfg: ClusterConfig) -> list[str]:
    """One GPU per worker when there are GPUs and the config does not pin a device."""
    if cfg.engine.device not in ("auto", "cuda"):
        return []
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return []
    try:
        import torch
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def main(args) -> int:
    cluster = build_cluster(args)
    busy = address_in_use(cluster.cfg)
    if busy:
        # Exit 1, as `pdd serve` on an address in use: a later try may find it free.
        other = "--port" if busy.startswith("port") else "address in --config"
        print(f"pdd up: {busy} is in use (another pdd up, or another server?); nothing was changed; "
              f"stop that one or pick another {other}", file=sys.stderr)
        return 1
    try:
        cluster.claim()
    except (RunDirBusy, RunDirRefused) as e:
        print(f"pdd up: {e}", file=sys.stderr)
        return 1 if isinstance(e, RunDirBusy) else EXIT_REFUSED
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    try:
        cluster.wait_ready(args.ready_timeout, lambda: stop["signal"] is not None)
    except RuntimeError as e:
        print(f"pdd up: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    print(f"pdd up: ready at {cluster.url}/v1  ({len(cluster.workers)} worker(s), logs in {cluster.run_dir})")
    print(f"pdd up: admin: pdd admin --config {cluster.config_path} status", flush=True)
    notify = sdnotify.notifier()
    notify.ready(f"serving {cluster.url}/v1 with {len(cluster.workers)} worker(s)")
    pinged = time.monotonic()
    code = 0
    while stop["signal"] is None:
        if notify.ping_interval_s and time.monotonic() - pinged >= notify.ping_interval_s:
            notify.status(f"serving {cluster.url}/v1", watchdog=True)   # from the loop that supervises
            pinged = time.monotonic()
        dead = cluster.dead_child()
        if dead is not None and dead.proc.returncode == EXIT_REPLACED:
            # Another process serves under its worker id now: the cluster goes on
            # with that one, and restarting this one would replace it in turn.
            print(f"pdd up: {dead.name} was replaced by another process registered under its worker id; "
                  "no longer supervising it", file=sys.stderr)
            notify.status(f"serving {cluster.url}/v1; {dead.name} replaced by another process")
            cluster.forget(dead)
            continue
        # The one router is the cluster's front door; one of several is restarted as a worker is.
        if dead is not None and (dead.name == "router" or dead.crash_looping(time.monotonic())
                                 or dead.proc.returncode == EXIT_REFUSED):
            print(f"pdd up: {dead.name} exited with code {dead.proc.returncode}; stopping the cluster",
                  file=sys.stderr)
            code = 1
            break
        if dead is not None:
            print(f"pdd up: {dead.name} exited with code {dead.proc.returncode}; restarting it", file=sys.stderr)
            notify.status(f"serving {cluster.url}/v1; restarted {dead.name} (exit {dead.proc.returncode})")
            cluster.restart(dead)
        time.sleep(0.2)
    print("pdd up: stopping (router drains first)", flush=True)
    notify.stopping("stopping: the router drains first", within_s=2 * STOP_TIMEOUT_S)
    cluster.stop()
    return code
