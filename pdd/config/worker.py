"""[worker]: a worker's settings (its role, id, KV data plane), the roles of a
process and the exit statuses of a worker."""
from __future__ import annotations

from dataclasses import dataclass

from pdd.config.errors import ConfigError

ROLES = ("router", "colocated", "prefill", "decode")
MAX_WORKER_ID_BYTES = 200

# Exit status of a worker the router refused (KV layout mismatch): EX_CONFIG.
# Supervisors (systemd's RestartPreventExitStatus, `pdd up`) do not restart it.
EXIT_REFUSED = 78
# Exit status of a worker told that another process registered under its worker
# id since: not restarted either (it would replace the new one in turn), but
# unlike a refusal it says nothing is wrong with the cluster, which `pdd up`
# keeps serving.
EXIT_REPLACED = 79
# Exit status of a worker that cannot go on (its engine failed: a device error,
# steps failing in a row; or its control loop did): EX_SOFTWARE. Supervisors
# restart it.
EXIT_WORKER_FAILED = 70


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "colocated"
    # Default: "<role>-<host>-<pid>".
    worker_id: str | None = None
    # The one router to connect to (default: every router of router.routers).
    router_addr: str | None = None
    # KV data plane. Decode/colocated workers bind data_addr (port 0 = any free
    # port; the bound address is advertised at registration).
    data_addr: str = "tcp://127.0.0.1:0"
    # auto: cuda_ipc to decode workers on this host when on a GPU, nixl to
    # those on other hosts when both have the extra pdd[nixl], else tcp (the
    # router picks per pair: `pdd admin workers` says which and why). nixl:
    # only nixl (UCX reads its settings from the environment: UCX_TLS, ...).
    transfer_backend: str = "auto"       # auto | tcp | cuda_ipc | nixl
    # A transfer whose data plane owes it an acknowledgement and has made no
    # progress this long fails (PrefillFailed: the decode worker prefills it).
    transfer_timeout_s: float = 30.0
    # cuda_ipc: 0 = copy a step's pages once, after its forward; N = every N
    # layers while the forward runs (see pdd.transfer.cuda_ipc for which pays when).
    ipc_layers_per_copy: int = 0
    # nixl, decode side: a landing region of this many bytes beside the KV pool
    # (registered once): a request's pages are written there contiguously, two
    # NIXL descriptors per layer however scattered its blocks are in the pool,
    # then copied into its blocks on this device. None: room for one request
    # of max_model_len tokens, at most 2 GiB, except with transfer_backend
    # "auto" and data_addr on loopback: none there (no other host reaches it,
    # and on one host auto takes cuda_ipc or tcp). 0: none (pages go straight
    # into the blocks: a descriptor per k|v per run of neighbouring blocks).
    # A value set wins. A pool sized from free GPU memory leaves it room; the
    # worker's start log says the region's size and why.
    nixl_landing_bytes: int | None = None
    # An engine step running longer than this is a hung worker: the router moves
    # its requests and sends it nothing new until its steps advance again.
    step_timeout_s: float = 60.0
    # A colocated worker that also prefills prompts for other workers and ships
    # their KV (adaptive placement moves it between prefill and decode work).
    prefill_for_others: bool = False
    # SIGTERM (or the router's drain): take nothing new and finish the running
    # requests for up to this long; then stop as a second signal does, and
    # the router moves what still runs to other workers.
    drain_timeout_s: float = 60.0

    def validate(self) -> "WorkerConfig":
        if self.role not in ROLES[1:]:
            raise ConfigError(f"worker.role: must be one of {ROLES[1:]}, got {self.role!r}")
        if self.worker_id is not None and not 0 < len(self.worker_id.encode()) <= MAX_WORKER_ID_BYTES:
            # With its incarnation it names the control connection: ZeroMQ takes 255 bytes.
            raise ConfigError(f"worker.worker_id: must be 1 to {MAX_WORKER_ID_BYTES} bytes, "
                              f"got {len(self.worker_id.encode())}")
        if self.transfer_backend == "local":
            raise ConfigError("worker.transfer_backend: 'local' joins two engines of one process (tests); "
                              "a worker is a process of its own: use auto, tcp, cuda_ipc or nixl")
        if self.transfer_backend not in ("auto", "tcp", "cuda_ipc", "nixl"):
            raise ConfigError(f"worker.transfer_backend: must be auto, tcp, cuda_ipc or nixl, "
                              f"got {self.transfer_backend!r}")
        if self.transfer_timeout_s <= 0:
            raise ConfigError("worker.transfer_timeout_s: must be > 0")
        if self.step_timeout_s <= 0:
            raise ConfigError("worker.step_timeout_s: must be > 0")
        if not 0 < self.drain_timeout_s < float("inf"):
            raise ConfigError(f"worker.drain_timeout_s: must be > 0 (seconds), got {self.drain_timeout_s}")
        if self.nixl_landing_bytes is not None and (
                not isinstance(self.nixl_landing_bytes, int) or isinstance(self.nixl_landing_bytes, bool)
                or self.nixl_landing_bytes < 0):
            raise ConfigError(f"worker.nixl_landing_bytes: must be an integer >= 0 (bytes; 0 = no landing "
                              f"region), got {self.nixl_landing_bytes!r}")
        if self.ipc_layers_per_copy < 0:
            raise ConfigError("worker.ipc_layers_per_copy: must be >= 0 (0 = once per step, after its forward)")
        if self.prefill_for_others and self.role != "colocated":
            raise ConfigError(f"worker.prefill_for_others: only a colocated worker takes it (role {self.role!r})")
        return self
