"""Cluster layouts a sweep compares, and `pdd up` run for one of them.

    colocated:N      pdd up --mode colocated --workers N
    disagg:PpDd      pdd up --mode disagg --prefill P --decode D
    adaptive:SPEC    the same as SPEC (N or PpDd) plus ADAPTIVE_UP_ARGS (--adaptive):
                     N colocated workers that also prefill for each other, or P
                     prefill + D decode workers, placed per request by measured
                     cost (`auto:` is the same kind)
    threshold:PpDd   disagg:PpDd with THRESHOLD_ENV (router.mode = threshold):
                     long uncached prompts to a prefill worker while its queue
                     has room, the rest prefilled where they decode

The cluster is `pdd up` in a subprocess, so a layout gets whatever `pdd up`
does, including flags added later: --layout-args adds any for one layout.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# What turns adaptive placement on for `pdd up` (router.mode = adaptive; its
# colocated workers also prefill for others). A layout without it is static.
ADAPTIVE_UP_ARGS: tuple[str, ...] = ("--adaptive",)
ADAPTIVE_ENV: dict[str, str] = {}
# What turns the threshold policy on (`pdd up` has no flag for it: the router's mode from the environment).
THRESHOLD_ENV: dict[str, str] = {"PDD_ROUTER__MODE": "threshold"}


@dataclass(frozen=True)
class Layout:
    name: str                                   # as given: "disagg:1p1d"
    up_args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def parse_layouts(text: str, extra_args: list[str] = (), extra_env: list[str] = ()) -> list[Layout]:
    """`--layouts` with `--layout-args NAME=ARGS` and `--layout-env NAME=KEY=VALUE` applied."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--layouts {text!r}: want a comma list of distinct layouts")
    more_args: dict[str, list[str]] = {}
    for item in extra_args:
        name, _, args = item.partition("=")
        more_args.setdefault(_known(name, names, "--layout-args"), []).extend(shlex.split(args))
    more_env: dict[str, dict[str, str]] = {}
    for item in extra_env:
        name, _, kv = item.partition("=")
        key, eq, value = kv.partition("=")
        if not eq or not key:
            raise ValueError(f"--layout-env {item!r}: want LAYOUT=KEY=VALUE")
        more_env.setdefault(_known(name, names, "--layout-env"), {})[key] = value
    return [_layout(n, more_args.get(n, []), more_env.get(n, {})) for n in names]


def _known(name: str, names: list[str], flag: str) -> str:
    if name not in names:
        raise ValueError(f"{flag}: {name!r} is not among --layouts ({', '.join(names)})")
    return name


def _layout(name: str, more_args: list[str], more_env: dict[str, str]) -> Layout:
    kind, _, spec = name.partition(":")
    if kind not in ("colocated", "disagg", "adaptive", "auto", "threshold"):
        raise ValueError(f"layout {name!r}: want colocated:N, disagg:PpDd (e.g. disagg:1p1d), adaptive:N|PpDd "
                         f"or threshold:PpDd")
    base = _static(name, spec)
    if kind in ("colocated", "disagg", "threshold"):
        if base[1] != ("colocated" if kind == "colocated" else "disagg"):
            raise ValueError(f"layout {name!r}: {kind} takes {'N' if kind == 'colocated' else 'PpDd'}")
        env = {**THRESHOLD_ENV, **more_env} if kind == "threshold" else more_env
        return Layout(name, (*base, *more_args), env)
    return Layout(name, (*base, *ADAPTIVE_UP_ARGS, *more_args), {**ADAPTIVE_ENV, **more_env})


def _static(name: str, spec: str) -> tuple[str, ...]:
    """`pdd up` arguments of N colocated workers or P prefill + D decode workers."""
    if spec.isdigit() and int(spec) > 0:
        return "--mode", "colocated", "--workers", spec
    m = re.fullmatch(r"(\d+)p(\d+)d", spec)
    if m and int(m[1]) > 0 and int(m[2]) > 0:
        return "--mode", "disagg", "--prefill", m[1], "--decode", m[2]
    raise ValueError(f"layout {name!r}: want N (> 0) workers or PpDd (P, D > 0)")


class UpProcess:
    """`pdd up` for one layout on a loopback port (a free one unless given); ready once it prints its URL."""

    def __init__(self, layout: Layout, work_dir: Path, model: str | None = None, api_key: str | None = None,
                 ready_timeout_s: float = 600.0, port: int | None = None, server_path: str | None = None):
        """port: the router's (default: a free one); server_path: run the pdd package under
        that directory instead of this one (a before/after in one sitting)."""
        from pdd.launcher import free_port

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work_dir / "up.log"
        self.run_dir = work_dir / "run"
        # -P: not the working directory first on sys.path, so that server_path decides which pdd serves.
        self.cmd = [sys.executable, *(["-P"] if server_path else []), "-m", "pdd.cli", "up", "--port", str(self.port),
                    "--run-dir", str(self.run_dir), "--ready-timeout", str(ready_timeout_s), *layout.up_args]
        if model:
            self.cmd += ["--model", model]
        self.env = {**os.environ, **layout.env}
        if server_path:
            self.env["PYTHONPATH"] = os.pathsep.join([server_path, *filter(None, [self.env.get("PYTHONPATH")])])
        if api_key:   # not on the command line, where any user of the host reads it
            self.env["PDD_SECURITY__API_KEYS"] = api_key
        self.ready_timeout_s = ready_timeout_s
        work_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> str:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.ready_timeout_s + 30   # `pdd up` gives up first
        while time.monotonic() < deadline:
            if "ready at" in self.log.read_text(errors="replace"):
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"`pdd up` did not become ready: {shlex.join(self.cmd)}\n"
                           f"{self.log.read_text(errors='replace')[-3000:]}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int:
        """As Ctrl-C would: the router drains, then the workers stop."""
        return interrupt(self.proc, 90.0)


def interrupt(proc: subprocess.Popen, timeout_s: float, sig: int = signal.SIGINT) -> int:
    """Ctrl-C a `pdd up` (or send it `sig`) and wait for it (killed if it
    outlives `timeout_s`); its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
