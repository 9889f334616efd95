"""Who may talk to which socket: CURVE keys, secret files, start-up checks.

Every ZeroMQ socket of a cluster runs CURVE (encrypted, and each end proves
who it is). The router's key pair serves the control bus and the admin socket;
each worker's pair dials the router and serves the worker's data socket. A
server lets in only the public keys found in its authorized directory, asked
through ZAP at every handshake (pdd.security.zap): a peer without such a key
never completes the handshake, so it can neither send nor receive one message.
The key files (`pdd keys generate DIR`):

    router.key, router.key_secret         the router's pair (secret: router host only)
    router-I.key, router-I.key_secret     router I's own pair in a cluster of several
                                          (`--routers N`); without it, router I uses router.key
    worker.key, worker.key_secret         a worker's pair (secret: worker hosts)
    admin.key,  admin.key_secret          the operator's pair for `pdd admin`
    authorized_workers/*.key              public keys let onto the control bus and data sockets
    authorized_admins/*.key               public keys let onto the admin socket

`security.insecure = true` runs every socket in plaintext with no
authentication (warned loudly at start); without it, a process with no keys
refuses to start. Files holding secrets are written 0600 in 0700 directories.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from pdd.config import ClusterConfig, ConfigError
from pdd.security.zap import HandshakeWatch, ZapHandler, count, counts

__all__ = ["Curve", "HandshakeWatch", "KeyDir", "admin_client_security", "admin_security", "admin_token_problem",
           "check_key_set", "check_start", "control_security", "count", "counts", "data_security", "generate_keys",
           "private_dir", "read_secret_file", "router_key_name", "router_roles", "untrusted_dir", "worker_public_key",
           "writable_by_others", "write_private"]

log = logging.getLogger(__name__)

ROUTER, WORKER, ADMIN = "router", "worker", "admin"
AUTHORIZED_WORKERS, AUTHORIZED_ADMINS = "authorized_workers", "authorized_admins"
# Placeholder admin tokens found in examples; refused at start like an empty one.
PLACEHOLDER_TOKENS = {"change-me", "changeme", "change_me", "secret", "token", "admin", "password", "xxx", "test"}
MIN_TOKEN_CHARS = 16


# ---------------------------------------------------------------- files

def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter (created if needed)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write a file holding secrets: 0600 from its first byte (never world-readable, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)   # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


def untrusted_dir(path: Path) -> str | None:
    """Why files in the existing directory `path` could be swapped by someone
    else (it is another user's, or others may write in it), or None."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    return writable_by_others(path)


def writable_by_others(path: Path) -> str | None:
    """Why users other than the owner could change what `path` holds (a
    directory, or a key file), or None."""
    mode = os.stat(path).st_mode
    if mode & 0o022:
        return f"{path} is writable by other users (mode {mode & 0o7777:04o}; chmod go-w it)"
    return None


def read_secret_file(path: str | Path, flag: str) -> list[str]:
    """The secrets in a file, one a line (blank lines and lines starting with #
    skipped). ValueError naming `flag` and the file if it is missing,
    unreadable or holds none; a warning if other users may read it (as ssh
    warns of a private key: the secret may already be out, and `chmod 600`
    mends it, so the start goes on)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    found = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        raise ValueError(f"{flag} {path}: holds no secret (one a line; blank lines and # comments are skipped)")
    if os.stat(path).st_mode & 0o077:
        log.warning("%s is readable by other users: chmod 600 it", path)
    return found


def _write_key(path: Path, public: bytes, secret: bytes | None) -> None:
    note = "secret key: keep it private, whoever holds it is this peer" if secret else "public key: safe to share"
    lines = [f"#   pdd CURVE {note}", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    text = "\n".join(lines) + "\n"
    if secret:
        write_private(path, text)
    else:
        path.write_text(text)
        os.chmod(path, 0o644)


def router_key_name(d: Path, index: int) -> str:
    """The pair router `index` serves with: its own (router-I) when the key set
    has one, else the cluster's router pair (router 0's own)."""
    own = f"{ROUTER}-{index}"
    return own if index and (d / f"{own}.key").exists() else ROUTER


def router_roles(count: int) -> tuple[str, ...]:
    """The key pairs of `count` routers: router (router 0's), router-1, ..."""
    return (ROUTER, *(f"{ROUTER}-{i}" for i in range(1, count)))


def generate_keys(directory: str | Path, roles: tuple[str, ...] = (ROUTER, WORKER, ADMIN)) -> Path:
    """Fresh key pairs for `roles` in `directory`, and their public keys in the
    authorized directories (workers', admins'). Existing keys are never overwritten."""
    d = private_dir(Path(directory))
    for role in roles:
        if (d / f"{role}.key_secret").exists():
            # ValueError: a message for the user, not a traceback (pdd.cli)
            raise ValueError(f"{d / (role + '.key_secret')} exists: keys are never overwritten; "
                             "pick an empty directory")
    for role in roles:
        public, secret = zmq.curve_keypair()
        _write_key(d / f"{role}.key", public, None)
        _write_key(d / f"{role}.key_secret", public, secret)
        allowed = {WORKER: AUTHORIZED_WORKERS, ADMIN: AUTHORIZED_ADMINS}.get(role)
        if allowed:
            _write_key(private_dir(d / allowed) / f"{role}.key", public, None)
    return d


def check_key_set(directory: str | Path) -> None:
    """ConfigError unless `directory` holds what `pdd keys generate` made: the
    three pairs, with the worker's and the admin's public keys authorized."""
    d = Path(directory)
    for role, allowed in ((ROUTER, None), (WORKER, AUTHORIZED_WORKERS), (ADMIN, AUTHORIZED_ADMINS)):
        public, _ = _load_pair(d, role)
        if allowed and KeyDir(d / allowed).lookup(public) is None:
            raise ConfigError(f"security.keys_dir: {d / allowed} does not hold {role}.key")


def _load_pair(d: Path, role: str) -> tuple[bytes, bytes]:
    path = d / f"{role}.key_secret"
    public, secret = _load_key(path)
    if secret is None:
        raise ConfigError(f"security.keys_dir: {path} holds no secret key")
    if os.stat(path).st_mode & 0o077:
        log.warning("%s is readable by other users: chmod 600 it", path)
    return public, secret


def _load_key(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError):
        raise ConfigError(f"security.keys_dir: cannot read the key file {path}; create keys with "
                          "`pdd keys generate DIR` (README.md, \"Keys\")") from None
    if not all(key is None or _well_formed(key) for key in (public, secret)):
        raise ConfigError(f"security.keys_dir: {path} holds a malformed key")
    return public, secret


def _well_formed(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):   # characters outside Z85
        return False


class KeyDir:
    """The public keys (*.key files) of one authorized directory, re-read when
    the directory or one of its key files changes: adding, removing or
    overwriting a file takes effect at the next handshake, without a restart."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple | None = None
        self._names: dict[bytes, str] = {}
        self.lookup(b"")   # a missing directory is a start-up error, not a silent "nobody"
        # Whoever may add a file here may let their own key in.
        why = writable_by_others(path)
        if why:
            raise ConfigError(f"security.keys_dir: {why}; whoever can write there can authorize a key of their own")

    def _files_stamp(self) -> tuple:
        """What changes when the directory does, or a key file's content or mode
        (a key overwritten in place leaves the directory's mtime as it was).
        OSError when the directory is gone."""
        directory = os.stat(self.path).st_mtime_ns
        files = []
        for f in self.path.glob("*.key"):
            try:
                st = os.stat(f)
            except OSError:   # removed since the listing: the directory's mtime says so
                continue
            files.append((f.name, st.st_mtime_ns, st.st_size, st.st_mode))
        return directory, tuple(sorted(files))

    def lookup(self, public_z85: bytes) -> str | None:
        """The name of the key file holding this public key, or None."""
        try:
            stamp = self._files_stamp()
        except OSError:
            if self._stamp is None:
                raise ConfigError(f"security.keys_dir: no directory {self.path}; create keys with "
                                  "`pdd keys generate DIR`") from None
            return None  # removed while running: nobody is let in
        if stamp != self._stamp:
            names = {}
            for f in sorted(self.path.glob("*.key")):
                try:
                    why = writable_by_others(f)
                    if why:   # anyone could put their own key in it
                        log.warning("ignoring the key file %s", why)
                        continue
                    names[zmq.auth.load_certificate(f)[0]] = f.stem
                except (OSError, ValueError):
                    log.warning("ignoring unreadable key file %s", f)
            self._names, self._stamp = names, stamp
        return self._names.get(public_z85)


# ---------------------------------------------------------------- sockets

class Curve:
    """One process's CURVE identity on one kind of socket: as a server (with
    the directory of keys it lets in) or as a client (with the server's key)."""

    def __init__(self, domain: str, public: bytes, secret: bytes, server_key: bytes | None = None,
                 allowed: KeyDir | None = None):
        self.domain = domain
        self.public, self.secret = public, secret
        self.server_key = server_key
        self.allowed = allowed

    @property
    def public_key(self) -> str:
        return self.public.decode()

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (not yet bound) a CURVE server that lets in only `allowed` keys."""
        assert self.allowed is not None, "a server needs its authorized directory"
        ZapHandler.acquire(sock.context, self.domain, self.allowed)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())
        # No handler answering ZAP must mean nobody gets in, not everybody.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def dial(self, sock: zmq.Socket, server_key: str | bytes | None = None) -> None:
        """Make `sock` (not yet connected) a CURVE client of the server with `server_key`."""
        key = server_key if server_key is not None else self.server_key
        if isinstance(key, str):
            key = key.encode()
        if not key or len(key) != 40:
            raise ValueError(f"no valid CURVE key for the {self.domain} server (got {key!r:.50})")
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, key)

    def release(self, sock: zmq.Socket) -> None:
        """Before closing a socket made by serve()."""
        ZapHandler.release(sock.context)


# ---------------------------------------------------------------- from the config

def _keys_dir(cfg: ClusterConfig) -> Path | None:
    """None when insecure; ConfigError when keys are neither given nor waived."""
    sec = cfg.security
    if sec.insecure:
        return None
    if not sec.keys_dir:
        raise ConfigError("security: no keys configured. Create them with `pdd keys generate DIR` and set "
                          "security.keys_dir = DIR (or PDD_SECURITY__KEYS_DIR); or set security.insecure = true "
                          "to run with no authentication (only where nobody else can reach the sockets)")
    d = Path(sec.keys_dir).expanduser()
    # Whoever may write there could swap the router's public key or the authorized directories.
    why = d.is_dir() and writable_by_others(d)
    if why:
        raise ConfigError(f"security.keys_dir: {why}; whoever can write there can swap the cluster's keys")
    return d


def control_security(cfg: ClusterConfig, role: str, router_index: int | None = None) -> Curve | None:
    """The control bus: a router serves it to authorized workers; a worker
    dials router `router_index` with that router's public key, so it talks to
    the cluster's routers only. None when insecure."""
    d = _keys_dir(cfg)
    if d is None:
        return None
    if role == ROUTER:
        return Curve("control", *_load_pair(d, router_key_name(d, cfg.router.index)),
                     allowed=KeyDir(d / AUTHORIZED_WORKERS))
    server = router_key_name(d, router_index or 0)
    return Curve("control", *_load_pair(d, WORKER), server_key=_load_key(d / f"{server}.key")[0])


def data_security(cfg: ClusterConfig) -> Curve | None:
    """A worker's KV data socket: served to, and dialed by, authorized workers.
    A sender dials each decode worker with the key that worker registered."""
    d = _keys_dir(cfg)
    if d is None:
        return None
    return Curve("data", *_load_pair(d, WORKER), allowed=KeyDir(d / AUTHORIZED_WORKERS))


def worker_public_key(cfg: ClusterConfig) -> str:
    """What a worker registers as its data socket's key ("" when insecure)."""
    sec = data_security(cfg)
    return sec.public_key if sec else ""


def admin_security(cfg: ClusterConfig) -> Curve | None:
    """The admin socket, router side: served to authorized admin keys."""
    d = _keys_dir(cfg)
    if d is None:
        return None
    return Curve("admin", *_load_pair(d, router_key_name(d, cfg.router.index)), allowed=KeyDir(d / AUTHORIZED_ADMINS))


def admin_client_security(keys_dir: str | Path, router_index: int = 0) -> Curve:
    """`pdd admin`: the operator's pair and router `router_index`'s public key."""
    d = Path(keys_dir).expanduser()
    return Curve("admin", *_load_pair(d, ADMIN),
                 server_key=_load_key(d / f"{router_key_name(d, router_index)}.key")[0])


def admin_token_problem(token: str) -> str | None:
    """Why `token` cannot guard the admin socket, or None."""
    if not token:
        return "router.admin_token is empty"
    if token.lower() in PLACEHOLDER_TOKENS:
        return f"router.admin_token is the placeholder {token!r}"
    if len(token) < MIN_TOKEN_CHARS:
        return f"router.admin_token has {len(token)} characters; use at least {MIN_TOKEN_CHARS}"
    return None


def check_start(cfg: ClusterConfig, role: str) -> None:
    """Everything security needs before a process starts; ConfigError says what to do."""
    if role == ROUTER:
        why = admin_token_problem(cfg.router.admin_token)
        if why:
            raise ConfigError(f"{why}. Set a random one, e.g. PDD_ROUTER__ADMIN_TOKEN=$(python3 -c "
                              "'import secrets; print(secrets.token_hex(16))') in the environment file")
        control_security(cfg, ROUTER)
        admin_security(cfg)
    else:
        control_security(cfg, role)
        data_security(cfg)
    if cfg.security.insecure:
        log.warning("SECURITY DISABLED (security.insecure = true): the %s runs its sockets in plaintext and "
                    "lets anyone who can reach them join the cluster, read prompts and write answers", role)
