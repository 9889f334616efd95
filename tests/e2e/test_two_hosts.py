"""Two hosts, for real (network namespaces joined by a veth pair:
tests/e2e/netns.py).

A cluster: the router and a prefill worker on host "a", a decode worker on
host "b", each role its own `pdd serve` with one shared config, as in
production. The control bus (CURVE over TCP) and the KV data plane cross the
link between the hosts; the router's HTTP and admin sockets stay on host a's
loopback. A disaggregated request must produce what the colocated engine
produces.

The cluster serves with worker.transfer_backend = "tcp", and with "auto",
which takes nixl between the hosts (both have the extra).

The nixl data plane between a prefill side on host a and a decode side on
host b. UCX is held to TCP on the link's device (UCX_TLS, UCX_NET_DEVICES):
one machine's namespaces share memory, which UCX would otherwise use, as it
cannot across machines."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdd import SamplingParams
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable
from tests.e2e import http_util
from tests.e2e.test_disagg_faults import _wait_for
from tests.e2e.netns import TwoHosts, why_unavailable
from tests.engine.helpers import random_prompts
from tests.transfer.conftest import make_layout, make_pool
from tests.transfer.peers import Peer, SenderPeer

pytestmark = pytest.mark.skipif(why_unavailable() is not None, reason=str(why_unavailable()))

HTTP_PORT, CONTROL_PORT, ADMIN_PORT, DATA_PORT = 8000, 7100, 7101, 7200


def connections(hosts: TwoHosts, host: str, local_port: int | None = None, remote_port: int | None = None,
                exclude_local: int | None = None, exclude_remote: int | None = None) -> set[str]:
    """The peer addresses of `host`'s established TCP connections, those on
    `local_port` / to `remote_port` (or all but those on `exclude_local` / to `exclude_remote`)."""
    out = hosts.run(host, ["ss", "-Htn", "state", "established"], capture_output=True, text=True,
                    check=True).stdout
    found = set()
    for line in out.splitlines():
        mine, theirs = line.split()[-2:]
        port_here, port_there = int(mine.rsplit(":", 1)[1]), int(theirs.rsplit(":", 1)[1])
        if ((local_port is None or port_here == local_port) and (remote_port is None or port_there == remote_port)
                and port_here != exclude_local and port_there != exclude_remote):
            found.add(theirs.rsplit(":", 1)[0])
    return found


class TwoHostCluster:
    """Router + prefill on host a, decode on host b; `backend` is worker.transfer_backend."""

    def __init__(self, hosts: TwoHosts, run_dir: Path, model: Path, backend: str):
        self.hosts, self.run_dir, self.model_name = hosts, run_dir, str(model)
        self.token = secrets.token_hex(16)
        keys = run_dir / "keys"
        subprocess.run([sys.executable, "-m", "pdd.cli", "keys", "generate", str(keys)], check=True,
                       capture_output=True)
        a, b = hosts.addr["a"], hosts.addr["b"]
        self.config = run_dir / "cluster.toml"
        self.config.write_text(f"""
[engine]
model = "{model}"
cpu_threads = 1

[router]
host = "127.0.0.1"
port = {HTTP_PORT}
control_addr = "tcp://{a}:{CONTROL_PORT}"
admin_addr = "tcp://127.0.0.1:{ADMIN_PORT}"
mode = "disagg"

[worker]
router_addr = "tcp://{a}:{CONTROL_PORT}"
data_addr = "tcp://{b}:{DATA_PORT}"
transfer_backend = "{backend}"

[security]
keys_dir = "{keys}"
""")
        self.url = f"http://127.0.0.1:{HTTP_PORT}"
        self.procs: dict[str, subprocess.Popen] = {}

    def _serve(self, host: str, role: str, worker_id: str | None = None) -> None:
        name = worker_id or role
        argv = [sys.executable, "-m", "pdd.cli", "--log-level", "INFO", "serve", "--role", role,
                "--config", str(self.config)] + (["--worker-id", worker_id] if worker_id else [])
        # UCX held to TCP on the link (nixl): what each host runs sees only its end.
        ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.hosts.dev[host]}
        with open(self.run_dir / f"{name}.log", "ab") as log:
            self.procs[name] = self.hosts.popen(host, argv, stdout=log, stderr=subprocess.STDOUT,
                                                env={**self._env(), **ucx})

    def _env(self) -> dict:
        import os
        return {**os.environ, "PDD_ROUTER__ADMIN_TOKEN": self.token}

    def start(self, timeout_s: float = 300.0) -> "TwoHostCluster":
        self._serve("a", "router")
        self._serve("a", "prefill", "prefill-a")
        self._serve("b", "decode", "decode-b")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            assert not dead, f"{dead} exited during start-up:\n{self.logs()}"
            try:
                if self.get("/health").json().get("workers", 0) >= 2:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"cluster not ready after {timeout_s:.0f}s:\n{self.logs()}")

    def get(self, path: str) -> http_util.Reply:
        return self.hosts.call("a", http_util.get, self.url + path)

    def post(self, path: str, body: dict) -> http_util.Reply:
        return self.hosts.call("a", http_util.post, self.url + path, body)

    def admin(self, cmd: str):
        out = self.hosts.run("a", [sys.executable, "-m", "pdd.cli", "admin", "--config", str(self.config), "--json",
                                   cmd], capture_output=True, text=True, env=self._env(), timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.run_dir.glob("*.log")))

    def stop(self) -> None:
        for name in ("router", "prefill-a", "decode-b"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture
def two_hosts():
    with TwoHosts() as hosts:
        yield hosts


@pytest.mark.parametrize("backend, chosen", [
    ("tcp", "tcp"),
    pytest.param("auto", "nixl", marks=pytest.mark.skipif(nixl_unavailable() is not None,
                                                           reason=str(nixl_unavailable())))])
def test_a_cluster_across_two_hosts_serves_what_colocated_does(two_hosts, tmp_path, tiny_model, offline, backend,
                                                               chosen):
    cluster = TwoHostCluster(two_hosts, tmp_path, tiny_model, backend).start()
    try:
        workers = {w["worker_id"]: w for w in cluster.admin("workers")}
        assert chosen in workers["prefill-a"]["transfer_backends"]
        assert workers["prefill-a"]["transfer_to"]["decode-b"]["backend"] == chosen
        if chosen == "nixl":   # auto across hosts: nixl, both having the extra
            assert workers["prefill-a"]["transfer_to"]["decode-b"]["reason"] == "both take nixl, two hosts"
        prompts = random_prompts([5, 17, 40], seed=3)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        expected = offline.generate(prompts, [params] * len(prompts))
        for prompt, exp in zip(prompts, expected):
            reply = cluster.post("/v1/completions", {"model": cluster.model_name, "prompt": prompt,
                                                     "max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
            assert reply.status == 200, reply.body
            assert reply.json()["choices"][0]["text"] == exp.text
        # PrefillDone may come after the answer, and the workers' stats with their heartbeats.
        _wait_for(lambda: cluster.metric("pdd_kv_transfer_blocks_sent_total") > 0, 30.0, "transfers counted")
        assert cluster.metric("pdd_disagg_fallbacks_total") == 0
        # The pages crossed the link: host b's data socket has host a as its peer
        # (over nixl, for the one-sided control), and the decode worker's control
        # connection goes the other way.
        assert connections(two_hosts, "b", local_port=DATA_PORT) == {two_hosts.addr["a"]}
        assert connections(two_hosts, "b", remote_port=CONTROL_PORT) == {two_hosts.addr["a"]}
        def transfer() -> dict:
            return next(w for w in cluster.admin("workers") if w["worker_id"] == "decode-b")["transfer"]
        def writers() -> int:
            return transfer().get("nixl_writers", 0)
        if chosen == "nixl":   # the pages were NIXL writes, over UCX's own connections across the link
            _wait_for(lambda: writers() >= 3, 30.0, "three nixl writes reported")
            # auto with the data socket on a routable address reserved the landing region: the pages landed there.
            _wait_for(lambda: transfer()["nixl_landed"] >= 3, 30.0, "three requests copied in from the region")
            assert transfer()["nixl_landing_bytes"] > 0
            assert two_hosts.addr["a"] in connections(two_hosts, "b", exclude_local=DATA_PORT,
                                                      exclude_remote=CONTROL_PORT)
        else:
            assert writers() == 0
    finally:
        cluster.stop()
    assert all(p.returncode is not None for p in cluster.procs.values())


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_nixl_writes_cross_the_link_between_two_hosts(two_hosts):
    layout = make_layout()
    ucx = {host: {"UCX_TLS": "tcp", "UCX_NET_DEVICES": two_hosts.dev[host]} for host in ("a", "b")}
    decode = Peer(layout, backend="nixl", addr=f"tcp://{two_hosts.addr['b']}:{DATA_PORT}",
                  prefix=two_hosts.exec("b"), env=ucx["b"])
    try:
        prefill = SenderPeer(layout, "nixl", seed=1, prefix=two_hosts.exec("a"), env=ucx["a"])
        try:
            lease = decode("grant", "x1", [1, 2, 3, 7], 30)
            prefill("send", dict(request_id="x1", lease_id=lease, dst_worker="decode-b", dst_addr=decode.address,
                                 dst_block_ids=(1, 2, 3, 7), backend="nixl"), [4, 5, 6, 0])
            prefill("finish", "x1")
            r = prefill("result", "x1")
            assert r.ok, r.error
            assert r.descriptors == layout.num_layers * 2 * 2     # runs [1, 2, 3] and [7]: k and v of each
            assert torch.equal(decode("pool")[:, :, [1, 2, 3, 7]], make_pool(layout, seed=1)[:, :, [4, 5, 6, 0]])
            assert decode("close", lease) == "free"
            # UCX's own connections (not the data socket's) join host b to host a over the link.
            assert two_hosts.addr["a"] in connections(two_hosts, "b", exclude_local=DATA_PORT)
        finally:
            prefill.stop()
    finally:
        decode.stop()
