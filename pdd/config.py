"""Configuration: the settings, one frozen dataclass per concern, each checking its values.

A config file has one table per dataclass ([engine], [router], ...; [router.breaker]
and its siblings are dataclasses inside RouterConfig). validate() refuses a value
pdd cannot use with a ConfigError that names the key. pdd.config_loader builds
them from conf/*.toml plus PDD_* env overrides, and writes them back as TOML.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pdd.kv.scales import KV_CACHE_DTYPES


class ConfigError(ValueError):
    """A configuration value pdd cannot use; the message names the key."""


@dataclass(frozen=True)
class EngineConfig:
    # Model directory (HF format); None = the built-in tiny model.
    model: str | None = None
    load_format: str = "auto"            # auto | safetensors | dummy
    dtype: str = "auto"                  # auto | float32 | float16 | bfloat16
    # KV cache elements: auto (the model's dtype) | fp8_e4m3 (half the bytes of
    # bf16: twice the tokens, half the transfer; static per-layer scales, see pdd.kv.scales)
    kv_cache_dtype: str = "auto"
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    block_size: int = 16
    # KV pool size: num_blocks wins, then kv_cache_bytes, then (GPU)
    # gpu_memory_utilization of the device, else (CPU) 512 MiB.
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    # The host-memory KV tier behind the pool (pdd.kv.tier): blocks leaving the
    # pool's prefix cache stay findable there, loaded back instead of computed
    # again. Bytes of (pinned, on a GPU) host memory; 0: no tier. Off unless
    # set: the host's RAM is shared by all its workers, which none can size alone.
    host_kv_cache_bytes: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Tokens one step computes at most; None: 8192 on a GPU (an H200 runs a
    # 2048-token prefill step well below its peak; vLLM's serving default is
    # 8192 too), 2048 on the CPU.
    max_num_batched_tokens: int | None = None
    chunk_size: int = 512                # longest prefill chunk of one request per step
    # Chunking bounds the gap a prompt gives the requests decoding beside it. In
    # a step where nothing decodes there is no gap to bound: a prompt may then
    # take the whole max_num_batched_tokens (on a GPU a lone 16k prompt in 2
    # steps of 8192, not 32 of 512: a prefill worker's usual case). Off:
    # chunk_size always.
    chunk_only_beside_decodes: bool = True
    # Prompt tokens of all requests together in a step where requests decode
    # (None: up to max_num_batched_tokens). With a large budget, a busy
    # colocated worker's step can carry many prompt chunks beside its decodes;
    # this bounds that step (Sarathi-Serve's token budget) and leaves steps
    # without decodes the whole budget.
    prefill_tokens_beside_decodes: int | None = None
    # A prompt is long while more than this many of its tokens are still to
    # compute (0 or unset: no prompt is, and prompts are served first come,
    # first served). Short prompts take a step's prompt tokens before a long
    # one does, even those queued behind it: one 16k prompt would otherwise
    # take whole steps while the short prompts behind it wait (their TTFT, and
    # on the router's side their spill to local prefill on decode workers).
    long_prefill_token_threshold: int | None = 4096
    # Long prompts in partial prefill at once; another long one waits (the
    # short prompts behind it go on). Beside decodes each takes at most a chunk
    # a step: one at a time there made the long prompts' TTFT 1.9x FCFS's on
    # the CPU bench (docs/benchmarks.md), four 1.1x.
    max_long_partial_prefills: int = 4
    # The least share of a step's prompt tokens the long prompts in partial
    # prefill get together (each its 1 / max_long_partial_prefills part), short
    # prompts waiting or not: their TTFT grows, but boundedly.
    long_prefill_min_share: float = 0.25
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    # Torch threads of an engine on the CPU; 0: torch's default (one per core).
    # Workers sharing a host's cores each spinning a thread per core run slower
    # together (1P+1D on 2 cores: bursts up to twice as long as with one thread
    # each), so `pdd up` gives each of its N CPU workers cores // (N + 1),
    # leaving the router a share.
    cpu_threads: int = 0
    # Schedule and launch step N+1 before waiting for step N's tokens, so the
    # host's per-step work overlaps the GPU's (off: every step waits for itself).
    async_scheduling: bool = True
    # Run a few synthetic steps at worker start (CUDA only): the prefill and
    # mixed steps run eagerly and compile their Triton kernels at first use,
    # which otherwise costs the first real requests seconds of TTFT.
    warm_up: bool = True
    # Constrained decoding (pdd.grammar): grammars compile on this many threads
    # beside the engine's step; a request waits for its own compile (its first
    # mask included) while the others step on.
    grammar_compile_threads: int = 2
    # A request whose grammar compiles longer fails (an error naming
    # structured_output); the compile ends anyway, bounded by the parser's fuel.
    grammar_compile_timeout_s: float = 10.0
    # Compiled grammars kept for reuse, by their memory (a heavy regex's reached
    # 170 MB), least recently used out first.
    grammar_cache_bytes: int = 256 * 2**20
    seed: int = 0

    def validate(self) -> "EngineConfig":
        def bad(key, why):
            raise ConfigError(f"engine.{key}: {why}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be >= 1")
        if self.chunk_size < 1:
            bad("chunk_size", "must be >= 1")
        if self.prefill_tokens_beside_decodes is not None and self.prefill_tokens_beside_decodes < 1:
            bad("prefill_tokens_beside_decodes", "must be >= 1 (unset: the step budget)")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            bad("long_prefill_token_threshold", "must be >= 0 (0 or unset: every prompt in arrival order)")
        if self.max_long_partial_prefills < 1:
            bad("max_long_partial_prefills", "must be >= 1")
        if not 0.0 < self.long_prefill_min_share <= 1.0:
            bad("long_prefill_min_share", f"must be in (0, 1], got {self.long_prefill_min_share}")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be >= 1")
        if self.cpu_threads < 0:
            bad("cpu_threads", "must be >= 0 (0: torch's default)")
        if self.grammar_compile_threads < 1:
            bad("grammar_compile_threads", f"must be >= 1, got {self.grammar_compile_threads}")
        if not 0.0 < self.grammar_compile_timeout_s < float("inf"):
            bad("grammar_compile_timeout_s", f"must be a number of seconds > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_cache_bytes < 0:
            bad("grammar_cache_bytes", f"must be >= 0 (0: keep none), got {self.grammar_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            bad("num_blocks", "must be >= 2")
        if isinstance(self.host_kv_cache_bytes, bool) or not isinstance(self.host_kv_cache_bytes, int) \
                or self.host_kv_cache_bytes < 0:
            bad("host_kv_cache_bytes", f"must be a number of bytes >= 0 (0: no host tier), "
                                       f"got {self.host_kv_cache_bytes!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            bad("load_format", f"must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            bad("dtype", f"must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        return self


ROLES = ("router", "colocated", "prefill", "decode")
MAX_WORKER_ID_BYTES = 200
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")   # pdd.http.tools
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")   # pdd.http.reasoning
ROUTER_MODES = ("auto", "colocated", "disagg", "adaptive", "threshold")

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
class BreakerConfig:
    """[router.breaker]: the circuit breakers on the disaggregated path (pdd.router.breaker)."""
    consecutive_failures: int = 5        # failures in a row that open a pair's breaker
    window_s: float = 30.0               # ... or a failure rate over this sliding window
    window_min_transfers: int = 10       # ... counted once it holds this many transfers
    failure_rate: float = 0.5
    cooldown_s: float = 10.0             # open -> half-open; doubled after a failed trial ...
    max_cooldown_s: float = 160.0        # ... up to this
    successes_to_close: int = 2          # half-open trials that must succeed

    def validate(self) -> "BreakerConfig":
        if self.consecutive_failures < 1 or self.window_min_transfers < 1 or self.successes_to_close < 1:
            raise ConfigError("router.breaker: consecutive_failures, window_min_transfers and "
                              "successes_to_close must be >= 1")
        if not 0.0 < self.failure_rate <= 1.0:
            raise ConfigError(f"router.breaker.failure_rate: must be in (0, 1], got {self.failure_rate}")
        if self.window_s <= 0 or self.cooldown_s <= 0 or self.max_cooldown_s < self.cooldown_s:
            raise ConfigError("router.breaker: window_s and cooldown_s must be > 0, max_cooldown_s >= cooldown_s")
        return self


@dataclass(frozen=True)
class AdaptiveConfig:
    """[router.adaptive]: SLO targets and thresholds of adaptive placement
    (router.mode = "adaptive"; the model: docs/design.md, "Adaptive disaggregation")."""
    ttft_slo_s: float = 2.0              # time to first token a placement must predict to meet
    tpot_slo_s: float = 0.05             # a decoding request's predicted time per output token
    # A step holding a prefill chunk beside running decodes must not predict an
    # inter-token gap above this for them (as the TPOT target by default: a
    # decode-leaning worker takes a local prefill only while its steps stay
    # within what its requests are promised). A long prompt prefilled there is
    # cut into chunks small enough to keep its deepest step within it.
    itl_slo_s: float = 0.05
    # A prefill worker's queue is used while the wait in it is predicted within
    # this share of ttft_slo_s; past it a long prompt prefills where it decodes
    # if that meets the targets. The rest of the target is the margin for the tail
    # (on 2xH200, queues filled up to the whole 2 s gave TTFT p99 2.5 s at 16 req/s).
    ttft_headroom: float = 0.5
    # Prompts with at most this many uncached tokens prefill where they decode
    # without pricing the alternatives when that worker decodes nothing (a
    # transfer would only add its latency) or caches most of the prompt; beside
    # running decodes a short prompt is priced like any other.
    local_prefill_tokens: int = 256

    def validate(self) -> "AdaptiveConfig":
        if min(self.ttft_slo_s, self.tpot_slo_s, self.itl_slo_s) <= 0:
            raise ConfigError("router.adaptive: ttft_slo_s, tpot_slo_s and itl_slo_s must be > 0")
        if self.local_prefill_tokens < 0:
            raise ConfigError("router.adaptive.local_prefill_tokens: must be >= 0")
        if not 0.0 < self.ttft_headroom <= 1.0:
            raise ConfigError("router.adaptive.ttft_headroom: must be in (0, 1]")
        return self


@dataclass(frozen=True)
class ThresholdConfig:
    """[router.threshold]: the rule the peers' disaggregated routers use (Dynamo's
    conditional disaggregation: uncached prompt tokens and the prefill queue),
    router.mode = "threshold": a prompt prefills where it decodes when few of its
    tokens are uncached there or every prefill worker's queue is full; else on
    the least loaded prefill worker with room in its queue."""
    # At most this many prompt tokens the decode worker does not cache: prefilled
    # there. One engine chunk (chunk_size 512) delays the decodes beside it by one
    # step (+12 ms on an 80-decode H200 step, docs/benchmarks.md).
    max_local_prefill_tokens: int = 512
    # A prefill worker with this many prompt tokens queued takes no more: about
    # 1 s of one H200's prefill (~34k tokens/s measured), the half of a 2 s TTFT
    # target that adaptive placement plans for too (ttft_headroom).
    max_prefill_queue_tokens: int = 32_768

    def validate(self) -> "ThresholdConfig":
        if self.max_local_prefill_tokens < 0:
            raise ConfigError(f"router.threshold.max_local_prefill_tokens: must be >= 0, "
                              f"got {self.max_local_prefill_tokens}")
        if self.max_prefill_queue_tokens < 1:
            raise ConfigError(f"router.threshold.max_prefill_queue_tokens: must be >= 1, "
                              f"got {self.max_prefill_queue_tokens}")
        return self


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Control bus: the router binds, workers connect.
    control_addr: str = "tcp://127.0.0.1:7100"
    # Admin socket: localhost by default; every command must carry admin_token.
    admin_addr: str = "tcp://127.0.0.1:7101"
    admin_token: str = ""
    # A cluster of several routers (active-active; `pdd up --routers N`, or a
    # pdd-router@I unit per router): every router's control and admin address,
    # in one order on every host. Workers register with each of them and `pdd
    # admin` speaks to each; this router is number `index` of the lists (then
    # control_addr and admin_addr are not read). Empty: the one router at
    # control_addr and admin_addr.
    control_addrs: tuple[str, ...] = ()
    admin_addrs: tuple[str, ...] = ()
    index: int = 0
    # With several routers on one `port` (SO_REUSEPORT: the kernel picks a
    # router per connection), router I also listens on http_ports[I], alone:
    # what is one router's (its /metrics for Prometheus, a balancer's health
    # check of it) has an address. Empty: no port of its own.
    http_ports: tuple[int, ...] = ()
    # Names clients put in "model" (aliases; the first is the one /v1/models
    # reports first). Empty: the model as given (engine.model verbatim, as vLLM
    # serves under its --model argument), so a benchmark client can load the
    # tokenizer from the name it reads; the built-in model: its directory and "pdd-tiny".
    served_model_name: tuple[str, ...] = ()
    heartbeat_interval_s: float = 0.5
    # A worker silent for heartbeat_misses heartbeats (the router's own stalls
    # not counted) is suspect: it gets no new requests and keeps those it holds.
    # Silent liveness_grace_s longer, it is lost and they move; heard within
    # it, it is healthy again with nothing moved. Long enough for a starved host
    # or a call that holds a worker's interpreter (seconds); a process that is
    # gone (its connection closed) is lost when it turns suspect, without the grace.
    heartbeat_misses: int = 3
    liveness_grace_s: float = 5.0
    # A worker gone this long without registering again is forgotten: its
    # breakers, estimates and metric series are dropped. Long enough for a
    # restart under its id (systemd's RestartSec, then loading and warming up
    # a large checkpoint) to find them again; short enough that the dead ids of
    # a long life (a default id, role-host-pid, is new at every restart) go.
    forget_after_s: float = 300.0
    max_body_bytes: int = 4 * 2**20
    default_max_tokens: int = 16     # /v1/completions without max_tokens, as OpenAI
    # auto: disaggregated when prefill and decode workers are registered, else colocated.
    # adaptive: per request, remote or local prefill from a cost model measured
    # online; colocated workers that prefill for others lean to prefill or decode
    # as the load moves (pdd.router.placement, [router.adaptive]).
    # threshold: remote prefill for prompts with many uncached tokens while a
    # prefill worker's queue has room, else local ([router.threshold]).
    mode: str = "auto"               # auto | colocated | disagg | adaptive | threshold
    kv_lease_ttl_s: float = 60.0     # a decode reservation whose KV has not come by then is freed
    reserve_timeout_s: float = 10.0  # decode worker's answer to Reserve
    # A request not finished this long after arrival ends with an error (0 = no deadline).
    request_timeout_s: float = 0.0
    # Admission control: requests in flight that have no token yet (queued at a
    # worker, reserving, prefilling). Above it new requests get 429 with
    # Retry-After (0 = no limit).
    max_queued_requests: int = 4096
    # The router's own limits (pdd.router.saturation): past any, new requests
    # get 429 with Retry-After while the streams it holds go on. max_loop_lag_s:
    # its event loop ran this late at each of its last probes (a loop busy all the
    # time, not one stall); max_buffered_bytes: what its HTTP connections hold that
    # the kernel has not taken yet, all together. 0 = no limit.
    max_loop_lag_s: float = 0.5
    # max_loop_busy: the share of the last half second its loop's thread was on
    # a CPU. Off by default: at 0.95 it refused work a router carried well
    # (closed-loop clients start their requests in waves, each a burst of a
    # busy loop; docs/benchmarks.md, "The front door").
    max_loop_busy: float = 0.0
    max_buffered_bytes: int = 256 * 2**20
    # max_inbound_lag_s: its workers' messages have waited for it this long
    # without a break (it relays tokens slower than they make them: every
    # stream and every first token waits in its queue that long).
    max_inbound_lag_s: float = 0.5
    # While the router's loop is busy (more than half the time on a CPU), a
    # stream is written at most once per interval, growing with the load up to
    # this many milliseconds: the tokens of the steps between go out in one
    # write, which costs the router about what one token's write costs (the
    # send system call is most of a token's price). An idle router writes each
    # step's tokens at once. 0: always at once (a router that falls behind then
    # writes several steps' tokens at once by itself, later).
    stream_interval_ms: float = 20.0
    # `pdd admin faults set|clear` may inject faults into workers at run time
    # (pdd.faults). Off: those commands are refused. For test and staging clusters.
    allow_fault_injection: bool = False
    # An HTTP client that takes no byte of what it is sent for this long (the
    # server's send buffer for it stays full) is disconnected; its request is
    # aborted on the worker.
    http_send_timeout_s: float = 30.0
    # Tokens of one request the router holds for a client that has not taken
    # them (a stream whose client stopped reading); past it the request is
    # aborted with an error. 1024 tokens are ~10 s of decoding at 100 tokens/s,
    # and cost the router ~0.5 KB each (~5 KB with top_logprobs 20): at most
    # ~0.5 GB (~5 GB) over 1024 connections that all stop reading.
    max_buffered_tokens: int = 1024
    # Logprob entries (each choice's tokens x (top_logprobs + 1)) one answer
    # that is not streamed may ask for: the router holds them all until its
    # last choice ends (~60 bytes each, as JSON). Past it the request gets 400
    # (a stream holds none: it is not bounded by this). 262,144: n = 128 at
    # 97 tokens with top_logprobs 20, or one choice of 12,483 tokens; ~16 MB.
    max_logprob_entries: int = 262_144
    # Host names a key-less HTTP API answers besides IP addresses, "localhost"
    # and `host` ("*": any name). Other names are refused (403): a web page
    # that rebinds its own domain to this server's address names that domain.
    allowed_hosts: tuple[str, ...] = ()
    # SIGTERM: stop taking requests and wait up to this long for those in
    # flight; then end them with an error and exit. The units' TimeoutStopSec
    # is above the default; the router asks systemd for this long when it begins.
    drain_timeout_s: float = 30.0
    # The format the model writes tool calls in (pdd.http.tools): auto (read
    # from the chat template), hermes, llama3_json or mistral.
    tool_call_parser: str = "auto"
    # How a reasoning model's <think>...</think> is split from the answer into
    # reasoning_content (pdd.http.reasoning): auto (read from the chat
    # template), none, deepseek_r1 or qwen3.
    reasoning_parser: str = "auto"
    # Where the router keeps what must outlive it: the workers drained by
    # `pdd admin drain` (pdd.router.drained). "": systemd's $STATE_DIRECTORY
    # (the units' StateDirectory=, /var/lib/pdd) when set, else nowhere (a
    # drain then lasts as long as the router process).
    state_dir: str = ""
    breaker: BreakerConfig = BreakerConfig()
    adaptive: AdaptiveConfig = AdaptiveConfig()
    threshold: ThresholdConfig = ThresholdConfig()

    @property
    def routers(self) -> list[tuple[str, str]]:
        """(control address, admin address) of every router of the cluster, in order."""
        if self.control_addrs:
            return list(zip(self.control_addrs, self.admin_addrs))
        return [(self.control_addr, self.admin_addr)]

    @property
    def own_http_port(self) -> int | None:
        return self.http_ports[self.index] if self.http_ports else None

    @property
    def own_control_addr(self) -> str:
        return self.routers[self.index][0]

    @property
    def own_admin_addr(self) -> str:
        return self.routers[self.index][1]

    @property
    def router_id(self) -> str:
        """This router's name among the cluster's (its worker-side request namespace)."""
        return f"router-{self.index}"

    def validate(self) -> "RouterConfig":
        if len(self.control_addrs) != len(self.admin_addrs):
            raise ConfigError(f"router.control_addrs and router.admin_addrs: one of each per router, got "
                              f"{len(self.control_addrs)} and {len(self.admin_addrs)}")
        if not 0 <= self.index < len(self.routers):
            raise ConfigError(f"router.index: must name one of the {len(self.routers)} router(s) "
                              f"(0 to {len(self.routers) - 1}), got {self.index}")
        for key in ("control_addrs", "admin_addrs"):
            addrs = getattr(self, key)
            if len(set(addrs)) != len(addrs):
                raise ConfigError(f"router.{key}: addresses repeat in {list(addrs)}")
        if self.http_ports and len(self.http_ports) != len(self.control_addrs):
            raise ConfigError(f"router.http_ports: one port per router of router.control_addrs "
                              f"({len(self.control_addrs)}), got {list(self.http_ports)}")
        if any(not 0 < p < 65536 or p == self.port for p in self.http_ports):
            raise ConfigError(f"router.http_ports: TCP ports other than router.port, got {list(self.http_ports)}")
        if self.mode not in ROUTER_MODES:
            raise ConfigError(f"router.mode: must be one of {', '.join(ROUTER_MODES)}, got {self.mode!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"router.port: {self.port} is not a TCP port")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_misses < 1:
            raise ConfigError("router.heartbeat_interval_s must be > 0 and heartbeat_misses >= 1")
        if self.liveness_grace_s < 0:
            raise ConfigError(f"router.liveness_grace_s: must be >= 0, got {self.liveness_grace_s}")
        if self.forget_after_s < 0:
            raise ConfigError(f"router.forget_after_s: must be >= 0, got {self.forget_after_s}")
        if self.request_timeout_s < 0 or self.max_queued_requests < 0:
            raise ConfigError("router.request_timeout_s and router.max_queued_requests: must be >= 0 (0 = off)")
        if self.max_body_bytes < 1024:
            raise ConfigError("router.max_body_bytes: must be >= 1024")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"router.tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"router.reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        if self.http_send_timeout_s <= 0:
            raise ConfigError("router.http_send_timeout_s: must be > 0")
        if self.max_buffered_tokens < 1:
            raise ConfigError("router.max_buffered_tokens: must be >= 1")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ConfigError(f"router.stream_interval_ms: 0 to 1000 milliseconds (0 = each loop turn), "
                              f"got {self.stream_interval_ms}")
        if not 0 <= self.max_loop_busy <= 1:
            raise ConfigError(f"router.max_loop_busy: a share of one core, 0 to 1 (0 = no limit), "
                              f"got {self.max_loop_busy}")
        if not 0 <= self.max_inbound_lag_s < float("inf"):
            raise ConfigError(f"router.max_inbound_lag_s: seconds, >= 0 (0 = no limit), got {self.max_inbound_lag_s}")
        if not 0 <= self.max_loop_lag_s < float("inf") or self.max_buffered_bytes < 0:
            raise ConfigError(f"router.max_loop_lag_s and router.max_buffered_bytes: must be >= 0 (0 = no limit), "
                              f"got {self.max_loop_lag_s} and {self.max_buffered_bytes}")
        if self.max_logprob_entries < 1:
            raise ConfigError(f"router.max_logprob_entries: must be >= 1, got {self.max_logprob_entries}")
        for host in self.allowed_hosts:
            if host != "*" and not re.fullmatch(r"[A-Za-z0-9_.-]+", host):
                raise ConfigError(f"router.allowed_hosts: {host!r} is not a host name; want a name such as "
                                  "'gpu-box.lan' (no scheme, port or path), or '*' for any")
        if self.state_dir and not os.path.isabs(self.state_dir):
            raise ConfigError(f"router.state_dir: must be an absolute path (or empty), got {self.state_dir!r}")
        if not 0 < self.drain_timeout_s < float("inf"):
            raise ConfigError(f"router.drain_timeout_s: must be > 0 (seconds), got {self.drain_timeout_s}")
        for i, name in enumerate(self.served_model_name):
            if not name.strip() or not name.isprintable():
                raise ConfigError(f"router.served_model_name[{i}]: must be a non-empty printable name, got {name!r}")
        if len(set(self.served_model_name)) != len(self.served_model_name):
            raise ConfigError(f"router.served_model_name: names repeat in {list(self.served_model_name)}")
        return self


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


# The built-in tiny model's short name (besides its directory).
BUILTIN_MODEL_NAME = "pdd-tiny"


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class LogConfig:
    """[log]: what every process logs, how, and the request traces the router keeps (pdd.logs)."""
    # `pdd serve` and `pdd up`'s children; `pdd serve --log-level` wins, and
    # `pdd admin log-level` changes it at run time.
    level: str = "info"                  # debug | info | warning | error | critical
    format: str = "text"                 # text | json (one object per line)
    # A message logged again and again (same logger, same template) is let
    # through `repeat_limit` times per `repeat_interval_s`, then summed up in
    # one "... N more like this" line (0: no limit). Access and audit lines are never limited.
    repeat_limit: int = 10
    repeat_interval_s: float = 10.0
    # The router keeps the phase timeline of this many recently finished
    # requests, and of this many of the slowest apart (`pdd admin trace`,
    # `pdd admin requests --slow`).
    trace_recent_requests: int = 1000
    trace_slow_requests: int = 100

    def validate(self) -> "LogConfig":
        if self.level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ConfigError(f"log.format: must be text or json, got {self.format!r}")
        if self.repeat_limit < 0:
            raise ConfigError("log.repeat_limit: must be >= 0 (0: no limit)")
        if self.repeat_interval_s <= 0:
            raise ConfigError("log.repeat_interval_s: must be > 0")
        if self.trace_recent_requests < 0 or self.trace_slow_requests < 0:
            raise ConfigError("log.trace_recent_requests and log.trace_slow_requests: must be >= 0 (0: none kept)")
        return self


@dataclass(frozen=True)
class TracingConfig:
    """[tracing]: request spans exported to an OpenTelemetry collector (pdd.tracing). Unset
    keys fall back to the standard OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS
    and OTEL_SERVICE_NAME; PDD_TRACING__* and the file win over them."""
    # The collector's OTLP/HTTP base URL (spans go to <it>/v1/traces as JSON),
    # e.g. http://127.0.0.1:4318. Empty: no spans, no traceparent in responses.
    otlp_endpoint: str = ""
    service_name: str = "pdd"            # each process is service <service_name>-<role>
    # Share of new traces recorded; a request with a traceparent is recorded as its caller says.
    sample_ratio: float = 1.0
    # Sent with every export, "name=value" each (e.g. an Authorization header).
    headers: tuple[str, ...] = ()
    batch_size: int = 512                # spans per export
    # Spans waiting for export at most; more are dropped and counted
    # (pdd_trace_spans_dropped_total): a slow or down collector never slows serving.
    queue_size: int = 4096
    export_interval_s: float = 1.0       # a batch that is not full goes after this long
    export_timeout_s: float = 5.0        # one export's limit; past it the batch is dropped

    def header_dict(self) -> dict[str, str]:
        return {name.strip(): value for name, _, value in (h.partition("=") for h in self.headers)}

    def validate(self) -> "TracingConfig":
        def bad(key, why):
            raise ConfigError(f"tracing.{key}: {why}")
        if self.otlp_endpoint and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", self.otlp_endpoint):
            bad("otlp_endpoint", f"must be an http:// or https:// URL (the collector's base, e.g. "
                                 f"http://127.0.0.1:4318), got {self.otlp_endpoint!r}")
        if not self.service_name:
            bad("service_name", "must not be empty")
        if not 0.0 <= self.sample_ratio <= 1.0:
            bad("sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")
        for i, h in enumerate(self.headers):
            name, eq, value = h.partition("=")
            if not eq or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name.strip()) or "\n" in value:
                bad(f"headers[{i}]", "must be name=value with a valid HTTP header name")
        if self.batch_size < 1:
            bad("batch_size", "must be >= 1")
        if self.queue_size < self.batch_size:
            bad("queue_size", f"must be >= batch_size ({self.batch_size})")
        for key in ("export_interval_s", "export_timeout_s"):
            if getattr(self, key) <= 0:
                bad(key, "must be > 0")
        return self


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
