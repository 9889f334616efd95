"""[engine]: the engine's settings (the model, the KV pool, the scheduler's budgets)."""
from __future__ import annotations

from dataclasses import dataclass

from pdd.config.errors import ConfigError
from pdd.kv.scales import KV_CACHE_DTYPES


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
