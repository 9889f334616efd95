"""The `pdd` executable, run as a user runs it."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest


def pdd(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pdd.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "m"
    r = pdd("make-model", "--preset", "tiny", "--arch", "qwen2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file()
    r = pdd("generate", "--model", str(out), "--prompt", "Hello", "--max-tokens", "5", "--ignore-eos", "-v")
    assert r.returncode == 0, r.stderr
    assert "5 tokens, finish_reason=length" in r.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    r = pdd("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    assert "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_admin_without_keys_says_what_to_pass(tmp_path):
    r = pdd("admin", "status", env={k: v for k, v in os.environ.items() if not k.startswith("PDD_")})
    assert r.returncode == 1
    assert "--keys DIR" in r.stderr and "Traceback" not in r.stderr


def test_admin_names_the_keys_directory_it_was_given(tmp_path):
    """--keys, PDD_SECURITY__KEYS_DIR or the config's security.keys_dir: the one line names
    the one the operator gave, not a setting they did not write."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    missing = tmp_path / "nope"
    config = tmp_path / "c.toml"
    config.write_text(f'[security]\nkeys_dir = "{missing}"\n')
    for args, named in ((["--keys", str(missing)], f"--keys {missing}: "),
                        (["--config", str(config)], f"{config}: security.keys_dir: ")):
        r = pdd("admin", *args, "status", env=env)
        assert r.returncode == 1 and r.stderr.startswith(f"pdd admin: {named}cannot read the key file"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = pdd("admin", "status", env={**env, "PDD_SECURITY__KEYS_DIR": str(missing)})
    assert r.returncode == 1 and r.stderr.startswith("pdd admin: PDD_SECURITY__KEYS_DIR: cannot read"), r.stderr


def test_keys_generate_refuses_to_overwrite(tmp_path):
    assert pdd("keys", "generate", str(tmp_path / "k")).returncode == 0
    r = pdd("keys", "generate", str(tmp_path / "k"))
    assert r.returncode == 2 and "never overwritten" in r.stderr and "Traceback" not in r.stderr


def test_workers_on_the_cpu_share_the_cores(monkeypatch):
    """`pdd up` gives each of its N CPU workers cores // (N + 1) torch threads,
    a share left to the router (each would spin a thread per core otherwise);
    GPU workers and a setting the user made are left alone."""
    import dataclasses

    from pdd.config_loader import load_cluster_config
    from pdd.supervisor import cpu_threads_each

    monkeypatch.delenv("PDD_ENGINE__CPU_THREADS", raising=False)
    cfg = load_cluster_config()
    pd = [("prefill", "prefill-0", None), ("decode", "decode-0", None)]
    assert cpu_threads_each(cfg, pd, cores=2) == 1
    assert cpu_threads_each(cfg, pd + [("decode", "decode-1", None)], cores=16) == 4
    assert cpu_threads_each(cfg, [("colocated", "colocated-0", None)], cores=2) == 1
    assert cpu_threads_each(cfg, [("colocated", "colocated-0", None)], cores=16) == 8
    assert cpu_threads_each(cfg, [(r, w, f"cuda:{i}") for i, (r, w, _) in enumerate(pd)], cores=2) == 0
    assert cpu_threads_each(cfg, pd, cores=1) == 1
    pinned = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, cpu_threads=2))
    assert cpu_threads_each(pinned, pd, cores=8) == 0
    monkeypatch.setenv("PDD_ENGINE__CPU_THREADS", "3")
    assert cpu_threads_each(cfg, pd, cores=8) == 0


def test_workers_sharing_a_gpu_split_its_memory_target():
    """Three workers on two GPUs: the two on cuda:0 take half of
    gpu_memory_utilization each, the one alone on cuda:1 the whole; a KV size
    the operator fixed is left as it is."""
    import dataclasses

    from pdd.config_loader import load_cluster_config
    from pdd.supervisor import worker_envs

    cfg = load_cluster_config()
    workers = [("prefill", "prefill-0", "cuda:0"), ("decode", "decode-0", "cuda:1"), ("decode", "decode-1", "cuda:0")]
    envs = worker_envs(cfg, workers)
    share = cfg.engine.gpu_memory_utilization / 2
    assert float(envs["prefill-0"]["PDD_ENGINE__GPU_MEMORY_UTILIZATION"]) == pytest.approx(share, abs=1e-4)
    assert float(envs["decode-1"]["PDD_ENGINE__GPU_MEMORY_UTILIZATION"]) == pytest.approx(share, abs=1e-4)
    assert "PDD_ENGINE__GPU_MEMORY_UTILIZATION" not in envs["decode-0"]
    assert envs["decode-1"]["PDD_ENGINE__DEVICE"] == "cuda:0"
    fixed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_cache_bytes=1 << 30))
    assert all("PDD_ENGINE__GPU_MEMORY_UTILIZATION" not in e for e in worker_envs(fixed, workers).values())


def test_pdd_up_keeps_the_routers_state_in_its_run_dir(tmp_path):
    """Drains outlive a router `pdd up` restarts: its state dir is the run dir
    unless the config names one."""
    import dataclasses

    from pdd.config_loader import load_cluster_config
    from pdd.supervisor import Cluster

    cfg = load_cluster_config()
    cluster = Cluster(cfg, [], tmp_path / "run")
    assert cluster._with_defaults(cfg).router.state_dir == str((tmp_path / "run").resolve())
    named = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, state_dir="/var/lib/elsewhere"))
    assert cluster._with_defaults(named).router.state_dir == "/var/lib/elsewhere"


def test_an_engine_on_the_cpu_takes_its_thread_count():
    import torch

    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    before = torch.get_num_threads()
    try:
        LLMEngine(EngineConfig(device="cpu", cpu_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_pdd_up_gives_up_on_a_crash_loop_not_on_deaths_spread_over_time():
    """A worker restarted MAX_RESTARTS times within RESTART_WINDOW_S is a crash
    loop; as many deaths over hours are not (a fault run once had `pdd up` stop
    the whole cluster at a worker's sixth death in ten minutes)."""
    from pdd.supervisor import MAX_RESTARTS, RESTART_WINDOW_S, Child

    child = Child("decode-0", proc=None, args=[], env=None)
    child.restarted_at = [i * RESTART_WINDOW_S for i in range(3 * MAX_RESTARTS)]
    assert not child.crash_looping(3 * MAX_RESTARTS * RESTART_WINDOW_S)
    child.restarted_at = [1000.0 + i for i in range(MAX_RESTARTS)]
    assert child.crash_looping(1000.0 + MAX_RESTARTS)
    assert not child.crash_looping(1000.0 + RESTART_WINDOW_S + MAX_RESTARTS)


def test_serve_refuses_what_a_restart_cannot_mend_with_78(tmp_path):
    """Exit 78 is what the systemd units do not restart on: a config file with a
    bad key or value, or a checkpoint that is not there."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nblock_size = \"sixteen\"\n")
    r = pdd("serve", "--role", "colocated", "--config", str(bad))
    assert r.returncode == 78 and "engine.block_size" in r.stderr and "Traceback" not in r.stderr
    r = pdd("serve", "--role", "router", "--set", "router.portt=1")
    assert r.returncode == 78 and "portt" in r.stderr and "Traceback" not in r.stderr
    r = pdd("serve", "--role", "colocated", "--set", f"engine.model={tmp_path / 'nope'}",
            "--set", "security.insecure=true")
    assert r.returncode == 78 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_serve_names_an_address_in_use(tmp_path, tiny_model):
    import socket
    from pdd.launcher import free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PDD_ROUTER__ADMIN_TOKEN": "a-long-enough-admin-token-1234"}
        r = pdd("serve", "--role", "router", "--set", f"engine.model={tiny_model}", "--set", "security.insecure=true",
                "--set", f"router.port={port}", "--set", f"router.control_addr=tcp://127.0.0.1:{free_port()}",
                "--set", f"router.admin_addr=tcp://127.0.0.1:{free_port()}", env=env)
    assert r.returncode == 1 and "in use" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _parsers(parser, path=("pdd",)):
    """(command path, parser) of `parser` and every sub-parser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _help_of(text: str, option: str) -> str:
    """An option's help in a parser's --help text: from its name to the next option."""
    start = re.search(rf"^  {re.escape(option)}\b", text, re.M).end()
    return text[start:].split("\n  -", 1)[0]


def test_every_option_of_every_command_has_help_and_shows_its_default():
    from pdd.cli import build_parser

    missing, no_default = [], []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if action.help == "==SUPPRESS==" or action.dest == "help":
                continue
            if isinstance(action, argparse._SubParsersAction):   # its commands: each says what it does
                missing += [f"{' '.join(path)} {c.dest}" for c in action._choices_actions if not c.help]
                continue
            if not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
            elif (action.option_strings and action.default not in (None, False, "", [], (), "==SUPPRESS==")
                  and "default" not in _help_of(text, action.option_strings[0])):
                no_default.append(f"{' '.join(path)} {action.option_strings[0]}")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help does not show the default: {no_default}"


def test_version():
    from pdd import __version__
    r = pdd("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"pdd {__version__} (Python "), r.stdout


def test_admin_usage_errors_are_json_when_json_is_asked_for():
    for args in (["admin", "--json", "drain"], ["admin", "drain", "--json"], ["admin", "--json", "nope"],
                 ["admin", "--json", "status", "--stray"]):
        r = pdd(*args)
        error = json.loads(r.stdout)["error"]
        assert r.returncode == 2 and error["kind"] == "usage" and error["exit_code"] == 2, (args, r.stdout)
    r = pdd("admin", "drain")
    assert r.returncode == 2 and r.stdout == "" and "the following arguments are required: WORKER" in r.stderr
