"""[router]: the router's settings, with the tables inside it: [router.breaker],
[router.adaptive] and [router.threshold]."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pdd.config.errors import ConfigError

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")   # pdd.http.tools
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")   # pdd.http.reasoning
ROUTER_MODES = ("auto", "colocated", "disagg", "adaptive", "threshold")


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
