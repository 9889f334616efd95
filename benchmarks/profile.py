"""Where the router's CPU goes: py-spy recordings of processes over a measured
window (`python -m benchmarks.router_tokens --py-spy DIR`), with the functions
most often on their stacks.

    python -m benchmarks.router_tokens --streams 256 --py-spy /tmp/spy

py-spy records raw folded stacks (DIR/routers-N-streams-C-PID.txt, one per
router process); the top of them, over every router of a point, is printed.
"""
from __future__ import annotations

import collections
import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def py_spy_exe() -> str:
    """The py-spy executable (on PATH, or beside this Python); refused clearly when absent."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise ValueError("--py-spy: py-spy is not installed (pip install py-spy)")
    return exe


def start_recording(pids: list[int], prefix: Path) -> list[tuple[subprocess.Popen, Path]]:
    """py-spy on each of `pids`, its folded stacks to PREFIX-PID.txt."""
    exe = py_spy_exe()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spies = []
    for pid in pids:
        out = prefix.with_name(f"{prefix.name}-{pid}.txt")
        spies.append((subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                                        "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL), out))
    return spies


def stop_recording(spies: list[tuple[subprocess.Popen, Path]]) -> list[Path]:
    """Stop the recordings (py-spy writes its file on SIGINT); the files written."""
    for proc, _ in spies:
        proc.send_signal(signal.SIGINT)
    for proc, _ in spies:
        proc.wait(30)
    return [out for _, out in spies if out.exists()]


def top_functions(folded: list[Path], n: int = 15) -> list[tuple[str, float, float]]:
    """(function, share of samples it is on the stack of, share it is the leaf of), the most inclusive first."""
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for path in folded:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack:
                continue
            frames = [f.split(" (", 1)[0] + " (" + f.rsplit("/", 1)[-1].split(":")[0] for f in stack.split(";")]
            frames = [f.rstrip("(") + ")" if "(" in f else f for f in frames]
            c = int(count)
            total += c
            for f in set(frames):
                inclusive[f] += c
            leaf[frames[-1]] += c
    return [(f, c / total, leaf[f] / total) for f, c in inclusive.most_common(n)] if total else []


def print_top(folded: list[Path], title: str, n: int) -> None:
    print(f"{title} (inclusive, leaf share of samples):")
    for f, inc, leaf in top_functions(folded, n):
        print(f"  {inc:6.1%} {leaf:6.1%}  {f}")


@contextlib.contextmanager
def recording(pids: list[int], prefix: Path, title: str, top: int):
    """py-spy on `pids` while the block runs; then the top of what it saw, printed."""
    spies = start_recording(pids, prefix)
    try:
        yield
    finally:
        print_top(stop_recording(spies), title, top)
