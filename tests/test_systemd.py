"""pdd under systemd: the notify protocol as `pdd serve` and `pdd up` speak it
to a $NOTIFY_SOCKET this test binds in systemd's place (READY=1, WATCHDOG=1
only while there is progress, STOPPING=1 with the drain the config allows),
the worker instance names a unit may carry, and the units as
scripts/install-systemd installs them into a temporary root, checked with
systemd-analyze (verify; security --offline=yes)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from pdd.admin.client import call_with_config
from pdd.bench.layouts import interrupt
from pdd.config import EXIT_REFUSED, ConfigError
from pdd.config_loader import load_cluster_config
from pdd.launcher import free_port
from pdd.sdnotify import Notifier
from pdd.security import generate_keys
from pdd.serve import ROUTER_STOP_MARGIN_S, parse_instance
from pdd.worker.worker import ENGINE_STOP_TIMEOUT_S, STOP_MARGIN_S
from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg_faults import _wait_for
from tests.security.test_processes import pdd, write_config

REPO = Path(__file__).resolve().parent.parent
WATCHDOG_USEC = 2_000_000   # a ping every second
MAX_EXPOSURE = 3.0


class NotifySocket:
    """systemd's end of the protocol: a unix datagram socket (abstract
    namespace) that keeps every datagram in arrival order with its sender's
    pid, as the kernel reports it (SO_PASSCRED)."""

    def __init__(self):
        self.name = f"@pdd-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(b"\0" + self.name[1:].encode())
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, dict[str, str]]] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.name, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def _read(self) -> None:
        while not self._closed:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except (TimeoutError, OSError):
                continue
            pid = next((struct.unpack("iII", d)[0] for level, kind, d in anc
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((pid, fields))

    def mark(self) -> int:
        """Sends a datagram of its own: those received after it were sent after this call."""
        token = uuid.uuid4().hex
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"MARK={token}".encode(), b"\0" + self.name[1:].encode())
        _wait_for(lambda: any(f.get("MARK") == token for _, f in self.messages), 10.0, "the mark")
        return next(i for i, (_, f) in enumerate(self.messages) if f.get("MARK") == token)

    def index(self, key: str, value: str | None = None, after: int = -1) -> int | None:
        """The first message after index `after` that carries `key` (with `value`)."""
        for i, (_, fields) in enumerate(self.messages):
            if i > after and key in fields and (value is None or fields[key] == value):
                return i
        return None

    def wait(self, key: str, value: str | None = None, after: int = -1, what: str = "") -> int:
        found: list[int] = []

        def arrived() -> bool:
            i = self.index(key, value, after)
            found.append(i)
            return i is not None
        _wait_for(arrived, 120.0, what or f"{key}={value}")
        return found[-1]

    def fields(self, i: int) -> dict[str, str]:
        return self.messages[i][1]

    def senders(self) -> set[int]:
        return {pid for pid, fields in self.messages if "MARK" not in fields}

    def close(self) -> None:
        self._closed = True
        self._reader.join()
        self.sock.close()


@pytest.fixture
def notify_sockets():
    made: list[NotifySocket] = []

    def make() -> NotifySocket:
        made.append(NotifySocket())
        return made[-1]

    yield make
    for s in made:
        s.close()


# ---------------------------------------------------------------- the protocol

def test_a_notifier_sends_datagrams_only_where_notify_socket_is_set(notify_sockets):
    sock = notify_sockets()
    n = Notifier({**sock.env(), "WATCHDOG_PID": str(os.getpid())})
    assert n.ping_interval_s == WATCHDOG_USEC / 2e6
    n.ready("serving")
    n.status("serving", watchdog=True)    # the same status: not sent again
    n.stopping("draining", within_s=1.5)
    sock.wait("EXTEND_TIMEOUT_USEC")
    assert [f for _, f in sock.messages] == [
        {"READY": "1", "STATUS": "serving"}, {"WATCHDOG": "1"},
        {"STOPPING": "1", "STATUS": "draining", "EXTEND_TIMEOUT_USEC": "1500000"}]
    assert sock.senders() == {os.getpid()}
    # The watchdog of another process (the one that started this one) is not this one's.
    assert Notifier({**sock.env(), "WATCHDOG_PID": "1"}).ping_interval_s is None
    assert not Notifier({}).send("READY=1")


def test_a_worker_instance_is_role_dash_number():
    assert parse_instance("decode-0") == ("decode", "decode-0")
    assert parse_instance("colocated-12") == ("colocated", "colocated-12")
    for bad in ("router-0", "decode", "decode-", "decode-x", "gpu1", "prefill-0-extra"):
        with pytest.raises(ConfigError, match="expected ROLE-N"):
            parse_instance(bad)


@pytest.mark.parametrize("instance", ["router-0", "decode-one"])
def test_a_worker_unit_named_otherwise_exits_78_in_one_line(instance):
    """78 is in the units' RestartPreventExitStatus: no restart loop."""
    r = subprocess.run(pdd("serve", "--instance", instance), capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED
    assert r.stderr.strip().splitlines() == [
        f"pdd serve: worker instance {instance!r}: expected ROLE-N, ROLE one of colocated, prefill, decode and N a "
        "number unique in the cluster (e.g. pdd-worker@decode-0)"]


@pytest.mark.parametrize("key", ["router.drain_timeout_s", "worker.drain_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, float("inf")])
def test_drain_deadlines_are_checked(key, value):
    table, name = key.split(".")
    with pytest.raises(ConfigError, match=key):
        load_cluster_config(env={}, overrides={table: {name: value}})


# ---------------------------------------------------------------- pdd serve, pdd up

class Serve:
    """A `pdd serve` process with its own notify socket."""

    def __init__(self, args: list[str], log: Path, sock: NotifySocket):
        self.sock = sock
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(pdd("serve", *args), stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, **sock.env()})

    def stop(self) -> int:
        return interrupt(self.proc, 120, signal.SIGTERM)


def test_pdd_serve_is_ready_then_pings_and_a_hung_engine_falls_silent(tmp_path, tiny_model, notify_sockets):
    path = write_config(
        tmp_path / "pdd.toml", engine={"model": str(tiny_model), "device": "cpu", "cpu_threads": 1},
        router={"port": free_port(), "control_addr": f"tcp://127.0.0.1:{free_port()}",
                "admin_addr": f"tcp://127.0.0.1:{free_port()}", "admin_token": "t" * 32,
                "allow_fault_injection": True, "drain_timeout_s": 3.0},
        # A step running 5 s is a hang (a busy 2-core box has seen real steps of 2.4 s).
        worker={"step_timeout_s": 5.0, "drain_timeout_s": 7.0},
        security={"keys_dir": str(generate_keys(tmp_path / "keys"))})
    cfg = load_cluster_config(path, env={})
    router = Serve(["--role", "router", "--config", str(path)], tmp_path / "router.log", notify_sockets())
    worker = Serve(["--instance", "colocated-0", "--config", str(path)], tmp_path / "worker.log", notify_sockets())
    answer: list[int] = []
    try:
        for p in (router, worker):
            ready = p.sock.wait("READY", "1")
            p.sock.wait("WATCHDOG", "1", after=ready)
        assert "registered" in worker.sock.fields(worker.sock.index("READY"))["STATUS"]

        # The engine's first step blocks; the worker's event loop goes on (heartbeats).
        call_with_config(cfg, "faults", "set", "colocated.hang_after_steps=1", "colocated-0")
        _wait_for(lambda: call_with_config(cfg, "faults")["workers"].get("colocated-0"), 60.0, "the fault set")
        body = {"model": str(tiny_model), "prompt": "Hello", "max_tokens": 4}
        request = threading.Thread(target=lambda: answer.append(_post(cfg, body)), daemon=True)
        request.start()
        _wait_for(lambda: _worker(cfg)["hung"], 120.0, "the router declaring colocated-0 hung")
        # From the heartbeat that showed the hang on, no ping can be sent: two
        # watchdog rounds after the mark say so, and neither pinged.
        mark = worker.sock.mark()
        hung_rounds = worker.sock.wait("STATUS", after=mark, what="a watchdog round after the hang")
        hung_rounds = worker.sock.wait("STATUS", after=hung_rounds, what="a second round")
        assert "hung" in worker.sock.fields(hung_rounds)["STATUS"]
        assert worker.sock.index("WATCHDOG", after=mark) is None, worker.sock.messages[mark:]

        call_with_config(cfg, "faults", "clear", "colocated-0")   # the step goes on
        worker.sock.wait("WATCHDOG", "1", after=hung_rounds, what="pings again once the step went on")
        request.join(120)   # it failed meanwhile (no other worker to move it to): it only made a step run
        assert router.sock.senders() == {router.proc.pid} and worker.sock.senders() == {worker.proc.pid}

        # SIGTERM: STOPPING=1, and the stop's time as the config's drain makes it.
        assert worker.stop() == 0
        stopping = worker.sock.fields(worker.sock.wait("STOPPING", "1"))
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) == int((7.0 + ENGINE_STOP_TIMEOUT_S + STOP_MARGIN_S) * 1e6)
        assert router.stop() == 0
        stopping = router.sock.fields(router.sock.wait("STOPPING", "1"))
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) == int((3.0 + ROUTER_STOP_MARGIN_S) * 1e6)
    finally:
        worker.stop(), router.stop()
        print("--- router\n" + router.log.read_text()[-3000:] + "\n--- worker\n" + worker.log.read_text()[-3000:])


def _post(cfg, body: dict) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.router.port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _worker(cfg) -> dict:
    return next((w for w in call_with_config(cfg, "workers") if w["worker_id"] == "colocated-0"), {"hung": False})


def test_pdd_up_is_ready_once_the_cluster_serves_then_pings(tmp_path, tiny_model, notify_sockets):
    sock = notify_sockets()
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", env=sock.env()).start()
    try:
        ready = sock.wait("READY", "1")   # once the router reports the worker
        assert "serving" in sock.fields(ready)["STATUS"]
        sock.wait("WATCHDOG", "1", after=ready)
    finally:
        assert c.stop() == 0, c.logs()
    sock.wait("STOPPING", "1")
    # Its router and worker were not handed the socket: only `pdd up` speaks.
    assert sock.senders() == {c.proc.pid}


# ---------------------------------------------------------------- the install and the units

def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """systemd/NAME as {section: {key: [values, in order]}} (comments and blank lines left out)."""
    sections: dict[str, dict[str, list[str]]] = {}
    for line in (REPO / "systemd" / name).read_text().splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
        else:
            key, value = line.split("=", 1)
            section.setdefault(key, []).append(value)
    return sections


def test_a_router_unit_per_router_index_ordered_before_the_workers_of_its_host():
    """pdd-router@I runs router.index I (its own runtime directory; the host's
    state directory shared), and every pdd-router@I comes before
    pdd-routers.target, which the workers come after: at a stop of pdd.target
    the workers drain before any router of their host stops."""
    router, worker, routers = _unit("pdd-router@.service"), _unit("pdd-worker@.service"), _unit("pdd-routers.target")
    assert router["Service"]["ExecStart"] == [
        "/opt/pdd/venv/bin/pdd serve --role router --set router.index=%i --config /etc/pdd/pdd.toml"]
    assert router["Service"]["UnsetEnvironment"] == ["PDD_ROUTER__INDEX"]   # the environment would win over --set
    assert router["Service"]["RuntimeDirectory"] == ["pdd/router-%i"]
    assert router["Service"]["StateDirectory"] == worker["Service"]["StateDirectory"] == ["pdd"]
    assert router["Unit"]["Before"] == router["Unit"]["Wants"][-1:] == ["pdd-routers.target"]
    assert "pdd-routers.target" in worker["Unit"]["After"][0].split()
    assert router["Unit"]["PartOf"] == worker["Unit"]["PartOf"] == routers["Unit"]["PartOf"] == ["pdd.target"]
    assert router["Install"] == {"WantedBy": ["pdd.target"], "DefaultInstance": ["0"]}
    assert not (REPO / "systemd/pdd-router.service").exists()
    for path in (REPO / "systemd").iterdir():
        assert "pdd-router.service" not in path.read_text(), path.name


def test_the_router_units_command_hands_its_instance_to_router_index(tmp_path):
    """ExecStart as systemd runs pdd-router@2 on a config of two routers: index 2 is
    refused (78, no restart), so the instance did reach router.index."""
    path = write_config(tmp_path / "pdd.toml", router={
        "control_addrs": [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)],
        "admin_addrs": [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)], "admin_token": "t" * 32})
    exec_start = _unit("pdd-router@.service")["Service"]["ExecStart"][0].split()
    args = [str(path) if a == "/etc/pdd/pdd.toml" else a.replace("%i", "2") for a in exec_start[1:]]
    r = subprocess.run(pdd(*args), capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "router.index: must name one of the 2 router(s) (0 to 1), got 2" in r.stderr


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    for tool_name in ("systemd-sysusers", "systemd-tmpfiles"):
        if shutil.which(tool_name) is None:
            pytest.skip(f"{tool_name} is not installed (scripts/install-systemd needs it)")
    return tool


def _distribution_units() -> Path:
    """The units of this host's systemd (sysinit.target, ...): a root the units
    are verified in must hold them, as a real one does."""
    for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (d / "sysinit.target").exists():
            return d
    pytest.skip("no systemd unit directory with sysinit.target on this host")


def test_install_systemd_twice_then_the_units_verify_and_score_at_most_3(tmp_path, tiny_model):
    analyze = _systemd_analyze()
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(_distribution_units(), root / "usr/lib/systemd/system", symlinks=True)
    handed = generate_keys(tmp_path / "handed-keys")
    # pdd's dependencies are the shared venv's concern here: only pdd itself goes in.
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_DEPS": "1"}
    for run in (1, 2):
        r = subprocess.run([str(REPO / "scripts/install-systemd"), "--keys", str(handed), str(root)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"run {run}:\n{r.stdout}\n{r.stderr}"
        assert "systemctl not called" in r.stdout and "systemctl enable --now" in r.stdout
    assert "kept" in r.stdout and "pdd.env" in r.stdout   # the second run changed no config or secret

    etc = root / "etc"
    assert (root / "opt/pdd/venv/bin/pdd").is_file() and os.access(root / "opt/pdd/venv/bin/pdd", os.X_OK)
    installed = sorted(p.name for p in (etc / "systemd/system").iterdir() if p.name.startswith("pdd"))
    assert installed == sorted(p.name for p in (REPO / "systemd").iterdir() if p.suffix in (".service", ".target"))
    for unit in installed:
        assert (etc / "systemd/system" / unit).read_text() == (REPO / "systemd" / unit).read_text()
    assert "pdd-router@0.service" in r.stdout and "pdd-router.service" not in r.stdout
    assert (etc / "pdd/pdd.toml").read_text() == (REPO / "conf/disagg.toml").read_text()
    assert re.search(r"^PDD_ROUTER__ADMIN_TOKEN=[0-9a-f]{32}$", (etc / "pdd/pdd.env").read_text(), re.M)
    assert (etc / "pdd/keys/worker.key_secret").read_bytes() == (handed / "worker.key_secret").read_bytes()
    user = next(line.split(":") for line in (etc / "passwd").read_text().splitlines() if line.startswith("pdd:"))
    uid, gid, home = int(user[2]), int(user[3]), user[5]
    assert home == "/var/lib/pdd"
    want = {"pdd": (0o750, 0, gid), "pdd/pdd.toml": (0o640, 0, gid), "pdd/pdd.env": (0o600, 0, 0),
            "pdd/keys": (0o700, uid, gid), "pdd/keys/worker.key_secret": (0o600, uid, gid),
            "pdd/keys/worker.key": (0o644, uid, gid)}
    if os.geteuid() != 0:   # owners are set by systemd-tmpfiles, which only root may do
        want = {k: (mode, None, None) for k, (mode, _, _) in want.items()}
    for rel, (mode, owner, group) in want.items():
        st = (etc / rel).stat()
        assert (st.st_mode & 0o7777, owner if owner is None else st.st_uid, group if group is None else st.st_gid) \
            == (mode, owner, group), rel

    units = ["pdd-router@0.service", "pdd-router@1.service", "pdd-worker@decode-0.service", "pdd-routers.target",
             "pdd.target"]
    r = subprocess.run([analyze, "verify", f"--root={root}", *units], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")
    for unit in ("pdd-router@0.service", "pdd-worker@decode-0.service"):
        r = subprocess.run([analyze, "security", "--offline=yes", f"--root={root}", unit], capture_output=True,
                           text=True, timeout=300)
        found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
        assert found, r.stdout + r.stderr
        assert float(found.group(1)) <= MAX_EXPOSURE, r.stdout
