"""Loading the configuration: pdd.config's dataclasses from conf/*.toml plus PDD_* env
overrides, and back to TOML.

A TOML file has one table per dataclass ([engine], [router], ...). Unknown keys
and wrong types are errors that name the key: a typo in a config file must not
silently fall back to a default. Env overrides use PDD_<TABLE>__<KEY>=value
(e.g. PDD_ENGINE__BLOCK_SIZE=32; a table inside one: PDD_ROUTER__BREAKER__<KEY>);
a list is comma-separated (PDD_SECURITY__API_KEYS=key1,key2); they win over the
file and over explicit overrides. An error about a value says where it was set
(the file, the variable, the command line): an operator fixing the file would
not find one that came from the environment.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from pathlib import Path
from urllib.parse import unquote

from pdd.config import (SECRET_FIELDS, ClusterConfig, ConfigError, EngineConfig, LogConfig, RouterConfig,
                        SecurityConfig, TracingConfig, WorkerConfig)

_TABLES = {"engine": EngineConfig, "router": RouterConfig, "worker": WorkerConfig,
           "security": SecurityConfig, "log": LogConfig,
           "tracing": TracingConfig}
# Older names of PDD_* variables, still read when the new one is not set.
ENV_ALIASES = {"PDD_LOG_LEVEL": "PDD_LOG__LEVEL"}


# The [tracing] keys the standard OpenTelemetry variables set (otel_env).
_OTEL_VARS = {"otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT", "service_name": "OTEL_SERVICE_NAME",
              "headers": "OTEL_EXPORTER_OTLP_HEADERS"}


def load_cluster_config(path: str | Path | None = None, env: dict | None = None,
                        overrides: dict | None = None, overrides_origin: str = "the command line") -> ClusterConfig:
    """conf/*.toml (optional) + PDD_* env + explicit overrides {table: {key: value}}, a
    table inside one as a dict ({"router": {"breaker": {...}}}); `overrides_origin`
    names where the overrides came from in errors."""
    raw = load_toml(path) if path else {}
    unknown = set(raw) - set(_TABLES)
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; known: {sorted(_TABLES)}")
    env = with_aliases(os.environ if env is None else env)
    _check_env_tables(env)
    unknown = set(overrides or {}) - set(_TABLES)
    if unknown:
        raise ConfigError(f"{overrides_origin}: unknown table(s) {sorted(unknown)}; known: {sorted(_TABLES)}")
    parts = {}
    for name, cls in _TABLES.items():
        table: dict = {}
        origins: dict = {}
        if cls is TracingConfig:
            otel = otel_env(env)
            _layer(table, origins, otel, _OTEL_VARS)
        _layer(table, origins, raw.get(name) or {}, str(path))
        _layer(table, origins, (overrides or {}).get(name) or {}, overrides_origin)
        parts[name] = build(cls, table, name, env, origins)
    return ClusterConfig(**parts)


def _check_env_tables(env: dict) -> None:
    """A PDD_<TABLE>__<KEY> variable must name a table: a typo there would
    otherwise be ignored without a word."""
    for var in env:
        if var.startswith("PDD_") and "__" in var:
            table = var[len("PDD_"):].split("__")[0].lower()
            if table not in _TABLES:
                raise ConfigError(f"{var}: no config table {table!r}; known: {sorted(_TABLES)} "
                                  f"(PDD_<TABLE>__<KEY>=value)")


def _env_table(section: str, env: dict, cls) -> tuple[dict, dict]:
    """The PDD_<SECTION>__<KEY> overrides of dataclass `cls`'s table, its nested
    tables' (PDD_ROUTER__BREAKER__<KEY>) included: ({key: value}, {key: the variable})."""
    prefix = f"PDD_{section.upper().replace('.', '__')}__"
    hints = typing.get_type_hints(cls)
    nested = {name: hint for name, hint in hints.items() if dataclasses.is_dataclass(hint)}
    table: dict = {}
    origins: dict = {}
    for var, value in env.items():
        if not var.startswith(prefix):
            continue
        key = var[len(prefix):].lower()
        if key in nested:
            raise ConfigError(f"{var}: {section}.{key} is a table: set its keys, {var}__<KEY>=value")
        if key.split("__")[0] in nested:
            continue   # the nested table's own, below
        table[key] = value
        origins[key] = var
    for name, hint in nested.items():
        sub, sub_origins = _env_table(f"{section}.{name}", env, hint)
        if sub:
            table[name], origins[name] = sub, sub_origins
    return table, origins


def _layer(table: dict, origins: dict, extra: dict, where: str | dict) -> None:
    """Sets `extra`'s keys in `table`, inside nested tables too (a key set at one
    level keeps its siblings set at another), and in `origins` where each came
    from: `where`, or `where[key]` when it is a dict mirroring `extra`."""
    for key, value in extra.items():
        here = where.get(key, "") if isinstance(where, dict) else where
        if isinstance(value, dict):
            if not isinstance(table.get(key), dict):
                table[key] = {}
            if not isinstance(origins.get(key), dict):
                origins[key] = {}
            _layer(table[key], origins[key], value, here)
        else:
            table[key] = value
            origins[key] = here


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


def toml_value(v) -> str:
    """One value as TOML writes it (a bool, number, string, or a list of them)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def dump_toml(cfg: ClusterConfig) -> str:
    """The config as TOML (the inverse of load_cluster_config; None values omitted)."""
    def table(name: str, obj) -> list[str]:
        lines, subtables = [f"[{name}]"], []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                subtables += table(f"{name}.{f.name}", v)
            elif v is not None:
                lines.append(f"{f.name} = {toml_value(v)}")
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
    # A secret's value goes to stderr and the journal: its type says enough.
    shown = type(value).__name__ if tuple(key.split(".", 1)) in SECRET_FIELDS else repr(value)
    raise ConfigError(f"{key}: expected {name}, got {shown}")


def build(cls, table: dict | None, section: str, env: dict | None = None, origins: dict | None = None):
    """Instantiate config dataclass `cls` from a TOML table plus env overrides.
    `origins` mirrors `table`: where each value was set, named in an error about it."""
    table = dict(table or {})
    origins = dict(origins or {})
    env = os.environ if env is None else env
    env_table, env_origins = _env_table(section, env, cls)
    _layer(table, origins, env_table, env_origins)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - names
    if unknown:
        raise ConfigError(_at(origins, sorted(unknown),
                              f"[{section}]: unknown key(s) {sorted(unknown)}; known: {sorted(names)}"))
    nested = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
    for key in nested:   # [router.breaker] and its PDD_ROUTER__BREAKER__* overrides
        sub = table.get(key, {})
        if not isinstance(sub, dict):
            raise ConfigError(_at(origins, [key], f"{section}.{key}: expected a table, got {sub!r}"))
        sub_origins = origins.get(key)
        table[key] = build(hints[key], sub, f"{section}.{key}", {},
                           sub_origins if isinstance(sub_origins, dict) else {})
    kwargs = {}
    for k, v in table.items():
        if k in nested:
            kwargs[k] = v
            continue
        try:
            kwargs[k] = _coerce(v, hints[k], f"{section}.{k}")
        except ConfigError as e:
            raise ConfigError(_at(origins, [k], str(e))) from None
    obj = cls(**kwargs)
    if not hasattr(obj, "validate"):
        return obj
    try:
        return obj.validate()
    except ConfigError as e:
        raise ConfigError(_at(origins, _keys_named(str(e), section, names - nested), str(e))) from None


def _keys_named(message: str, section: str, names: set[str]) -> list[str]:
    """The keys of [section] a validation error is about: the one it starts with
    ("engine.block_size: ..."), else those it mentions."""
    head = message.partition(":")[0]
    if head.startswith(section + "."):
        key = head[len(section) + 1:].partition("[")[0]
        if key in names:
            return [key]
    return [n for n in sorted(names) if re.search(rf"\b{n}\b", message)]


def _at(origins: dict, keys: list[str], message: str) -> str:
    """`message` prefixed with where `keys` were set (files, variables, the
    command line), when any of them was set somewhere."""
    where = list(dict.fromkeys(o for k in keys for o in _leaves(origins.get(k)) if o))
    return f"{', '.join(where)}: {message}" if where else message


def _leaves(origin) -> list[str]:
    """The origins of a value, or of every value of a table."""
    if isinstance(origin, dict):
        return [o for sub in origin.values() for o in _leaves(sub)]
    return [origin] if isinstance(origin, str) else []


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
