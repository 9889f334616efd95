"""Logs, request ids and traces of real processes: a `pdd up` cluster (1P+1D) logging
JSON (PDD_LOG__FORMAT=json), read back from its run directory, and `pdd admin` run as
an operator runs it; a lone `pdd serve --role router` at its default level."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.admin.client import AdminError
from pdd.config_loader import dump_toml, load_cluster_config
from pdd.launcher import free_port
from pdd.security import write_private
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster
from tests.engine.helpers import random_prompts
from tests.e2e.test_disagg import PATIENT
from tests.e2e.test_disagg_faults import _wait_for

PROMPT = random_prompts([40], seed=77)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    # Run-time fault injection: one test makes a transfer fail to see the fallback in a trace.
    with UpCluster(tmp_path_factory.mktemp("logs"), tiny_model, "--mode", "disagg", "--log-level", "info",
                   env={"PDD_LOG__FORMAT": "json", "PDD_ROUTER__ALLOW_FAULT_INJECTION": "true", **PATIENT}) as c:
        yield c


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged(cluster, name: str, match) -> dict:
    """The first JSON line of `name`.log for which match(line) holds (waiting for it)."""
    path = cluster.run_dir / f"{name}.log"
    return _wait_for(lambda: next((x for x in json_lines(path) if match(x)), None), what=f"a line in {path.name}")


def access_line(cluster, request_id: str) -> dict:
    return logged(cluster, "router", lambda x: x["logger"] == "pdd.access" and x.get("request_id") == request_id)


def complete(cluster, request_id: str | None, max_tokens: int = 5, stream: bool = False, model: str | None = None):
    body = {"model": model or cluster.model_name, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    return http_util.post(cluster.url + "/v1/completions", body,
                          headers={"X-Request-Id": request_id} if request_id is not None else None)


def admin_cli(cluster, *args: str) -> subprocess.CompletedProcess:
    """`pdd admin` as an operator types it (the cluster's config names the keys and token)."""
    return subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.run_dir / "cluster.toml"),
                           *args], capture_output=True, text=True, timeout=120)


def trace(cluster, request_id: str) -> dict:
    traced, = cluster.admin("trace", request_id)
    return traced


def test_json_access_lines_carry_the_clients_request_id_stream_and_not(cluster):
    plain = complete(cluster, "client-req.0001")
    streamed = complete(cluster, "client-req:stream-2", max_tokens=4, stream=True)
    assert plain.status == streamed.status == 200
    assert plain.headers["X-Request-Id"] == "client-req.0001"
    assert streamed.headers["X-Request-Id"] == "client-req:stream-2" and b"data: [DONE]" in streamed.body
    assert plain.headers["Server"] == streamed.headers["Server"] == "pdd"   # no Python or aiohttp version
    for rid, tokens, stream in (("client-req.0001", 5, False), ("client-req:stream-2", 4, True)):
        line = access_line(cluster, rid)
        assert (line["level"], line["msg"], line["process"]) == ("INFO", "POST /v1/completions", "router")
        assert line["ts"].endswith("+00:00")
        assert (line["status"], line["mode"], line["stream"], line["finish_reason"]) == (200, "disagg", stream,
                                                                                        "length")
        assert (line["prefill_worker"], line["decode_worker"]) == ("prefill-0", "decode-0")
        assert (line["prompt_tokens"], line["output_tokens"]) == (len(PROMPT), tokens)
        assert 0 <= line["ttft_s"] <= line["duration_s"]
    # Every process logs JSON: each line of each log is one object with the stable keys.
    for path in cluster.run_dir.glob("*.log"):
        for line in json_lines(path):
            assert {"ts", "level", "logger", "msg", "process"} <= set(line), (path.name, line)


def test_errors_carry_the_id_and_an_unusable_one_is_replaced(cluster):
    refused = complete(cluster, "client-err-1", model="no-such-model")
    assert refused.status == 404 and refused.headers["X-Request-Id"] == "client-err-1"
    assert access_line(cluster, "client-err-1")["status"] == 404
    for bad in ("has spaces in it", "x" * 129, ""):
        reply = complete(cluster, bad, max_tokens=1)
        made = reply.headers["X-Request-Id"]
        assert reply.status == 200 and made.startswith("cmpl-") and made != bad
        assert reply.json()["id"] == made   # without an id from the client, the answer's id is the request's
        assert access_line(cluster, made)["status"] == 200
    health = http_util.get(cluster.url + "/health", headers={"X-Request-Id": "probe-1"})
    assert health.headers["X-Request-Id"] == "probe-1" and health.headers["Server"] == "pdd"


PHASE_ORDER = ["queued", "placed", "reserving", "prefilling", "decoding", "end"]


def test_trace_shows_every_phase_of_a_disaggregated_request(cluster):
    assert complete(cluster, "trace-disagg-1").status == 200
    # The prefill worker's PrefillDone (the "transfer" event) may come after the answer.
    events = _wait_for(lambda: next((t["events"] for t in [trace(cluster, "trace-disagg-1")]
                                     if "transfer" in [e["event"] for e in t["events"]]), None),
                       30.0, "the transfer in the trace")
    names = [e["event"] for e in events]
    phases = [n for n in names if n in PHASE_ORDER]
    assert phases == PHASE_ORDER, names
    assert {"first_token", "kv_landed", "transfer"} <= set(names) and "fallback" not in names
    first = {e["event"]: e for e in reversed(events)}
    for name in ("placed", "reserving", "prefilling", "kv_landed"):   # one placement
        assert (first[name]["prefill"], first[name]["decode"], first[name]["epoch"]) == (
            "prefill-0", "decode-0", first["placed"]["epoch"])
    assert first["decoding"]["decode"] == first["end"]["decode"] == "decode-0"
    assert first["end"]["note"] == "length"
    assert [e["t_s"] for e in events] == sorted(e["t_s"] for e in events)
    # As the operator reads it: one row per event, in order, naming the workers.
    out = admin_cli(cluster, "trace", "trace-disagg-1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("request trace-disagg-1  mode=disagg  finish=length")
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("+")]
    assert [r[1] for r in rows] == names
    placed = rows[names.index("placed")]
    assert placed[2:5] == [str(first["placed"]["epoch"]), "prefill-0", "decode-0"]
    missing = admin_cli(cluster, "trace", "no-such-request")
    assert missing.returncode == 1 and "no request 'no-such-request' in flight" in missing.stderr


def test_trace_shows_the_fallback_of_a_failed_transfer(cluster):
    cluster.admin("faults", "set", "transfer.fail_rate=1", "prefill-0")
    try:
        assert complete(cluster, "trace-fallback-1").status == 200
    finally:
        cluster.admin("faults", "clear")
    events = trace(cluster, "trace-fallback-1")["events"]
    names = [e["event"] for e in events]
    assert [n for n in names if n in PHASE_ORDER] == PHASE_ORDER, names
    fallback = events[names.index("fallback")]
    assert fallback["note"].startswith("transfer_failed") and fallback["prefill"] == "prefill-0"
    after = events[names.index("fallback") + 1]
    assert (after["event"], after["decode"], after["prefill"]) == ("decoding", "decode-0", None)
    assert names.index("placed") < names.index("prefilling") < names.index("fallback")
    line = access_line(cluster, "trace-fallback-1")
    assert line["fallbacks"] == "transfer_failed" and line["finish_reason"] == "length"
    slow = admin_cli(cluster, "requests", "--slow")
    assert slow.returncode == 0, slow.stderr
    header, *rows = slow.stdout.splitlines()
    assert header.split()[:5] == ["request_id", "mode", "finish_reason", "duration_s", "ttft_s"]
    assert any(r.split()[0] == "trace-fallback-1" and "transfer_failed" in r.split() for r in rows), slow.stdout


def test_the_log_level_changes_at_run_time_on_the_router_and_the_workers(cluster):
    out = admin_cli(cluster, "log-level", "debug", "--worker", "all")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "router: debug; debug sent to decode-0, prefill-0"
    try:
        http_util.get(cluster.url + "/health", headers={"X-Request-Id": "probe-at-debug"})
        line = logged(cluster, "router", lambda x: x.get("request_id") == "probe-at-debug")
        assert (line["level"], line["logger"], line["msg"]) == ("DEBUG", "pdd.access", "GET /health")
        for wid in ("prefill-0", "decode-0"):
            logged(cluster, wid, lambda x: x["msg"].endswith("log level now debug (pdd admin log-level)"))
        assert admin_cli(cluster, "log-level").stdout.strip() == "router: debug"
    finally:
        assert admin_cli(cluster, "log-level", "info", "--worker", "all").returncode == 0
    bad = admin_cli(cluster, "log-level", "loud")
    # A usage error (2), caught before the router is asked; the router refuses it all the same.
    assert bad.returncode == 2 and "expected one of debug, info, warning, error, critical" in bad.stderr


def test_admin_commands_leave_an_audit_line(cluster):
    cluster.admin("drain", "decode-0")
    cluster.admin("undrain", "decode-0")
    with pytest.raises(AdminError, match="no worker 'nobody'"):
        cluster.admin("drain", "nobody")

    def audit(command: str, args: list) -> dict:
        return logged(cluster, "router", lambda x: x["logger"] == "pdd.audit" and (x["command"], x["arguments"])
                      == (command, args))
    drained, undrained = audit("drain", ["decode-0"]), audit("undrain", ["decode-0"])
    refused = audit("drain", ["nobody"])
    assert (drained["level"], drained["ok"], undrained["ok"]) == ("INFO", True, True)
    assert drained["admin_key"] == "admin" and drained["peer"] == "127.0.0.1"
    assert drained["msg"] == "admin drain decode-0: ok"
    assert refused["ok"] is False and "no worker 'nobody'" in refused["error"]


# ---------------------------------------------------------------- one process, default level

def test_pdd_serve_logs_at_info_by_default_and_takes_log_level(tmp_path, tiny_model):
    port = free_port()
    config = tmp_path / "router.toml"
    write_private(config, dump_toml(load_cluster_config(env={}, overrides={
        "engine": {"model": str(tiny_model)}, "security": {"insecure": True},
        "router": {"port": port, "admin_token": "t" * 32, "control_addr": f"tcp://127.0.0.1:{free_port()}",
                   "admin_addr": f"tcp://127.0.0.1:{free_port()}"}})))
    base = [sys.executable, "-m", "pdd.cli", "serve", "--role", "router", "--config", str(config)]
    bad = subprocess.run([*base, "--log-level", "loud"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected one of debug, info, warning, error, critical" in bad.stderr
    for extra, wanted in (([], "INFO pdd.serve: router listening on"),
                          (["--log-level", "debug"], "DEBUG pdd.access: GET /health")):
        log = tmp_path / f"router{len(extra)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*base, *extra], stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: "router listening on" in log.read_text(), 120, "the router to listen")
            http_util.get(f"http://127.0.0.1:{port}/health")
            _wait_for(lambda: wanted in log.read_text(), 30, wanted)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()
