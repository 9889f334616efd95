"""`pdd admin` against a real cluster: a router, a prefill and a decode worker,
each a `pdd serve` process (pdd.supervisor.Cluster, so that the test can stop the
router and start it again under the same config, as systemd would).

Every command runs as an operator types it, with --json, and its output is
parsed, errors included; abort ends a long stream and frees its blocks; drain
--wait returns once the worker is idle and times out with exit 4 while it is
not; /health stays 200 while /ready follows what placement can serve; a
drained worker stays drained across a router restart, and a damaged state
file is logged, not fatal.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

import pdd
from pdd.admin.client import call_with_config
from pdd.config_loader import load_cluster_config
from pdd.launcher import free_port
from pdd.supervisor import Cluster
from tests.e2e import http_util
from tests.e2e.cluster import _wait_for

WORKERS = [("prefill", "prefill-0", None), ("decode", "decode-0", None)]
FILE_NAME = "drained-workers.json"   # in router.state_dir
ABORTED = "aborted by the operator"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    run_dir = tmp_path_factory.mktemp("admin")
    cfg = load_cluster_config(overrides={
        "engine": {"model": str(tiny_model)},
        "router": {"mode": "auto", "port": free_port(), "control_addr": f"tcp://127.0.0.1:{free_port()}",
                   "admin_addr": f"tcp://127.0.0.1:{free_port()}", "state_dir": str(run_dir / "state"),
                   "allow_fault_injection": True}})
    c = Cluster(cfg, WORKERS, run_dir)
    c.start()
    try:
        c.wait_ready(300)
        yield c
    finally:
        c.stop()


def admin(c: Cluster, cmd: str, *args):
    return call_with_config(c.cfg, cmd, *args)


def cli(c: Cluster, *args: str) -> tuple[int, dict | list]:
    """`pdd admin --config FILE --json ARGS`: its exit code and its stdout, parsed."""
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(c.config_path), "--json", *args],
                       capture_output=True, text=True, timeout=300)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"pdd admin {' '.join(args)}: not JSON (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")


def refused(c: Cluster, *args: str, code: int = 1) -> str:
    """The message of a command that must fail with `code` and a JSON error."""
    rc, out = cli(c, *args)
    assert rc == code and set(out) == {"error"}, (args, rc, out)
    assert out["error"]["exit_code"] == code and out["error"]["message"], out
    return out["error"]["message"]


def complete(c: Cluster, prompt: str, request_id: str | None = None) -> http_util.Reply:
    body = {"model": c.cfg.served_model_names(c.cfg.engine.model)[0], "prompt": prompt, "max_tokens": 3}
    return http_util.post(c.url + "/v1/completions", body, headers={"X-Request-Id": request_id} if request_id else {})


def workers(c: Cluster) -> dict[str, dict]:
    return {w["worker_id"]: w for w in admin(c, "workers")}


def all_blocks_free(c: Cluster) -> bool:
    return not admin(c, "requests") and all(
        w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["num_blocks"] for w in workers(c).values())


class Stream:
    """A streamed completion read in a thread: its SSE data lines, until [DONE]."""

    def __init__(self, c: Cluster, request_id: str, max_tokens: int = 3000):
        body = {"model": c.cfg.served_model_names(c.cfg.engine.model)[0], "prompt": "a long answer, please",
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.req = urllib.request.Request(c.url + "/v1/completions", data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json", "X-Request-Id": request_id})
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with urllib.request.urlopen(self.req, timeout=300) as r:
            for line in r:
                if line.startswith(b"data: "):
                    self.events.append(line[6:].decode().strip())

    def tokens(self) -> int:
        return sum(1 for e in self.events if e != "[DONE]" and "choices" in json.loads(e))

    def end(self) -> list[str]:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream did not end"
        return self.events


def slow_decodes(c: Cluster):
    """Each decode step of decode-0 takes 50 ms more: a long request stays in flight."""
    rc, out = cli(c, "faults", "set", "decode.step_delay_s=0.05", "decode-0")
    assert rc == 0 and out["sent_to"] == ["decode-0"], out
    _wait_for(lambda: workers(c)["decode-0"]["faults"].get("decode.step_delay_s") == 0.05, 60, "the fault set")


def test_every_command_prints_json_errors_included(cluster):
    assert complete(cluster, "hello", "json-1").status == 200
    ok = {
        ("status",): lambda r: r["ready"] is True and len(r["workers"]) == 2,
        ("workers",): lambda r: sorted(w["worker_id"] for w in r) == ["decode-0", "prefill-0"],
        ("requests",): lambda r: isinstance(r, list),
        ("requests", "--slow"): lambda r: any(t["request_id"] == "json-1" for t in r),
        ("trace", "json-1"): lambda r: r[0]["request_id"] == "json-1",
        ("breaker",): lambda r: isinstance(r, list),
        ("breaker", "open", "all"): lambda r: all(b["forced"] == "open" for b in r),
        ("breaker", "auto", "all"): lambda r: all(b["forced"] == "auto" for b in r),
        ("faults",): lambda r: r["allow_fault_injection"] is True,
        ("faults", "clear"): lambda r: sorted(r["sent_to"]) == ["decode-0", "prefill-0"],
        ("log-level",): lambda r: r["router"] == "info",
        ("log-level", "info", "--worker", "all"): lambda r: r["router"] == "info",
        ("config",): lambda r: r["router"]["admin_token"] == "***",
        ("security",): lambda r: isinstance(r, dict),
        ("version",): lambda r: (r["client"]["version"] == r["router"]["version"] == pdd.__version__
                                 and all(w["version"] == pdd.__version__ and "torch" in w
                                         for w in r["workers"].values()) and len(r["workers"]) == 2),
        ("drain", "prefill-0"): lambda r: r["worker_id"] == "prefill-0" and r["accepting"] is False
                                          and r["kept_in"].endswith(FILE_NAME),
        ("undrain", "prefill-0"): lambda r: r["accepting"] is True,
    }
    for args, check in ok.items():
        rc, out = cli(cluster, *args)
        assert rc == 0 and check(out), (args, rc, out)
    assert "no worker 'nobody'" in refused(cluster, "drain", "nobody")
    assert "no worker 'nobody'" in refused(cluster, "undrain", "nobody")
    assert "no request 'nothing-such'" in refused(cluster, "abort", "nothing-such")
    assert "no request 'nothing-such'" in refused(cluster, "trace", "nothing-such")
    no_pair = refused(cluster, "breaker", "open")
    assert "PREFILL DECODE" in no_pair and "all" in no_pair
    assert "no pair prefill-0 -> nope" in refused(cluster, "breaker", "open", "prefill-0", "nope")
    assert "unknown fault" in refused(cluster, "faults", "set", "nope=1")
    assert "no worker 'nobody'" in refused(cluster, "log-level", "debug", "--worker", "nobody")
    assert "WORKER" in refused(cluster, "drain", code=2)   # argparse's usage error, as JSON
    assert "--worker goes with a LEVEL" in refused(cluster, "log-level", "--worker", "all", code=2)
    assert all(b["forced"] == "auto" for b in admin(cluster, "breaker"))   # the refused ones forced nothing
    # An admin socket nobody listens on: exit 3, as JSON.
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.config_path), "--addr",
                        f"tcp://127.0.0.1:{free_port()}", "--json", "status"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 3 and json.loads(r.stdout)["error"]["kind"] == "unreachable", r.stdout


def test_tables_for_people(cluster):
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.config_path), "version"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[:3] == ["process", "version", "python"]
    assert sorted(row.split()[0] for row in rows if not row.startswith("admin")) == ["decode-0", "prefill-0",
                                                                                     "router"]
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.config_path), "drain",
                        "nobody"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith("pdd admin: drain: no worker 'nobody'")
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.config_path), "status"],
                       capture_output=True, text=True, timeout=300)
    served = cluster.cfg.served_model_names(cluster.cfg.engine.model)
    assert r.returncode == 0 and r.stdout.startswith(f"model {', '.join(served)}  ready="), r.stdout


def test_abort_ends_a_long_stream_and_frees_its_blocks(cluster):
    slow_decodes(cluster)
    try:
        stream = Stream(cluster, "long-abort")
        _wait_for(lambda: stream.tokens() >= 2, 120, "the stream's first tokens")
        rc, out = cli(cluster, "abort", "long-abort")
        assert rc == 0 and out == {"aborted": ["long-abort"]}, out
        events = stream.end()
        assert events[-1] == "[DONE]"
        assert ABORTED in json.loads(events[-2])["error"]["message"], events[-3:]
        assert stream.tokens() < 3000
        _wait_for(lambda: all_blocks_free(cluster), 60, "every block free again")
        assert "no request 'long-abort'" in refused(cluster, "abort", "long-abort")
    finally:
        admin(cluster, "faults", "clear")


def test_drain_wait_returns_once_the_worker_is_idle_and_times_out_while_it_is_not(cluster):
    slow_decodes(cluster)
    try:
        stream = Stream(cluster, "long-drain")
        _wait_for(lambda: stream.tokens() >= 1, 120, "the stream's first token")
        assert workers(cluster)["decode-0"]["inflight"] == 1
        rc, out = cli(cluster, "drain", "decode-0", "--wait", "--timeout", "0.5")
        assert rc == 4 and out["error"]["kind"] == "timeout", out
        assert out["error"]["worker"]["inflight"] == 1 and "stays drained" in out["error"]["message"]
        waiting = subprocess.Popen([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.config_path),
                                    "--json", "drain", "decode-0", "--wait", "--timeout", "300"],
                                   stdout=subprocess.PIPE, text=True)
        admin(cluster, "abort", "long-drain")
        out, _ = waiting.communicate(timeout=300)
        assert waiting.returncode == 0, out
        done = json.loads(out)
        assert done["worker_id"] == "decode-0" and done["inflight"] == 0 and done["accepting"] is False
        assert ABORTED in json.loads(stream.end()[-2])["error"]["message"]
    finally:
        admin(cluster, "faults", "clear")
        admin(cluster, "undrain", "decode-0")


def test_health_is_liveness_and_ready_follows_what_can_serve(cluster):
    def probe(path: str) -> tuple[int, dict]:
        r = http_util.get(cluster.url + path)
        return r.status, r.json()

    assert probe("/ready")[0] == 200 and probe("/health")[0] == 200
    admin(cluster, "drain", "decode-0")
    try:
        # The prefill worker still serves (placement runs a request whole there when no
        # decode-capable worker takes work): ready, and a request is served.
        assert probe("/ready") == (200, {"status": "ok", "workers": 2})
        r = complete(cluster, "still served?")
        assert r.status == 200 and r.json()["choices"][0]["text"]
        admin(cluster, "drain", "prefill-0")
        status, body = probe("/ready")
        assert status == 503 and "no worker can take a request" in body["reason"], body
        assert probe("/health") == (200, {"status": "unavailable", "workers": 2})
        assert admin(cluster, "status")["ready"] is False
        assert complete(cluster, "x").status == 503
    finally:
        admin(cluster, "undrain", "decode-0")
        admin(cluster, "undrain", "prefill-0")
    assert probe("/ready")[0] == 200


def restart_router(c: Cluster) -> None:
    router = next(child for child in c.children if child.name == "router")
    router.proc.send_signal(signal.SIGTERM)
    router.proc.wait(120)
    c.restart(router)
    _wait_for(lambda: _registered(c) == {"decode-0", "prefill-0"}, 300, "both workers registered again")


def _registered(c: Cluster) -> set[str]:
    try:
        return set(workers(c))
    except Exception:   # not answering yet
        return set()


def test_a_drained_worker_stays_drained_across_a_router_restart(cluster):
    state = cluster.run_dir / "state" / FILE_NAME
    admin(cluster, "drain", "decode-0")
    assert json.loads(state.read_text())["drained"] == ["decode-0"]
    restart_router(cluster)
    now = workers(cluster)
    assert now["decode-0"]["accepting"] is False and now["prefill-0"]["accepting"] is True
    assert "workers drained before this router started" in (cluster.run_dir / "router.log").read_text()
    rc, out = cli(cluster, "undrain", "decode-0")
    assert rc == 0 and out["accepting"] is True
    assert json.loads(state.read_text())["drained"] == []

    state.write_text("{not json")
    restart_router(cluster)
    assert all(w["accepting"] for w in workers(cluster).values())
    log = (cluster.run_dir / "router.log").read_text()
    assert f"drained-worker state {state} cannot be read as JSON" in log
    assert http_util.get(cluster.url + "/ready").status == 200
