"""The scripts an operator runs from a checkout: `--help` says how to use each,
and a wrong argument is one line on stderr, never a traceback. (scripts/up and
scripts/test pass their arguments on to `pdd up` and pytest after making .venv;
scripts/device-* are for the GPU machines.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run(name: str, *args: str) -> subprocess.CompletedProcess:
    path = SCRIPTS / name
    # The Python ones under this interpreter: their shebang's python3 may lack torch.
    command = [sys.executable, str(path)] if path.read_text().startswith("#!/usr/bin/env python3") else [str(path)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["bench-clients", "cpu-ab", "gguf-to-hf", "install-systemd"])
def test_help_says_how_to_use_the_script(name):
    r = run(name, "--help")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stdout.splitlines()) >= 3, r.stdout


@pytest.mark.parametrize("name, args, says", [
    ("bench-clients", ["--bogus"], "unknown option --bogus"),
    ("bench-clients", ["http://127.0.0.1:9"], "no model list at http://127.0.0.1:9/v1/models"),
    ("gguf-to-hf", ["/nonexistent/model.gguf", "/nonexistent/out"], "/nonexistent/model.gguf"),
    ("gguf-to-hf", ["--bogus"], "usage: scripts/gguf-to-hf MODEL.gguf OUT_DIR"),
    ("install-systemd", ["--bogus"], "unknown option --bogus"),
])
def test_a_wrong_argument_is_one_line(name, args, says):
    r = run(name, *args)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert says in r.stderr


def test_a_test_process_count_that_is_not_one_is_refused_before_any_install():
    r = subprocess.run([str(SCRIPTS / "test")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PDD_TEST_WORKERS": "two"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "PDD_TEST_WORKERS" in r.stderr and "'two'" in r.stderr


def test_every_install_pins_the_one_torch_of_scripts_lib_venv_sh():
    """scripts/up and scripts/test (ensure_venv) and scripts/install-systemd get
    torch from one pin: an unpinned pip install resolves the newest torch and
    its CUDA wheels, even on a CPU host."""
    def requirement(env: dict) -> str:
        return subprocess.run(["bash", "-c", f". {SCRIPTS}/lib/venv.sh && torch_requirement"],
                              capture_output=True, text=True, env=env, timeout=60).stdout.strip()

    assert requirement({"PATH": "/usr/bin:/bin"}) == "torch==2.13.0"
    assert requirement({"PATH": "/usr/bin:/bin", "PDD_TORCH_VERSION": "2.11.0"}) == "torch==2.11.0"
    install = (SCRIPTS / "install-systemd").read_text()
    assert '. "$src/scripts/lib/venv.sh"' in install
    assert 'torch_requirement > "$copy.constraints"' in install
    assert '--constraint "$copy.constraints"' in install
    pips = [line for line in install.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert pips and all("--constraint" in line for line in pips), pips


def test_device_check_runs_only_tools_that_exist():
    """scripts/device-check runs on the GPU machines only: a benchmark it names
    that moved or went would fail there, in scarce device time. Each
    `python3 -m benchmarks.NAME` is a benchmarks/ tool, each `pdd.cli bench NAME`
    a `pdd bench` subcommand."""
    import importlib
    import re

    from pdd.cli import build_parser

    text = (SCRIPTS / "device-check").read_text()
    tools = set(re.findall(r"python3 -m benchmarks\.(\w+)", text))
    subcommands = set(re.findall(r"python3 -m pdd\.cli bench ([\w-]+)", text))
    assert tools and subcommands
    for name in tools:
        assert callable(importlib.import_module(f"benchmarks.{name}").main), name
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    choices = next(a for a in bench._actions if a.dest == "bench").choices
    assert subcommands <= set(choices), subcommands - set(choices)
