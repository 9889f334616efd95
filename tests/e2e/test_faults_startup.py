"""`pdd up` whose child cannot start, with real processes: the error says why
(the child's own words, from its log) and no child is left behind."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from pdd.launcher import free_port
from pdd.supervisor import last_error


def processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_worker_address_in_use_is_named_by_up_and_nothing_is_left_running(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "pdd.toml"
        config.write_text(f'[router]\ncontrol_addr = "tcp://127.0.0.1:{free_port()}"\n'
                          f'admin_addr = "tcp://127.0.0.1:{free_port()}"\n'
                          f'[worker]\ndata_addr = "tcp://127.0.0.1:{port}"\n')
        env = {**os.environ, "PDD_ENGINE__DEVICE": "cpu"}
        up = subprocess.run([sys.executable, "-m", "pdd.cli", "up", "--model", str(tiny_model), "--config", str(config),
                             "--mode", "colocated", "--port", str(free_port()), "--run-dir", str(run_dir)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert up.returncode == 1, up.stderr
    assert "colocated-0 exited with code 78 during start-up" in up.stderr, up.stderr
    assert f"tcp://127.0.0.1:{port}" in up.stderr and "in use" in up.stderr, up.stderr
    assert processes_naming(str(run_dir)) == []


def test_the_reason_is_the_last_error_of_this_start_in_text_or_json(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("2026-01-01 00:00:00,000 ERROR pdd.x: an old start's error\n")
    start = log.stat().st_size
    assert last_error(log, start) is None
    with open(log, "a") as f:
        f.write("2026-01-01 00:00:01,000 INFO pdd.x: starting\n"
                "2026-01-01 00:00:02,000 ERROR pdd.worker.engine_thread: cannot bind tcp://h:1: in use\n"
                "2026-01-01 00:00:02,100 INFO pdd.x: stopped\n")
    assert last_error(log, start) == "cannot bind tcp://h:1: in use"
    with open(log, "a") as f:
        f.write('{"ts": "t", "level": "CRITICAL", "logger": "pdd.x", "msg": "the engine failed"}\n')
    assert last_error(log, start) == "the engine failed"
    with open(log, "a") as f:
        f.write("pdd serve: router: an address it must listen on is in use\n")
    assert last_error(log, start) == "router: an address it must listen on is in use"
    assert last_error(tmp_path / "none.log") is None
