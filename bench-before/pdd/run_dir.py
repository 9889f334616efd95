"""`pdd up`'s run directory: the generated config, the keys and the logs of one
local cluster, and the lock that makes the directory that cluster's alone.

`pdd up` changes nothing it did not make. A new directory is made 0700; an
existing one is used as it is (its mode, its files, its keys), provided it
is this user's and nobody else can write in it: whoever can replace files
there could hand the cluster a config or keys of their choosing. Keys found there are used again
if they form a whole key set, else the start is refused; where there are
none, a fresh set is made.

While a `pdd up` runs it holds an exclusive flock on `up.lock`. The kernel
drops the lock when that process ends, however it ends (kill -9 included):
there is no stale lock to clean up, and a pid that a new process took over
can never make a free directory look busy.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from pdd.config import ConfigError
from pdd.security import (ADMIN, AUTHORIZED_ADMINS, AUTHORIZED_WORKERS, WORKER, check_key_set, generate_keys,
                          router_roles, untrusted_dir)

LOCK_FILE = "up.lock"
KEYS = "keys"


class RunDirBusy(RuntimeError):
    """Another `pdd up` holds the directory (a later try may succeed)."""


class RunDirRefused(RuntimeError):
    """The directory, or the keys in it, cannot be used (a retry fails the same way)."""


def claim_run_dir(path: Path, holder: str) -> int:
    """`path` made (0700) or checked, and locked for this process; the lock's
    file descriptor, to keep open while the cluster runs. `holder`: who holds
    it, as the refusal of the next `pdd up` will name it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise RunDirRefused(f"run dir {path} is not a directory") from None
        why = untrusted_dir(path)
        if why:
            raise RunDirRefused(f"run dir {why}: they could replace the config and keys pdd up keeps there; "
                                "pick a directory only you can write (a new one is made 0700)") from None
    except OSError as e:
        raise RunDirRefused(f"run dir {path}: cannot make it ({e.strerror or e})") from None
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 200).decode(errors="replace").strip() or "another pdd up"
        os.close(fd)
        raise RunDirBusy(f"run dir {path} is in use by {other}; stop that one or pick another --run-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{holder}\n".encode())
    return fd


def run_dir_keys(path: Path, routers: int = 1) -> Path:
    """The run directory's keys: the ones an earlier run left, if whole, else a
    fresh set; with a pair of its own for each of `routers` routers."""
    keys = path / KEYS
    if not keys.exists():
        return generate_keys(keys, (*router_roles(routers), WORKER, ADMIN))
    try:
        for d in (keys, keys / AUTHORIZED_WORKERS, keys / AUTHORIZED_ADMINS):
            why = d.is_dir() and untrusted_dir(d)
            if why:
                raise ConfigError(why)
        check_key_set(keys)
    except ConfigError as e:
        raise RunDirRefused(f"{keys}, left by an earlier run, cannot be used ({e}); "
                            "remove it to have a fresh key set made") from None
    missing = tuple(r for r in router_roles(routers) if not (keys / f"{r}.key_secret").exists())
    if missing:   # an earlier run had fewer routers
        generate_keys(keys, missing)
    return keys
