"""The order tests/conftest.py collects the suite in, read from `pytest
--collect-only` in a process of its own: the modules that start processes
first, every module whole (its module-scoped cluster starts once, in one test
process under pytest-xdist), and the fast lane without them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import PROCESS_MODULES, TESTS

REPO = Path(__file__).resolve().parent.parent
# Given in this order: a plain module, a process-level one (PROCESS_MODULES),
# a plain one, an e2e module.
PATHS = ["tests/test_codec.py", "tests/test_cli.py", "tests/kv/test_block_pool.py", "tests/e2e/test_threshold.py"]


def collected(*args: str) -> list[str]:
    """The module of each test collected, in order."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                        *PATHS], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line.split("::")[0] for line in r.stdout.splitlines() if "::" in line]


def runs(modules: list[str]) -> list[str]:
    """Each run of one module's tests, by its module."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def test_process_level_modules_come_first_and_every_module_stays_whole():
    assert runs(collected()) == ["tests/test_cli.py", "tests/e2e/test_threshold.py", "tests/test_codec.py",
                                 "tests/kv/test_block_pool.py"]


def test_the_fast_lane_holds_no_process_level_module():
    assert runs(collected("-m", "not slow")) == ["tests/test_codec.py", "tests/kv/test_block_pool.py"]


def test_every_process_level_module_named_is_there():
    # A name left behind by a move marks nothing: the module it meant ran in the
    # fast lane and after every process-level one (benchmarks/test_transfer_bench.py,
    # a minute of peers in processes of their own, once did).
    assert sorted(m for m in PROCESS_MODULES if not (TESTS / m).is_file()) == []
