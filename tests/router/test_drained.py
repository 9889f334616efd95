"""The drained workers' state file (pdd.router.drained): written whole and
atomically, read back, and a damaged one logged and ignored."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from pdd.router.drained import FILE_NAME, DrainedWorkers, state_dir


def test_kept_and_read_back(tmp_path):
    store = DrainedWorkers(tmp_path / "state")
    assert store.load() == set()                  # no file yet
    store.save({"decode-1", "decode-0"})
    assert json.loads((tmp_path / "state" / FILE_NAME).read_text()) == {"version": 1,
                                                                         "drained": ["decode-0", "decode-1"]}
    assert DrainedWorkers(tmp_path / "state").load() == {"decode-0", "decode-1"}
    store.save(set())
    assert DrainedWorkers(tmp_path / "state").load() == set()
    assert [p.name for p in (tmp_path / "state").iterdir()] == [FILE_NAME]   # no temporary file left


def test_a_damaged_file_is_logged_and_ignored(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    for body in ("{half", '["decode-0"]', '{"drained": [1]}', "\xff"):
        path.write_text(body, encoding="latin-1")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="pdd.router.drained"):
            assert DrainedWorkers(tmp_path).load() == set()
        assert str(path) in caplog.text and "starting with no worker drained" in caplog.text, body


def test_where_it_is_kept(monkeypatch, tmp_path):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert state_dir("") is None and DrainedWorkers(None).load() == set()
    DrainedWorkers(None).save({"x"})              # nowhere: nothing written, no error
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")   # systemd's StateDirectory=
    assert state_dir("") == tmp_path / "a"
    assert state_dir("/srv/pdd") == Path("/srv/pdd")
