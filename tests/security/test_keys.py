"""Key files, the [security] table, and what a process needs before it starts."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from pdd.config import ConfigError
from pdd.config_loader import load_cluster_config
from pdd.security import (KeyDir, admin_token_problem, check_start, control_security, data_security,
                          generate_keys, worker_public_key, write_private)
from tests.security.conftest import secure_config


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generated_key_set_and_its_file_modes(keys):
    assert mode(keys) == 0o700
    for role in ("router", "worker", "admin"):
        assert mode(keys / f"{role}.key_secret") == 0o600
        assert "secret-key" in (keys / f"{role}.key_secret").read_text()
        assert "secret-key" not in (keys / f"{role}.key").read_text()
    assert (keys / "authorized_workers" / "worker.key").read_text() == (keys / "worker.key").read_text()
    assert (keys / "authorized_admins" / "admin.key").read_text() == (keys / "admin.key").read_text()
    assert not (keys / "authorized_workers" / "router.key").exists()


def test_keys_are_never_overwritten(keys):
    before = (keys / "router.key_secret").read_text()
    with pytest.raises(ValueError, match="never overwritten"):
        generate_keys(keys)
    assert (keys / "router.key_secret").read_text() == before


def test_pdd_keys_generate_one_more_worker(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pdd.cli", "keys", "generate", str(tmp_path / "host-b"),
                        "--only", "worker"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "host-b").iterdir()) == \
        ["authorized_workers", "worker.key", "worker.key_secret"]


def test_without_keys_a_process_refuses_to_start_and_says_what_to_do():
    cfg = load_cluster_config(env={})
    for role in ("router", "decode"):
        with pytest.raises(ConfigError, match=r"pdd keys generate DIR.*security\.insecure = true"):
            control_security(cfg, role)


def test_insecure_means_no_keys_anywhere():
    cfg = load_cluster_config(env={}, overrides={"security": {"insecure": True}})
    assert control_security(cfg, "router") is None and data_security(cfg) is None
    assert worker_public_key(cfg) == ""


def test_a_missing_key_file_is_named(tmp_path, keys):
    partial = generate_keys(tmp_path / "k", roles=("worker",))   # a worker host that lacks router.key
    with pytest.raises(ConfigError, match=r"router\.key"):
        control_security(secure_config(partial), "decode")
    with pytest.raises(ConfigError, match=r"router\.key_secret"):
        control_security(secure_config(partial), "router")


def test_roles_get_their_own_pairs(secure_cfg, keys):
    router, worker = control_security(secure_cfg, "router"), control_security(secure_cfg, "prefill")
    assert router.public_key != worker.public_key
    assert worker.server_key == router.public
    assert worker_public_key(secure_cfg) == (keys / "worker.key").read_text().split('"')[1]


@pytest.mark.parametrize("token", ["", "change-me", "CHANGE-ME", "secret", "short-token"])
def test_weak_admin_tokens(token):
    assert admin_token_problem(token)


def test_router_start_refuses_a_placeholder_token(keys):
    with pytest.raises(ConfigError, match="placeholder 'change-me'.*PDD_ROUTER__ADMIN_TOKEN"):
        check_start(secure_config(keys, router={"admin_token": "change-me"}), "router")
    check_start(secure_config(keys, router={"admin_token": "0123456789abcdef0123"}), "router")


def test_write_private_tightens_an_existing_file(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(path, "admin_token = 'x'")
    assert mode(path) == 0o600 and path.read_text() == "admin_token = 'x'"


def test_authorized_directory_is_reread_when_it_changes(tmp_path, stranger_keys):
    d = tmp_path / "authorized"
    d.mkdir()
    allowed = KeyDir(d)
    stranger = (stranger_keys / "worker.key").read_text().split('"')[1].encode()
    assert allowed.lookup(stranger) is None
    (d / "host-c.key").write_text((stranger_keys / "worker.key").read_text())
    os.utime(d, ns=(1, 1))   # a new mtime even within the filesystem's timestamp granularity
    assert allowed.lookup(stranger) == "host-c"


@pytest.mark.parametrize("table, message", [
    ({"open_paths": ["/v1/completions"]}, "security.open_paths"),
    ({"http_body_timeout_s": 0}, "security.http_body_timeout_s"),
    ({"http_max_connections": 0}, "security.http_max_connections"),
    ({"api_keys": ["has space"]}, r"security.api_keys\[0\]"),
    ({"cors_origins": ["example.com"]}, "security.cors_origins: 'example.com' is not an origin"),
    ({"cors_origins": ["https://example.com/"]}, "security.cors_origins"),
    ({"keys": "x"}, "unknown key"),
])
def test_security_table_errors_name_the_key(table, message):
    with pytest.raises(ConfigError, match=message):
        load_cluster_config(env={}, overrides={"security": table})


def test_api_keys_from_the_environment():
    cfg = load_cluster_config(env={"PDD_SECURITY__API_KEYS": "k1-abc,k2-def"})
    assert cfg.security.api_keys == ("k1-abc", "k2-def")


def test_a_malformed_key_file_is_named(tmp_path):
    d = generate_keys(tmp_path / "k")
    (d / "router.key").write_text('public-key = "not a z85 key at all, not even forty"\n')
    with pytest.raises(ConfigError, match=r"router\.key holds a malformed key"):
        control_security(secure_config(d), "decode")


@pytest.mark.parametrize("where, mode_bits", [("", "0770"), ("authorized_workers", "0777"), ("authorized_admins", "0720")])
def test_a_key_directory_others_may_write_is_refused_at_start(tmp_path, where, mode_bits):
    """Whoever may write in it could authorize a key of their own (or swap the router's)."""
    d = generate_keys(tmp_path / "k")
    os.chmod(d / where, int(mode_bits, 8))
    cfg = secure_config(d, router={"admin_token": "a" * 32})
    with pytest.raises(ConfigError, match=f"{d / where} is writable by other users"):
        check_start(cfg, "router")


def test_a_key_file_others_may_write_lets_nobody_in(tmp_path, stranger_keys, caplog):
    d = generate_keys(tmp_path / "k")
    allowed = KeyDir(d / "authorized_workers")
    mine = (d / "worker.key").read_text().split('"')[1].encode()
    assert allowed.lookup(mine) == "worker"
    os.chmod(d / "authorized_workers" / "worker.key", 0o666)
    os.utime(d / "authorized_workers", ns=(1, 1))   # the directory is read again
    assert allowed.lookup(mine) is None
    assert "worker.key is writable by other users" in caplog.text


@pytest.mark.parametrize("line, message", [
    ("[router]\nadmin_token = 4829301847562910384\n", "router.admin_token: expected str, got int"),
    ('[security]\napi_keys = [["sk-team-a-4829301847562910384"]]\n', "security.api_keys: expected str, got list"),
    ('[tracing]\nheaders = [{authorization = "Bearer 4829301847562910384"}]\n', "tracing.headers: expected str, got dict"),
])
def test_a_secret_of_the_wrong_type_is_named_never_quoted(tmp_path, line, message):
    """A config error goes to stderr and the journal, which more people read than the config."""
    path = tmp_path / "pdd.toml"
    path.write_text(line)
    with pytest.raises(ConfigError, match=message) as e:
        load_cluster_config(path, env={})
    assert "4829301847562910384" not in str(e.value)


def test_a_key_overwritten_in_place_is_read_again(tmp_path, stranger_keys):
    """Rotating a host's key by copying the new public key over the old file
    leaves the directory's mtime as it was: the old key must still go."""
    d = generate_keys(tmp_path / "k")
    allowed = KeyDir(d / "authorized_workers")
    old = (d / "worker.key").read_text().split('"')[1].encode()
    new = (stranger_keys / "worker.key").read_text().split('"')[1].encode()
    assert allowed.lookup(old) == "worker"
    before = os.stat(d / "authorized_workers").st_mtime_ns
    path = d / "authorized_workers" / "worker.key"
    path.write_text((stranger_keys / "worker.key").read_text())
    os.utime(path, ns=(1, 1))   # a new mtime even within the filesystem's timestamp granularity
    assert os.stat(d / "authorized_workers").st_mtime_ns == before
    assert allowed.lookup(old) is None and allowed.lookup(new) == "worker"


def test_each_router_of_several_proves_itself_with_its_own_pair(tmp_path):
    """`pdd keys generate --routers 2`: router 1 serves with router-1's pair, and
    workers and `pdd admin` dial it with router-1's public key — a process
    holding only router.key_secret cannot pass for router 1 — while a key set
    without a router-1 pair has router 1 use the cluster's router pair."""
    from pdd.config_loader import load_cluster_config
    from pdd.security import (admin_client_security, admin_security, control_security, generate_keys,
                              router_roles)
    d = generate_keys(tmp_path / "keys", (*router_roles(2), "worker", "admin"))
    routers = {"control_addrs": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
               "admin_addrs": ["tcp://127.0.0.1:3", "tcp://127.0.0.1:4"]}
    cfg = [load_cluster_config(env={}, overrides={"security": {"keys_dir": str(d)}, "router": {**routers, "index": i}})
           for i in (0, 1)]
    served = [control_security(c, "router").public for c in cfg]
    assert served[0] != served[1] and [admin_security(c).public for c in cfg] == served
    assert [control_security(cfg[0], "worker", i).server_key for i in (0, 1)] == served
    assert [admin_client_security(d, i).server_key for i in (0, 1)] == served
    shared = generate_keys(tmp_path / "shared")
    one = load_cluster_config(env={}, overrides={"security": {"keys_dir": str(shared)}, "router": {**routers,
                                                                                                 "index": 1}})
    assert control_security(one, "router").public == control_security(one, "worker", 0).server_key
