"""Control-plane messages between router and workers.

Each message is a dataclass with a `TYPE` tag. On the wire it is a msgpack map
{"t": TYPE, "v": PROTOCOL_VERSION, <fields>} (see codec.py). Field types are
checked on receipt, so a malformed message is refused at the socket, with an
error naming the field, before any handler sees it. Fields that are themselves
dataclasses (TokenItem, SamplingParams, and its StructuredOutput) travel as
arrays of their fields in declaration order (compact: a step's TokenBatch holds hundreds of items),
checked the same way.

Every message about one request carries its `epoch`: the router bumps it each
time it places the request anew (migration, fallback), a worker holds a
request as (request_id, epoch), and the router drops whatever a worker says
about an earlier placement.

Every message from a worker names its `worker_id`: the router's state is keyed
by it, while the connection it arrives on is one process's own (two processes
under one id are two connections; pdd.router.connections tells them apart).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pdd.api import SamplingParams, StepSample

PROTOCOL_VERSION = 8


@dataclass
class Message:
    TYPE: ClassVar[str] = ""


# ---------------------------------------------------------------- worker -> router


@dataclass
class StepLimits:
    """A worker's scheduler limits (pdd.config.EngineConfig), for the router's
    prefill-time model (pdd.router.estimator)."""
    budget: int = 0                        # max_num_batched_tokens (0: not said)
    chunk: int = 0                         # chunk_size (0: not said)
    chunk_only_beside_decodes: bool = True
    prefill_beside_decodes: int = 0        # prefill_tokens_beside_decodes (0: the budget)
    # Short prompts before long ones: long_prefill_token_threshold (0: first
    # come, first served, also what a worker that does not say it is taken to
    # do), max_long_partial_prefills, long_prefill_min_share.
    long_threshold: int = 0
    long_partial: int = 0
    long_share: float = 0.0
    # What the model costs, for the step-time priors before the worker is measured
    # (0: not said, the priors' own model): FLOPs of a prompt token (2 x the
    # parameters it multiplies by; a mixture of experts: its top-k experts), and
    # the expert weight bytes one more decode adds to a step (a mixture of experts
    # reads more experts as its batch grows; a dense model none).
    prefill_flops_per_token: float = 0.0
    decode_expert_bytes: float = 0.0

    @classmethod
    def of(cls, cfg, model=None) -> "StepLimits":
        """From the EngineConfig and, when given, the model's ModelConfig."""
        flops, expert_bytes = (0.0, 0.0) if model is None else (2.0 * model.num_active_parameters(),
                                                               model.decode_expert_bytes())
        return cls(cfg.max_num_batched_tokens, cfg.chunk_size, cfg.chunk_only_beside_decodes,
                   cfg.prefill_tokens_beside_decodes or 0, cfg.long_prefill_token_threshold or 0,
                   cfg.max_long_partial_prefills, cfg.long_prefill_min_share, flops, expert_bytes)


@dataclass
class Register(Message):
    """A worker announces itself. `layout` is the KV layout descriptor
    (pdd.kv.layout.KVLayout as a dict): workers whose KV cannot be exchanged
    must disagree on it."""
    TYPE: ClassVar[str] = "register"
    worker_id: str
    role: str
    host: str
    pid: int
    device: str
    layout: dict
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    data_addr: str = ""
    transfer_backends: list[str] = field(default_factory=list)  # best first
    host_id: str = ""   # this boot of this machine: cuda_ipc needs both ends on one
    # A fresh random id per process start: the same worker id registering with
    # another incarnation is a new process, and the old one's requests are lost.
    incarnation: str = ""
    public_key: str = ""  # CURVE public key of its data socket (z85), "" when insecure
    # A colocated worker that also prefills for others (worker.prefill_for_others).
    prefills_for_others: bool = False
    step: StepLimits = field(default_factory=StepLimits)
    build: dict = field(default_factory=dict)   # pdd.build_info() of the worker (`pdd admin version`)
    # How many times this process dropped everything this router placed on it
    # (pdd.worker.links): the same process registering with another session
    # holds none of it any more, and the router moves it.
    session: int = 0


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    worker_id: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    # Prompt tokens found in / looked up in the prefix cache since the worker
    # started (monotonic totals: the router counts the deltas).
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    # The steps since the previous heartbeat (those that computed tokens):
    # the router's histograms and its step-cost model (pdd.router.estimator).
    steps: list[StepSample] = field(default_factory=list)
    # Prompt tokens admitted and not yet computed (waiting and partly prefilled requests).
    prefill_tokens_pending: int = 0
    # Of `running`, the requests past their prompt that decode (a prefill
    # worker's prompts and prefill-only requests are not): the steps' decode load.
    decoding: int = 0
    # Recently computed block hashes (newest last): prefix-affinity routing.
    recent_hashes: list[int] = field(default_factory=list)
    transfer: dict = field(default_factory=dict)
    # A draining worker finishes what it runs but must be sent nothing new.
    draining: bool = False
    # Engine progress, from the engine thread: steps completed since start, and
    # how long the step running now has run (0.0 when idle). A step that never
    # ends shows here while the event loop still answers (hang detection).
    steps_completed: int = 0
    step_running_s: float = 0.0
    faults: dict[str, float] = field(default_factory=dict)   # injected faults set (pdd.faults)
    # Triton kernels compiled after the worker's warm-up (each stalled every
    # request on it): should stay 0 (pdd.engine.engine.LLMEngine.watch_compiles).
    kernels_compiled_in_service: int = 0
    # Of prefill_tokens_pending, those of long prompts (more than the worker's
    # StepLimits.long_threshold left to compute), and how many prompts they
    # are: its scheduler lets short prompts pass them (the router's TTFT model).
    long_prefill_tokens_pending: int = 0
    long_prefills_pending: int = 0
    # The host KV tier behind its pool (pdd.kv.tier.TierStats; {}: none), and
    # the hashes it stored since the previous heartbeat (newest last): what the
    # worker can load instead of compute (prefix affinity, the cost model).
    host_kv: dict = field(default_factory=dict)
    host_hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenItem:
    """What one step produced for one request."""
    request_id: str
    epoch: int
    # Where token_ids[0] stands in the request's output (0: the first token).
    # Two workers may both send a token (the prefill worker's first token and
    # the decode worker that started on the KV); the router keeps one copy.
    position: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # Per new token: [logprob of the sampled token, [[token id, logprob], ...]].
    logprobs: list | None = None
    num_cached_tokens: int = 0
    # With the first token, when SamplingParams.prompt_logprobs asks: per prompt
    # position but the first, [logprob, rank, [[token id, logprob], ...]].
    prompt_logprobs: list | None = None


@dataclass
class TokenBatch(Message):
    """Every token one engine step produced: one message per step, not per token."""
    TYPE: ClassVar[str] = "tokens"
    worker_id: str
    items: list[TokenItem]


@dataclass
class RequestFailed(Message):
    TYPE: ClassVar[str] = "request_failed"
    worker_id: str
    request_id: str
    epoch: int
    error: str
    # True when another worker could still serve it (e.g. this one is out of
    # capacity); False for a request that is itself invalid.
    retriable: bool = False
    # The request itself is at fault (InvalidRequest: a grammar that does not
    # compile within its budget, say): its client gets a 400, not a 500.
    invalid: bool = False


@dataclass
class PrefixCacheReset(Message):
    """The answer to ResetPrefixCache: this worker's cache no longer finds any free block."""
    TYPE: ClassVar[str] = "prefix_cache_reset"
    worker_id: str
    reset_id: str
    dropped_blocks: int = 0


@dataclass
class Goodbye(Message):
    """A worker stopping cleanly (drained); the router forgets it at once."""
    TYPE: ClassVar[str] = "goodbye"
    worker_id: str


# ---------------------------------------------------------------- router -> worker

@dataclass
class RegisterReply(Message):
    TYPE: ClassVar[str] = "register_reply"
    ok: bool
    error: str = ""
    heartbeat_interval_s: float = 0.5
    # The router counts a worker it has not heard from for this long as lost
    # (router.heartbeat_misses heartbeats, then router.liveness_grace_s);
    # a worker it has not answered for this long says so (0: no watch).
    liveness_s: float = 0.0


@dataclass
class HeartbeatAck(Message):
    """The router heard this worker's heartbeat and holds it registered: every
    heartbeat is answered, by this, ReRegister or Replaced. Also the router's
    probe of a worker gone silent (pdd.router.membership): only its delivery
    counts."""
    TYPE: ClassVar[str] = "heartbeat_ack"


@dataclass
class ReRegister(Message):
    """The router does not know this worker (it restarted): register again."""
    TYPE: ClassVar[str] = "reregister"


@dataclass
class Replaced(Message):
    """Another process registered under this worker's id after this one: this
    process is not the worker any more and must exit, and not be restarted
    (pdd.config.EXIT_REFUSED) into a fight over the id."""
    TYPE: ClassVar[str] = "replaced"


@dataclass
class Admit(Message):
    """Run a request here, prefill and decode (colocated path)."""
    TYPE: ClassVar[str] = "admit"
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Tokens already streamed to the client before this worker took over (they
    # are the tail of prompt_token_ids); they count towards max_tokens.
    num_prior_output_tokens: int = 0
    # The chained hashes of its full blocks (pdd.kv.hashing), computed once by
    # the router: the worker need not hash the prompt again.
    block_hashes: list[int] = field(default_factory=list)
    # The most prompt tokens of this request per step beside running decodes
    # (0: the engine's chunk_size). Adaptive placement sizes it so that a long
    # prompt prefilled where others decode keeps their inter-token gap in bounds.
    prefill_chunk: int = 0
    # The router's phase span this work belongs to, as a W3C traceparent ("":
    # not traced; the worker makes no span). pdd.tracing.
    traceparent: str = ""


@dataclass
class Abort(Message):
    """Drop these requests, whatever their epoch, and free their blocks."""
    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"
    drain: bool = True


@dataclass
class SetFaults(Message):
    """Fault injection at run time (pdd.faults; only with router.allow_fault_injection):
    set these faults, after clearing every one when `clear`."""
    TYPE: ClassVar[str] = "set_faults"
    faults: dict[str, float] = field(default_factory=dict)
    clear: bool = False


@dataclass
class SetLogLevel(Message):
    """Set this worker's log level (`pdd admin log-level LEVEL WORKER|all`)."""
    TYPE: ClassVar[str] = "set_log_level"
    level: str


@dataclass
class ResetPrefixCache(Message):
    """Forget the prefix cache's free blocks (POST /reset_prefix_cache, `pdd admin
    cache flush`); blocks that requests hold stay as they are. Answered PrefixCacheReset."""
    TYPE: ClassVar[str] = "reset_prefix_cache"
    reset_id: str


# ---------------------------------------------------------------- disaggregation
# Lifecycle: router -> decode Reserve and router -> prefill Prefill, at once;
# decode -> router Reserved; router -> prefill KVTarget; prefill -> router
# FirstToken as soon as it is sampled; prefill writes KV into the reserved blocks
# over the data plane, its last data-plane message carrying the first token;
# the decode worker starts on that message (no relay through the router) and
# streams TokenBatch, from position 0; prefill -> router PrefillDone.

@dataclass
class Reserve(Message):
    """Decode side: hold blocks for a prompt whose KV will arrive from a prefill worker."""
    TYPE: ClassVar[str] = "reserve"
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lease_ttl_s: float
    block_hashes: list[int] = field(default_factory=list)   # as Admit's
    traceparent: str = ""     # as Admit's


@dataclass
class Reserved(Message):
    TYPE: ClassVar[str] = "reserved"
    worker_id: str
    request_id: str
    epoch: int
    ok: bool
    error: str = ""
    lease_id: str = ""
    block_ids: list[int] = field(default_factory=list)
    # Leading prompt tokens the decode worker already caches (whole blocks): not sent.
    num_cached_tokens: int = 0


@dataclass
class Prefill(Message):
    """Prefill side: compute the prompt and sample the first token. Sent while
    the decode worker reserves (the reservation is off the time to first
    token); where the KV goes follows in KVTarget."""
    TYPE: ClassVar[str] = "prefill"
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    transfer_backend: str = "tcp"
    block_hashes: list[int] = field(default_factory=list)   # as Admit's
    traceparent: str = ""     # as Admit's


@dataclass
class KVTarget(Message):
    """Prefill side: write the KV of blocks [skip_blocks:] into dst_block_ids on
    dst_addr under lease_id (what the decode worker's Reserved said)."""
    TYPE: ClassVar[str] = "kv_target"
    request_id: str
    epoch: int
    dst_worker: str
    dst_addr: str
    dst_block_ids: list[int]
    skip_blocks: int
    lease_id: str
    dst_public_key: str = ""   # the decode worker's data-socket CURVE key, as it registered
    traceparent: str = ""      # as Admit's


@dataclass
class FirstToken(Message):
    """The prefill worker sampled the request's first token; its pages may still
    be in flight (PrefillDone follows). The router streams it at once: the
    transfer is off the time to first token."""
    TYPE: ClassVar[str] = "first_token"
    worker_id: str
    request_id: str
    epoch: int
    token: int
    logprobs: list | None = None
    num_cached_tokens: int = 0


@dataclass
class PrefillDone(Message):
    """Every page has landed: the decode worker accepted the transfer's last
    message (and started the request on it; its tokens may reach the router first)."""
    TYPE: ClassVar[str] = "prefill_done"
    worker_id: str
    request_id: str
    epoch: int
    first_token: int
    logprobs: list | None = None
    num_cached_tokens: int = 0       # prompt tokens the prefill worker found in its own cache
    transfer: dict = field(default_factory=dict)


@dataclass
class PrefillFailed(Message):
    TYPE: ClassVar[str] = "prefill_failed"
    worker_id: str
    request_id: str
    epoch: int
    error: str


@dataclass
class PrefillLocally(Message):
    """Decode side: the KV will not come (transfer failed, prefill worker lost):
    compute the prompt here, in the blocks already reserved (colocated fallback).
    `first_token`, when the client already has it, is kept: the decode worker
    continues after it instead of sampling its own."""
    TYPE: ClassVar[str] = "prefill_locally"
    request_id: str
    epoch: int
    lease_id: str
    first_token: int | None = None
    traceparent: str = ""     # as Admit's


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in Message.__subclasses__()
}

