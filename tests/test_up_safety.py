"""`pdd up` and an operator's mistakes, with real processes: a second `pdd up`
on a running cluster's port or run directory, a run directory that was there
before, secrets that must stay off the command line, and a `pdd up` killed
with -9 (the OOM killer, say)."""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd.launcher import free_port
from pdd.security import generate_keys
from tests.e2e.cluster import UpCluster, children
from tests.e2e.http_util import get, post

FILE_KEY = "sk-file-0123456789abcdef"
# Where a `pdd up` must refuse before it starts anything: a model that is not
# there, so that one which got past its checks would stop at once.
NO_MODEL = "/nonexistent/pdd-model"
ENV_KEYS = ("sk-env-one-0123456789", "sk-env-two-0123456789")


def pdd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    return subprocess.run([sys.executable, "-m", "pdd.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, **(env or {})})


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(run_dir: Path) -> dict[str, tuple]:
    """Contents, mode and mtime of what a cluster keeps in its run directory (not
    its logs, which the running cluster appends to)."""
    def entry(p: Path) -> tuple:
        st = os.lstat(p)
        return (p.read_bytes() if p.is_file() else None, st.st_mode, st.st_mtime_ns)
    files = [run_dir, run_dir / "cluster.toml", run_dir / "up.lock", *sorted((run_dir / "keys").rglob("*"))]
    return {str(p.relative_to(run_dir)): entry(p) for p in files if os.path.lexists(p)}


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    """Started in a run directory made beforehand (0755, keys inside), with its
    HTTP keys from a file and from the environment."""
    tmp = tmp_path_factory.mktemp("up-safety")
    run_dir = tmp / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    generate_keys(run_dir / "keys")
    keys_before = {str(p): p.read_bytes() for p in sorted((run_dir / "keys").rglob("*")) if p.is_file()}
    key_file = tmp / "api-keys"
    key_file.write_text(f"# the team's key\n\n  {FILE_KEY}  \n")
    os.chmod(key_file, 0o600)
    c = UpCluster(run_dir, tiny_model, "--mode", "colocated", "--workers", "1", "--api-key-file", str(key_file),
                  env={"PDD_SECURITY__API_KEYS": " , ".join(ENV_KEYS)}).start()
    c.keys_before = keys_before
    yield c
    assert c.stop() == 0, c.logs()


def admin_answers(c: UpCluster) -> None:
    r = pdd("admin", "--config", str(c.run_dir / "cluster.toml"), "status")
    assert r.returncode == 0 and "ready=True" in r.stdout, r.stderr
    assert get(c.url + "/health").status == 200


def test_an_existing_run_dir_keeps_its_mode_and_keys(cluster):
    assert mode(cluster.run_dir) == 0o755
    assert cluster.cfg.security.keys_dir == str(cluster.run_dir / "keys")
    assert {str(p): p.read_bytes() for p in sorted((cluster.run_dir / "keys").rglob("*"))
            if p.is_file()} == cluster.keys_before
    assert mode(cluster.run_dir / "cluster.toml") == 0o600


def test_api_keys_from_a_file_and_the_environment_are_served(cluster):
    body = {"model": cluster.model_name, "prompt": "Keys", "max_tokens": 2}
    assert post(cluster.url + "/v1/completions", body).status == 401
    for key in (FILE_KEY, *ENV_KEYS):
        r = post(cluster.url + "/v1/completions", body, api_key=key)
        assert r.status == 200, (key, r.body)
    assert FILE_KEY not in cluster.logs()


def test_a_second_up_on_the_port_refuses_and_changes_nothing(cluster, tmp_path):
    before = snapshot(cluster.run_dir)
    home = tmp_path / "home"   # the default run dir, ~/.cache/pdd/run/up-PORT, is under it
    for where in (["--run-dir", str(tmp_path / "other")], []):
        r = pdd("up", "--model", NO_MODEL, "--mode", "colocated", "--port", str(cluster.port), *where,
                env={"HOME": str(home)})
        assert r.returncode == 1 and f"port {cluster.port} is in use" in one_line(r)
    assert not (tmp_path / "other").exists() and not (home / ".cache" / "pdd").exists()
    assert snapshot(cluster.run_dir) == before
    admin_answers(cluster)


def test_a_second_up_on_the_run_dir_refuses_and_changes_nothing(cluster):
    before = snapshot(cluster.run_dir)
    r = pdd("up", "--model", NO_MODEL, "--mode", "colocated", "--port", str(free_port()),
            "--run-dir", str(cluster.run_dir))
    line = one_line(r)
    assert r.returncode == 1 and "in use by pdd up pid" in line and cluster.url in line
    assert snapshot(cluster.run_dir) == before
    admin_answers(cluster)


def test_the_admin_token_from_a_file_or_the_environment(cluster, tmp_path):
    token = cluster.cfg.router.admin_token
    where = ["--addr", cluster.cfg.router.admin_addr, "--keys", cluster.cfg.security.keys_dir]
    token_file = tmp_path / "token"
    token_file.write_text(f"# admin token of the test cluster\n{token}\n")
    os.chmod(token_file, 0o600)
    r = pdd("admin", *where, "--token-file", str(token_file), "status")
    assert r.returncode == 0 and "ready=True" in r.stdout and not r.stderr, r.stderr
    r = pdd("admin", *where, "status", env={"PDD_ADMIN_TOKEN": token})
    assert r.returncode == 0 and "ready=True" in r.stdout and not r.stderr, r.stderr
    r = pdd("admin", *where, "--token", token, "status")
    assert r.returncode == 0 and "ready=True" in r.stdout and "warning: --token" in r.stderr, r.stderr
    r = pdd("admin", *where, "--token-file", str(tmp_path / "nope"), "status")
    assert r.returncode == 1 and "--token-file" in one_line(r) and "no such file" in r.stderr


def test_an_api_key_on_the_command_line_is_warned_about(tmp_path):
    with socket.socket() as taken:   # the start ends at the port check: no cluster needed
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = pdd("up", "--model", NO_MODEL, "--mode", "colocated", "--port", str(port), "--api-key",
                "sk-cmdline-0123456789", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 1 and "warning: --api-key puts the key on the command line" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_an_api_key_file_that_is_missing_or_empty_is_one_line(tmp_path):
    (tmp_path / "empty").write_text("# no key yet\n\n")
    for name, why in (("nope", "no such file"), ("empty", "holds no secret")):
        r = pdd("up", "--model", NO_MODEL, "--port", str(free_port()), "--api-key-file",
                str(tmp_path / name), "--run-dir", str(tmp_path / "run"))
        line = one_line(r)
        assert r.returncode == 2 and "--api-key-file" in line and why in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["1777", "0777", "another user's"])
def test_a_run_dir_others_can_write_is_refused_untouched(tmp_path, kind):
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    if kind == "another user's":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory away")
        os.chown(run_dir, 65534, 65534)
        os.chmod(run_dir, 0o755)
    else:
        os.chmod(run_dir, int(kind, 8))
    before = (mode(run_dir), os.stat(run_dir).st_uid)
    r = pdd("up", "--model", NO_MODEL, "--mode", "colocated", "--port", str(free_port()),
            "--run-dir", str(run_dir))
    assert r.returncode == 78 and str(run_dir) in one_line(r)
    assert (mode(run_dir), os.stat(run_dir).st_uid) == before and not list(run_dir.iterdir())


def test_keys_left_in_the_run_dir_that_cannot_serve_are_refused_and_kept(tmp_path):
    run_dir = tmp_path / "run"
    generate_keys(run_dir / "keys", ("router",))   # no worker or admin pair
    os.chmod(run_dir, 0o700)
    kept = sorted(p.name for p in (run_dir / "keys").iterdir())
    r = pdd("up", "--model", NO_MODEL, "--mode", "colocated", "--port", str(free_port()),
            "--run-dir", str(run_dir))
    line = one_line(r)
    assert r.returncode == 78 and str(run_dir / "keys") in line and "worker.key_secret" in line
    assert sorted(p.name for p in (run_dir / "keys").iterdir()) == kept


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody has reaped yet."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux: the kernel ends the children")
def test_kill_9_of_up_leaves_no_process_behind(tmp_path, tiny_model):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1").start()
    pids = children(c.proc.pid)
    try:
        assert sorted(pids) == sorted(c.child_pid(role) for role in ("router", "prefill", "decode"))
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        deadline = time.monotonic() + 120
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if not gone(p)] == [], "children of a killed pdd up live on"
        with open(c.run_dir / "up.lock") as lock:   # the kernel let the run dir go with the process
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


def test_a_host_without_a_gpu_driver_plans_cpu_workers_without_importing_torch():
    """Counting GPUs imports torch (seconds): skipped where no driver's device node exists."""
    code = ("import sys; import pdd.launcher as l; from pdd.config import ClusterConfig; "
            "l.GPU_DRIVER_NODES = ('/nonexistent/gpu-node',); "
            "print(l._devices(ClusterConfig()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False"], out


def test_a_replaced_worker_leaves_the_cluster_serving(tmp_path, tiny_model):
    """A second process under a live worker's id replaces it (the old one exits
    79): `pdd up` neither restarts the old one nor stops the cluster, which
    serves on with the new one."""
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1") as c:
        old = c.child_pid("colocated")
        env = {**os.environ, "PDD_ENGINE__DEVICE": "cpu", "PDD_LOG_LEVEL": "INFO"}
        with open(tmp_path / "replacement.log", "wb") as log:
            new = subprocess.Popen([sys.executable, "-P", "-m", "pdd.cli", "serve", "--config",
                                    str(c.run_dir / "cluster.toml"), "--role", "colocated",
                                    "--worker-id", "colocated-0"], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            c.wait_line("colocated-0 was replaced by another process")
            assert gone(old)
            body = {"model": c.model_name, "prompt": "hello", "max_tokens": 4, "temperature": 0}
            r = post(c.url + "/v1/completions", body)
            assert r.status == 200, r.body
            assert c.proc.poll() is None, "pdd up stopped"
            assert new.poll() is None, (tmp_path / "replacement.log").read_text()
            status = pdd("admin", "--config", str(c.run_dir / "cluster.toml"), "workers")
            assert "colocated-0" in status.stdout, status.stdout + status.stderr
        finally:
            new.terminate()
            new.wait(60)


def test_up_from_a_directory_holding_a_pdd_folder_serves(tmp_path, tiny_model):
    """Its children import the installed pdd, not a folder of that name where
    `pdd up` was started."""
    here = tmp_path / "project"
    (here / "pdd").mkdir(parents=True)
    (here / "pdd" / "__init__.py").write_text("raise ImportError('the wrong pdd was imported')\n")
    (here / "pdd" / "cli.py").write_text("raise SystemExit('the wrong pdd.cli was run')\n")
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", cwd=here) as c:
        assert get(c.url + "/health").status == 200
        body = {"model": c.model_name, "prompt": "hello", "max_tokens": 2}
        assert post(c.url + "/v1/completions", body).status == 200


def test_a_router_count_pdd_up_cannot_run_is_refused_in_one_line(tmp_path):
    """--routers 0, or --routers N with a config that lists another number of routers:
    one line saying so, exit 2 (bad usage), nothing made."""
    r = pdd("up", "--routers", "0", "--port", str(free_port()), "--run-dir", str(tmp_path / "a"))
    assert r.returncode == 2 and "--routers: want at least one router, got 0" in one_line(r)
    config = tmp_path / "one-router.toml"
    config.write_text(f"[router]\nport = {free_port()}\n")
    r = pdd("up", "--routers", "2", "--config", str(config), "--run-dir", str(tmp_path / "b"))
    line = one_line(r)
    assert r.returncode == 2 and "names 1 router(s)" in line and "router.control_addrs" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_ports_pdd_up_picks_differ_from_each_other_and_from_its_http_port(monkeypatch):
    """The kernel may hand a port picked and closed (the HTTP port a caller chose,
    one picked a moment ago) to the next bind to port 0; a cluster whose admin
    socket took its HTTP port cannot start. A fake kernel offers them again (a
    forced fault, so mocked)."""
    import pdd.launcher as launcher
    offered = iter([41000, 41000, 41001, 41001, 41002])

    class Kernel:   # socket.socket as free_port uses it
        def bind(self, addr):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(launcher.socket, "socket", Kernel)
    monkeypatch.setattr(launcher, "_handed_out", set())
    assert launcher.free_port(avoid={41000}) == 41001   # 41000: the HTTP port
    assert launcher.free_port(avoid={41000}) == 41002   # 41001: handed out already
