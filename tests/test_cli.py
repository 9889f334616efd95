"""The `pdd` executable, run as a user runs it."""
from __future__ import annotations

import os
import subprocess
import sys


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


def test_keys_generate_refuses_to_overwrite(tmp_path):
    assert pdd("keys", "generate", str(tmp_path / "k")).returncode == 0
    r = pdd("keys", "generate", str(tmp_path / "k"))
    assert r.returncode == 2 and "never overwritten" in r.stderr and "Traceback" not in r.stderr
