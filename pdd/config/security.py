"""[security]: CURVE keys, the HTTP API's keys, limits and origins; which settings hold secrets."""
from __future__ import annotations

from dataclasses import dataclass

from pdd.config.errors import ConfigError

# (table, key) of the settings that hold secrets: masked by `pdd admin config`,
# never quoted in an error about their value.
SECRET_FIELDS = (("router", "admin_token"), ("security", "api_keys"), ("tracing", "headers"))

# Paths the HTTP API may serve without a key (security.open_paths).
HTTP_OPENABLE_PATHS = ("/health", "/ready", "/metrics", "/v1/models")


@dataclass(frozen=True)
class SecurityConfig:
    # CURVE key files of the control bus, data sockets and admin socket
    # (`pdd keys generate DIR`; which files each host needs: README.md).
    keys_dir: str = ""
    # Plaintext sockets, no authentication: anyone who reaches a socket joins
    # the cluster. Only for a host nobody else can reach; warned at start.
    insecure: bool = False
    # HTTP `Authorization: Bearer KEY`; empty = the HTTP API is open (warned at start).
    api_keys: tuple[str, ...] = ()
    open_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")   # served without a key
    http_header_timeout_s: float = 10.0   # first byte of a request -> end of its headers
    http_body_timeout_s: float = 60.0     # reading a request body
    http_idle_timeout_s: float = 75.0     # a connection with no request in progress
    http_max_connections: int = 1024
    # Browser origins (scheme://host[:port]) whose pages may call the HTTP API
    # (CORS); "*" for any. Empty: none, as a server for programs, not pages.
    cors_origins: tuple[str, ...] = ()

    def validate(self) -> "SecurityConfig":
        for key in ("http_header_timeout_s", "http_body_timeout_s", "http_idle_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"security.{key}: must be > 0")
        if self.http_max_connections < 1:
            raise ConfigError("security.http_max_connections: must be >= 1")
        for path in self.open_paths:
            if path not in HTTP_OPENABLE_PATHS:
                raise ConfigError(f"security.open_paths: {path!r} cannot be opened; choose from {HTTP_OPENABLE_PATHS}")
        for origin in self.cors_origins:
            if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.endswith("/")):
                raise ConfigError(f"security.cors_origins: {origin!r} is not an origin; want '*' or "
                                  "scheme://host[:port], e.g. 'https://chat.example.com'")
        for i, key in enumerate(self.api_keys):
            if not key or not key.isascii() or not key.isprintable() or " " in key:
                raise ConfigError(f"security.api_keys[{i}]: must be non-empty printable ASCII without spaces")
        return self
