"""Real processes: a `pdd serve --role router` with the cluster's keys, probed
by strangers — raw ZeroMQ sockets and a real `pdd serve --role decode` with a
HOME and keys of its own — while the test plays the cluster's one worker.

The strangers try what a forged worker would: register first with a bogus
layout (so the real workers are refused), register with max_model_len=2 (so
every prompt is refused), attract a request to read its prompt, inject tokens
into a request's answer. None completes a handshake; the router's registry,
limits and answers are what the real worker made them.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio

from pdd.admin.client import AdminError, call, call_with_config
from pdd.bench.layouts import interrupt
from pdd.config import EXIT_REFUSED
from pdd.config_loader import dump_toml, load_cluster_config
from pdd.kv.layout import KVLayout
from pdd.launcher import free_port
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel
from pdd.security import control_security, write_private
from tests.security.conftest import failed_handshake, offer, secure_config, stranger

API_KEY = "sk-test-0123456789"
LEGIT_MAX_MODEL_LEN = 256


def pdd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdd.cli", "--log-level", "INFO", *args]


def write_config(path: Path, **tables) -> Path:
    write_private(path, dump_toml(load_cluster_config(env={}, overrides=tables)))
    return path


class RouterProcess:
    def __init__(self, run_dir: Path, model: Path, keys: Path):
        self.run_dir = run_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = write_config(
            run_dir / "router.toml", engine={"model": str(model)},
            router={"port": self.port, "control_addr": f"tcp://127.0.0.1:{free_port()}",
                    "admin_addr": f"tcp://127.0.0.1:{free_port()}", "admin_token": "t" * 32},
            security={"keys_dir": str(keys), "api_keys": [API_KEY]})
        self.cfg = load_cluster_config(self.config_path, env={})
        self.log = run_dir / "router.log"

    def start(self) -> "RouterProcess":
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(pdd("serve", "--role", "router", "--config", str(self.config_path)),
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return self
            except urllib.error.HTTPError:
                return self   # it answers (503: no worker yet)
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"router did not start:\n{self.log.read_text()}")

    def admin(self, cmd: str, *args):
        return call_with_config(self.cfg, cmd, *args)

    def stop(self) -> None:
        interrupt(self.proc, 60, signal.SIGTERM)


@pytest.fixture(scope="module")
def router(tmp_path_factory, tiny_model, keys):
    r = RouterProcess(tmp_path_factory.mktemp("router"), tiny_model, keys).start()
    yield r
    r.stop()


def http(url: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- start-up refusals

@pytest.mark.parametrize("role", ["router", "decode"])
def test_no_keys_and_no_insecure_is_refused_at_start(tmp_path, tiny_model, role):
    cfg = write_config(tmp_path / "c.toml", engine={"model": str(tiny_model)}, router={"admin_token": "t" * 32})
    r = subprocess.run(pdd("serve", "--role", role, "--config", str(cfg)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "pdd keys generate DIR" in r.stderr and "security.insecure = true" in r.stderr


@pytest.mark.parametrize("token", ["change-me", ""])
def test_a_placeholder_admin_token_is_refused_at_start(tmp_path, tiny_model, keys, token):
    cfg = write_config(tmp_path / "c.toml", engine={"model": str(tiny_model)}, router={"admin_token": token},
                       security={"keys_dir": str(keys)})
    r = subprocess.run(pdd("serve", "--role", "router", "--config", str(cfg)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "router.admin_token" in r.stderr and "PDD_ROUTER__ADMIN_TOKEN" in r.stderr


# ---------------------------------------------------------------- HTTP and admin

def test_http_needs_an_api_key(router):
    status, body = http(router.url + "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http(router.url + "/v1/models", key="sk-wrong")[0] == 401
    assert http(router.url + "/v1/completions", {"model": "x", "prompt": "hi"}, key=None)[0] == 401
    assert http(router.url + "/v1/models")[0] == 200


def test_admin_needs_the_admin_key_and_masks_secrets(router, stranger_keys):
    cfg = router.admin("config")
    assert cfg["router"]["admin_token"] == "***" and cfg["security"]["api_keys"] == ["***"]
    with pytest.raises(AdminError, match="CURVE handshake failed"):
        call(router.cfg.router.admin_addr, router.cfg.router.admin_token, "status")


# ---------------------------------------------------------------- forged workers

def layout_dict(**over) -> dict:
    base = dict(model_id="pdd-tiny", weights_hash="w", dtype="float32", block_size=16, num_layers=2,
                num_kv_heads=2, head_dim=16)
    return KVLayout(**{**base, **over}).to_dict()


def register(worker_id: str, role: str = "colocated", **over) -> m.Register:
    fields = dict(worker_id=worker_id, role=role, host="h", pid=os.getpid(), device="cpu", layout=layout_dict(),
                  num_blocks=64, max_num_seqs=8, max_model_len=LEGIT_MAX_MODEL_LEN, incarnation="i1")
    return m.Register(**{**fields, **over})


class PlayedWorker:
    """The cluster's one worker, played by the test over the real protocol:
    registers, heartbeats, and answers each Admit with fixed tokens."""

    ANSWER = [5, 6, 7]

    def __init__(self, ctx, cfg, addr: str, worker_id: str = "colocated-0"):
        self.worker_id = worker_id
        self.chan = DealerChannel(ctx, addr, worker_id, control_security(cfg, "colocated"))
        self.admitted: list[m.Admit] = []
        self.registered = asyncio.Event()
        self.on_admit = None   # async fn(admit) run before the answer

    async def run(self) -> None:
        await self.chan.send(register(self.worker_id))
        beat = asyncio.ensure_future(self._heartbeats())
        try:
            while True:
                msg = await self.chan.recv()
                if isinstance(msg, m.RegisterReply):
                    assert msg.ok, msg.error
                    self.registered.set()
                elif isinstance(msg, m.Admit):
                    self.admitted.append(msg)
                    if self.on_admit:
                        await self.on_admit(msg)
                    await self.chan.send(m.TokenBatch(self.worker_id, [m.TokenItem(
                        msg.request_id, msg.epoch, 0, list(self.ANSWER), finished=True, finish_reason="length")]))
        finally:
            beat.cancel()

    async def _heartbeats(self) -> None:
        while True:
            await self.chan.send(m.Heartbeat(self.worker_id, running=0, waiting=0, free_blocks=64, total_blocks=64))
            await asyncio.sleep(0.1)


def test_forged_workers_get_nothing_in_and_nothing_out(router, keys, stranger_keys, tiny_model):
    """Register first with a bogus layout, register with max_model_len=2,
    read a prompt, inject an answer: from a plaintext socket, from one with
    its own keys, and from one with its own keys and the router's public key."""
    from pdd.model.tokenizer import Tokenizer

    addr = router.cfg.router.control_addr
    theirs = control_security(secure_config(stranger_keys), "colocated")
    router_key = control_security(router.cfg, "colocated").server_key
    before = router.admin("security")

    async def main():
        ctx = zmq.asyncio.Context()
        evils = [stranger(ctx, None, None, b"evil-plain"),
                 stranger(ctx, (theirs.public, theirs.secret), theirs.server_key, b"evil-own-keys"),
                 stranger(ctx, (theirs.public, theirs.secret), router_key, b"evil-knows-router-key")]
        watches = [asyncio.ensure_future(failed_handshake(e)) for e in evils]
        await asyncio.sleep(0)
        for e in evils:   # first in line, before the real worker
            e.connect(addr)
            await offer(e, register(e.getsockopt(zmq.IDENTITY).decode(), layout=layout_dict(model_id="bogus"),
                                    max_model_len=2, num_blocks=10**6))
        await asyncio.wait_for(asyncio.gather(*watches), 30)

        worker = PlayedWorker(ctx, router.cfg, addr)

        async def inject(admit: m.Admit) -> None:
            # Worst case: the strangers even know the request id and epoch.
            for e in evils:
                await offer(e, m.TokenBatch(e.getsockopt(zmq.IDENTITY).decode(), [m.TokenItem(
                    admit.request_id, admit.epoch, 0, [666], finished=True, finish_reason="stop")]))

        worker.on_admit = inject
        task = asyncio.ensure_future(worker.run())
        await asyncio.wait_for(worker.registered.wait(), 30)   # the bogus layout did not fix the cluster's
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"},
                                         timeout=aiohttp.ClientTimeout(total=120)) as s:
            while True:   # ready once the router has seen the worker
                async with s.get(router.url + "/v1/models") as r:
                    models = await r.json()
                if models["data"][0]["max_model_len"] is not None:
                    break
                await asyncio.sleep(0.05)
            async with s.post(router.url + "/v1/completions",
                              json={"model": str(tiny_model), "prompt": [11, 12, 13], "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            workers = [w["worker_id"] for w in await asyncio.to_thread(router.admin, "workers")]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.chan.send(m.Goodbye(worker.worker_id))
        await asyncio.sleep(0.05)
        worker.chan.close()
        for e in evils:
            e.close(0)
        ctx.term()
        return models, answer, workers, worker.admitted

    models, answer, workers, admitted = asyncio.run(main())
    assert models["data"][0]["max_model_len"] == LEGIT_MAX_MODEL_LEN          # not 2
    assert workers == ["colocated-0"]
    assert len(admitted) == 1 and admitted[0].prompt_token_ids == [11, 12, 13]  # the prompt went to the worker
    assert answer["choices"][0]["text"] == Tokenizer(tiny_model).decode(PlayedWorker.ANSWER)  # no 666
    assert answer["usage"]["completion_tokens"] == 3
    after = router.admin("security")
    assert after.get("control.denied", 0) > before.get("control.denied", 0)
    failed = sum(after.get(k, 0) - before.get(k, 0) for k in ("control.handshake_failed", "control.handshake_refused"))
    assert failed >= 3


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("keyed", [True, False], ids=["own keys", "insecure"])
def test_a_real_decode_worker_without_the_cluster_keys(router, tmp_path, tiny_model, keys, keyed):
    """`pdd serve --role decode` with its own HOME and a config naming only the
    router's address (and the model): with keys of its own and the router's
    public key (public knowledge), or with security.insecure. It never joins."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env = {k: v for k, v in env.items() if not k.startswith("PDD_")}
    security = {"insecure": True}
    if keyed:
        r = subprocess.run(pdd("keys", "generate", str(home / "keys")), capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        shutil.copy(keys / "router.key", home / "keys" / "router.key")
        security = {"keys_dir": str(home / "keys")}
    cfg = write_config(home / "pdd.toml", engine={"model": str(tiny_model)},
                       worker={"router_addr": router.cfg.router.control_addr}, security=security)
    before = router.admin("security")
    log = home / "decode.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(pdd("serve", "--role", "decode", "--worker-id", "intruder", "--config", str(cfg)),
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        counter = "control.denied" if keyed else "control.handshake_failed"
        wait_for(lambda: router.admin("security").get(counter, 0) > before.get(counter, 0),
                 f"the router to refuse the intruder ({counter})")
        if keyed:   # it says why in its own log
            wait_for(lambda: "CURVE handshake" in log.read_text(), "the intruder's log to name the handshake")
        assert proc.poll() is None, log.read_text()      # it is running, and trying
        assert "intruder" not in [w["worker_id"] for w in router.admin("workers")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
