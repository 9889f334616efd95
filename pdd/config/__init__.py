"""Configuration: the settings, one frozen dataclass per concern, each checking its values.

A config file has one table per dataclass ([engine], [router], ...; [router.breaker]
and its siblings are dataclasses inside RouterConfig). validate() refuses a value
pdd cannot use with a ConfigError that names the key. pdd.config_loader builds
them from conf/*.toml plus PDD_* env overrides, and writes them back as TOML.

    errors.py         ConfigError
    engine.py         [engine]
    router.py         [router] and the tables inside it: [router.breaker], [router.adaptive],
                      [router.threshold]; the router's modes and parsers
    worker.py         [worker]; the roles of a process, a worker's exit statuses
    security.py       [security]; the settings that hold secrets, the paths that may be opened
    observability.py  [log] and [tracing]
    cluster.py        ClusterConfig: every table of one file; the model's served names

Every public name is imported from here (`from pdd.config import EngineConfig`).
"""
from __future__ import annotations

from pdd.config.cluster import BUILTIN_MODEL_NAME, ClusterConfig
from pdd.config.engine import EngineConfig
from pdd.config.errors import ConfigError
from pdd.config.observability import LOG_FORMATS, LOG_LEVELS, LogConfig, TracingConfig
from pdd.config.router import (REASONING_PARSERS, ROUTER_MODES, TOOL_CALL_PARSERS, AdaptiveConfig, BreakerConfig,
                               RouterConfig, ThresholdConfig)
from pdd.config.security import HTTP_OPENABLE_PATHS, SECRET_FIELDS, SecurityConfig
from pdd.config.worker import (EXIT_REFUSED, EXIT_REPLACED, EXIT_WORKER_FAILED, MAX_WORKER_ID_BYTES, ROLES,
                               WorkerConfig)

__all__ = ["BUILTIN_MODEL_NAME", "EXIT_REFUSED", "EXIT_REPLACED", "EXIT_WORKER_FAILED", "HTTP_OPENABLE_PATHS",
           "LOG_FORMATS", "LOG_LEVELS", "MAX_WORKER_ID_BYTES", "REASONING_PARSERS", "ROLES", "ROUTER_MODES",
           "SECRET_FIELDS", "TOOL_CALL_PARSERS", "AdaptiveConfig", "BreakerConfig", "ClusterConfig", "ConfigError",
           "EngineConfig", "LogConfig", "RouterConfig", "SecurityConfig", "ThresholdConfig", "TracingConfig",
           "WorkerConfig"]
