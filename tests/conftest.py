"""Shared fixtures (tiny random-weight checkpoints built once per test session)
and the test lanes: which tests are slow, decided here from where a test lives
and what its module uses, so that a new test lands in its lane unmarked."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# One torch (OpenMP) thread in this process and the processes it starts, unless
# the caller chose: on a busy 2-core machine, threads spinning in the test
# process (the offline reference engine, kernels under the interpreter) collide
# with each other and with the cluster's workers, and a reference generation
# beside a running cluster can take fifty times as long (docs/benchmarks.md shows
# the same collision between workers). Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pdd.model.make_model import make_model  # noqa: E402  (after the thread count)

TESTS = Path(__file__).resolve().parent

# Modules that start pdd processes outside tests/e2e/: `pdd serve` / `pdd up`,
# the `pdd` command itself, a data plane's peer in a process of its own.
PROCESS_MODULES = frozenset({"security/test_processes.py", "test_cli.py", "transfer/test_nixl.py",
                             "transfer/test_nixl_landing.py", "benchmarks/test_transfer_bench.py"})

MARKERS = {
    "e2e": "starts real pdd processes (`pdd up` clusters, `pdd serve`); slow",
    "hf": "compares against Hugging Face transformers; slow",
    "kernels": "runs the Triton kernels (under the interpreter on a CPU); slow",
    "slow": "left out of the fast lane (`scripts/test --fast`)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def lanes_of(item: pytest.Item) -> set[str]:
    """The lane markers a test gets from where it lives and what its module uses:
    e2e for everything under tests/e2e/, PROCESS_MODULES and any module using the
    `pdd up` cluster (UpCluster); hf for modules named test_hf_*.py; kernels for
    everything under tests/ops/."""
    try:
        where = item.path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return set()
    lanes = set()
    if where.startswith("e2e/") or where in PROCESS_MODULES or hasattr(getattr(item, "module", None), "UpCluster"):
        lanes.add("e2e")
    if item.path.name.startswith("test_hf_"):
        lanes.add("hf")
    if where.startswith("ops/"):
        lanes.add("kernels")
    return lanes


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in lanes_of(item) - {m.name for m in item.iter_markers()}:
            item.add_marker(name)
        # e2e, hf and kernels imply slow, whether found here or written on the test.
        if any(item.get_closest_marker(m) for m in ("e2e", "hf", "kernels")) and not item.get_closest_marker("slow"):
            item.add_marker("slow")
    # Modules that start processes first, each kept whole: under pytest-xdist
    # (scripts/test) the longest ones then start early beside the short ones
    # instead of ending the run alone.
    first = {item.path for item in items if item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in first)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache = {}

    def get(arch: str = "llama", preset: str = "tiny"):
        key = (arch, preset)
        if key not in cache:
            cache[key] = make_model(tmp_path_factory.mktemp(f"{preset}-{arch}"), preset=preset, arch=arch)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_model(model_factory):
    return model_factory("llama")


@pytest.fixture(autouse=True, scope="module")
def _gpu_memory_given_back():
    """After each module, the GPU memory its dead engines' tensors left in
    torch's caching allocator goes back to the device: the worker processes
    that later modules start need it (one GPU, shared by every test)."""
    yield
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc
        gc.collect()
        torch.cuda.empty_cache()
