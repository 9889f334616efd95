"""`python -m benchmarks.transfer` as a user runs it: a small request of the tiny KV shape
through every backend that runs on the CPU (the decode side a process of its
own), a row of figures for each, the pages checked; bad arguments refused with
an error that names them (before anything starts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import transfer
from benchmarks.cli import run
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable

NIXL = nixl_unavailable() is None


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.transfer", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def rows(stdout: str) -> dict[tuple[str, int], list[str]]:
    """The table's rows by (backend, tokens)."""
    out = {}
    for line in stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ("nixl", "cuda_ipc", "tcp", "local") and len(cells) >= 9:
            out[(cells[0], int(cells[3]))] = cells
    return out


def test_each_cpu_backend_moves_a_request_and_prints_its_figures(tmp_path):
    out = tmp_path / "r.json"
    p = bench("--shape", "tiny", "--tokens", "64,100", "--repeats", "1", "--json", str(out))
    assert p.returncode == 0, p.stderr
    want = (["nixl"] if NIXL else []) + ["tcp", "local"]
    got = rows(p.stdout)
    assert sorted(got) == sorted((b, t) for b in want for t in (64, 100)), p.stdout
    for (backend, _), cells in got.items():
        ms, gb_s = float(cells[6]), float(cells[7])
        assert ms > 0 and gb_s > 0, cells
    runs = json.loads(out.read_text())["runs"]
    assert [(r["backend"], r["tokens"]) for r in runs] == [(b, t) for b in want for t in (64, 100)]
    # 100 tokens = 7 blocks of 16; 4 layers x k|v x 7 blocks x 16 x 2 heads x 32 x 4 bytes.
    assert {r["blocks"] for r in runs if r["tokens"] == 100} == {7}
    assert {r["bytes"] for r in runs if r["tokens"] == 100} == {4 * 2 * 7 * 16 * 2 * 32 * 4}
    assert {r["receiver"] for r in runs} == {"own process", "this process"}
    if NIXL:
        assert all(r["descriptors"] > 0 for r in runs if r["backend"] == "nixl")


@pytest.mark.skipif(not NIXL, reason=str(nixl_unavailable()))
def test_ucx_tls_reaches_both_ends_of_nixl(tmp_path):
    out = tmp_path / "r.json"
    p = bench("--shape", "tiny", "--tokens", "64", "--repeats", "1", "--backends", "nixl", "--ucx-tls", "tcp",
              "--contiguous", "--json", str(out), env={"UCX_TLS": "all"})
    assert p.returncode == 0, p.stderr
    assert "UCX_TLS=tcp" in p.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert json.loads(out.read_text())["ucx_tls"] == "tcp"
    # 4 blocks, consecutive: one descriptor per k|v per layer.
    assert run["backend"] == "nixl" and run["descriptors"] == 4 * 2


@pytest.mark.skipif(not NIXL, reason=str(nixl_unavailable()))
def test_block_orders_name_the_descriptors_a_pool_of_that_shape_costs(tmp_path, capsys):
    """Straight into the blocks (--nixl-landing off), one range of the pool
    costs one descriptor per k|v per layer in any order; scattered blocks (no
    two neighbours) one per block. Through the landing region (the default),
    one per k|v per layer whatever the order."""
    # In this process, the decode side in a thread: the descriptors are what the
    # sender names, wherever the pool it writes lives; six runs as processes of
    # their own (each two interpreters importing torch and NIXL) took 40 s of a
    # busy 2-core machine. The decode side's own process is the test above.
    descs = {}
    for landing in ("off", "on"):
        for order in ("descending", "shuffled", "scattered"):
            out = tmp_path / f"{order}-{landing}.json"
            assert run(transfer, ["--shape", "tiny", "--tokens", "64", "--repeats", "1", "--backends", "nixl",
                                  "--blocks", order, "--nixl-landing", landing, "--receiver-thread",
                                  "--json", str(out)]) == 0
            assert f"{order} blocks; nixl landing region {landing}" in capsys.readouterr().out
            (one,) = json.loads(out.read_text())["runs"]
            descs[order, landing] = one["descriptors"]
    assert descs == {("descending", "off"): 4 * 2, ("shuffled", "off"): 4 * 2,
                     ("scattered", "off"): 4 * 2 * 4,   # 4 layers, 4 blocks
                     ("descending", "on"): 4 * 2, ("shuffled", "on"): 4 * 2, ("scattered", "on"): 4 * 2}


@pytest.mark.parametrize("args, says", [
    (["--backends", "cuda_ipc"], "--backends cuda_ipc needs --device cuda"),
    (["--backends", "tcp,rdma"], "unknown backend 'rdma'"),
    (["--backends", "tcp,tcp"], "distinct backends"),
    (["--tokens", "0"], "--tokens '0'"),
    (["--device", "gpu"], "--device 'gpu'"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_arguments_are_refused_by_name(args, says, capsys):
    assert run(transfer, ["--shape", "tiny", "--tokens", "64", *args]) == 2
    assert says in capsys.readouterr().err
