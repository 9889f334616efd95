"""The workers an operator drained, kept in the router's state directory so
that a restarted router keeps them drained (`pdd admin drain` / `undrain`).

One small JSON file, `drained-workers.json`: {"version": 1, "drained": [ids]}.
It is replaced whole and atomically (written beside, flushed, renamed over),
so a router killed mid-write leaves the old file or the new one, never half
of one. A file that cannot be read or parsed is logged as an error naming it
and what is wrong, and the router starts with no worker drained: a damaged
state file must not keep the router from serving.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "drained-workers.json"
_VERSION = 1


def state_dir(configured: str) -> Path | None:
    """router.state_dir, else systemd's $STATE_DIRECTORY (its first entry), else None (nothing kept)."""
    chosen = configured or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(chosen) if chosen else None


class DrainedWorkers:
    """The drained worker ids on disk (or nowhere when `directory` is None)."""

    def __init__(self, directory: Path | None):
        self.path = directory / FILE_NAME if directory is not None else None

    def load(self) -> set[str]:
        """The ids kept; none when there is no file, or it cannot be used (logged)."""
        if self.path is None:
            return set()
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return set()
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return self._unusable(f"cannot be read as JSON ({e})")
        ids = data.get("drained") if isinstance(data, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return self._unusable('want {"version": 1, "drained": ["WORKER", ...]}')
        if ids:
            log.warning("workers drained before this router started (%s): %s; `pdd admin undrain WORKER` "
                        "takes one back", self.path, ", ".join(sorted(ids)))
        return set(ids)

    def _unusable(self, why: str) -> set[str]:
        log.error("router: drained-worker state %s %s; starting with no worker drained (the next drain or "
                  "undrain replaces the file)", self.path, why)
        return set()

    def save(self, ids: set[str]) -> None:
        """Replace the file with `ids` (OSError when it cannot be written)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"version": _VERSION, "drained": sorted(ids)}).encode()
        fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)   # the rename itself survives a power cut
        finally:
            os.close(dir_fd)
