"""ClusterConfig: every table of one config file, and the model's names it implies."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pdd.config.engine import EngineConfig
from pdd.config.observability import LogConfig, TracingConfig
from pdd.config.router import RouterConfig
from pdd.config.security import SecurityConfig
from pdd.config.worker import WorkerConfig

# The built-in tiny model's short name (besides its directory).
BUILTIN_MODEL_NAME = "pdd-tiny"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything one config file holds; each process reads the tables it needs."""
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = RouterConfig()
    worker: WorkerConfig = WorkerConfig()
    security: SecurityConfig = SecurityConfig()
    log: LogConfig = LogConfig()
    tracing: TracingConfig = TracingConfig()

    def served_model_names(self, model_dir) -> tuple[str, ...]:
        """What clients may put in "model", the reported one first: router.served_model_name,
        else the model as given (the built-in one: its directory, then "pdd-tiny")."""
        if self.router.served_model_name:
            return self.router.served_model_name
        if self.engine.model is None:
            return (str(model_dir), BUILTIN_MODEL_NAME)
        return (self.engine.model,)

    def model_root(self, model_dir) -> str:
        """The checkpoint the names serve, as /v1/models' `root` says it (a tokenizer reference)."""
        return self.engine.model if self.engine.model is not None else str(model_dir)

    def layout_model_id(self, model_dir) -> str:
        """The model's name in the KV layout descriptor: the first configured served
        name, else the checkpoint directory's name. Not the path: workers on hosts
        that keep one checkpoint under different paths still pair."""
        if self.router.served_model_name:
            return self.router.served_model_name[0]
        if self.engine.model is None:
            return BUILTIN_MODEL_NAME
        return os.path.basename(os.path.normpath(str(model_dir)))
