"""Loading the configuration: pdd.config's dataclasses from conf/*.toml plus PDD_* env
overrides, and back to TOML.

A TOML file has one table per dataclass ([engine], [router], ...). Unknown keys
and wrong types are errors that name the key: a typo in a config file must not
silently fall back to a default. Env overrides use PDD_<TABLE>__<KEY>=value
(e.g. PDD_ENGINE__BLOCK_SIZE=32; a table inside one: PDD_ROUTER__BREAKER__<KEY>);
a list is comma-separated (PDD_SECURITY__API_KEYS=key1,key2).
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from urllib.parse import unquote

from pdd.config import (ClusterConfig, ConfigError, EngineConfig, LogConfig, RouterConfig, SecurityConfig,
                        TracingConfig, WorkerConfig)

_TABLES = {"engine": EngineConfig, "router": RouterConfig, "worker": WorkerConfig,
           "security": SecurityConfig, "log": LogConfig,
           "tracing": TracingConfig}
# Older names of PDD_* variables, still read when the new one is not set.
ENV_ALIASES = {"PDD_LOG_LEVEL": "PDD_LOG__LEVEL"}


def load_cluster_config(path: str | Path | None = None, env: dict | None = None,
                        overrides: dict | None = None) -> ClusterConfig:
    """conf/*.toml (optional) + PDD_* env + explicit overrides {table: {key: value}}."""
    raw = load_toml(path) if path else {}
    unknown = set(raw) - set(_TABLES)
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; known: {sorted(_TABLES)}")
    env = with_aliases(os.environ if env is None else env)
    parts = {}
    for name, cls in _TABLES.items():
        table = dict(raw.get(name) or {})
        table.update((overrides or {}).get(name) or {})
        if cls is TracingConfig:
            table = {**otel_env(env), **table}
        parts[name] = build(cls, table, name, env)
    return ClusterConfig(**parts)


def otel_env(env: dict) -> dict:
    """[tracing] keys from the standard OpenTelemetry variables, where set (the
    headers' values are URL-encoded there, as the OTel spec has them)."""
    out = {}
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        out["otlp_endpoint"] = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip()
    if env.get("OTEL_SERVICE_NAME"):
        out["service_name"] = env["OTEL_SERVICE_NAME"].strip()
    if env.get("OTEL_EXPORTER_OTLP_HEADERS"):
        headers = []
        for item in env["OTEL_EXPORTER_OTLP_HEADERS"].split(","):
            name, eq, value = item.partition("=")
            if item.strip():   # one without "=" stays as it is: validation names it
                headers.append(f"{name.strip()}={unquote(value.strip())}" if eq else item.strip())
        out["headers"] = headers
    return out


def with_aliases(env: dict) -> dict:
    """`env` with each alias of ENV_ALIASES read as its new name (which wins when both are set)."""
    extra = {new: env[old] for old, new in ENV_ALIASES.items() if old in env and new not in env}
    return {**env, **extra} if extra else env


def dump_toml(cfg: ClusterConfig) -> str:
    """The config as TOML (the inverse of load_cluster_config; None values omitted)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def table(name: str, obj) -> list[str]:
        lines, subtables = [f"[{name}]"], []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                subtables += table(f"{name}.{f.name}", v)
            elif v is not None:
                lines.append(f"{f.name} = {value(v)}")
        return lines + [""] + subtables

    return "\n".join(line for name in _TABLES for line in table(name, getattr(cfg, name)))


def _coerce(value, hint, key: str):
    """Check/convert one TOML or env value against a dataclass field type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif hint in (int, float):
        # A float key takes an integer (TOML's `timeout = 30`); an int key takes no float.
        numbers = (int, float) if hint is float else int
        if isinstance(value, numbers) and not isinstance(value, bool):
            return hint(value)
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, str):   # an env override: comma-separated, spaces around an item ignored
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return origin(_coerce(v, args[0], key) for v in value)
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key}: expected {name}, got {value!r}")


def build(cls, table: dict | None, section: str, env: dict | None = None):
    """Instantiate config dataclass `cls` from a TOML table plus env overrides."""
    table = dict(table or {})
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - names
    if unknown:
        raise ConfigError(f"[{section}]: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    nested = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
    prefix = f"PDD_{section.upper().replace('.', '__')}__"
    for var, value in env.items():
        if var.startswith(prefix):
            key = var[len(prefix):].lower()
            if key.split("__")[0] in nested:
                continue   # PDD_ROUTER__BREAKER__X: the nested table's own override
            if key not in names:
                raise ConfigError(f"{var}: {section} has no key {key!r}")
            table[key] = value
    for key in nested:   # [router.breaker] and its PDD_ROUTER__BREAKER__* overrides
        sub = table.get(key, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{section}.{key}: expected a table, got {sub!r}")
        table[key] = build(hints[key], sub, f"{section}.{key}", env)
    kwargs = {k: v if k in nested else _coerce(v, hints[k], f"{section}.{k}") for k, v in table.items()}
    obj = cls(**kwargs)
    return obj.validate() if hasattr(obj, "validate") else obj


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
