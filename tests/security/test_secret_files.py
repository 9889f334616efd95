"""Secrets kept off the command line: key and token files, the environment's
list format, and a child that ends with the parent that started it."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from pdd.config_loader import load_cluster_config
from pdd.security import read_secret_file


def test_a_secret_file_holds_one_secret_a_line(tmp_path, caplog):
    f = tmp_path / "keys"
    f.write_text("# team A\nsk-a-0123456789\n\n   \n  sk-b-0123456789  \n  # retired: sk-old\n")
    os.chmod(f, 0o600)
    with caplog.at_level(logging.WARNING):
        assert read_secret_file(f, "--api-key-file") == ["sk-a-0123456789", "sk-b-0123456789"]
    assert not caplog.records


@pytest.mark.parametrize("name, why", [("missing", "no such file"), ("empty", "holds no secret"),
                                       ("comments", "holds no secret"), ("a-directory", "cannot read it")])
def test_a_secret_file_that_gives_nothing_is_a_clear_error(tmp_path, name, why):
    (tmp_path / "empty").write_text("")
    (tmp_path / "comments").write_text("# nothing yet\n\n")
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(ValueError) as e:
        read_secret_file(tmp_path / name, "--api-key-file")
    assert str(e.value).startswith(f"--api-key-file {tmp_path / name}: {why}") and "\n" not in str(e.value)


def test_a_secret_file_others_can_read_is_warned_about(tmp_path, caplog):
    f = tmp_path / "token"
    f.write_text("0123456789abcdef0123\n")
    os.chmod(f, 0o644)
    with caplog.at_level(logging.WARNING):
        assert read_secret_file(f, "--token-file") == ["0123456789abcdef0123"]
    assert any("readable by other users" in r.getMessage() and str(f) in r.getMessage() for r in caplog.records)


def test_api_keys_from_the_environment_are_comma_separated():
    cfg = load_cluster_config(env={"PDD_SECURITY__API_KEYS": " sk-one-abc , sk-two-def,,"})
    assert cfg.security.api_keys == ("sk-one-abc", "sk-two-def")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux: PR_SET_PDEATHSIG")
def test_a_child_whose_parent_is_already_gone_stops_at_once():
    """The parent may die between the child's start and its request to the
    kernel, which then never signals: the child finds another parent and stops."""
    script = ("import os\nfrom pdd.lifetime import die_with_parent\n"
              "die_with_parent(os.getppid() + 1)\nprint('still running', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM and "still running" not in r.stdout, (r.returncode, r.stderr)
    script = ("import os\nfrom pdd.lifetime import die_with_parent\n"
              "assert die_with_parent(os.getppid())\nprint('still running', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "still running" in r.stdout, r.stderr
