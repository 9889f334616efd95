"""Types that the engine, the workers, the router and the wire share: what a
request asks (SamplingParams, and InvalidRequest when that cannot be served)
and what an engine step measured (StepSample).

They live here, not in engine/ (which imports torch) or protocol/, so that any
side uses them without importing another side's machinery: the router never
imports torch.

SamplingParams: `validate()` is the one check of every field, run where a
request enters (HTTP parsing at the router, `LLMEngine.make_request` on a
worker, since a control message could carry anything). It bounds each value to
what the sampler and the wire can take, so a poison value is refused with an
error naming the field instead of failing a batch on the GPU.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the offending field."""


# Below this temperature sampling is greedy (as vLLM's _SAMPLING_EPS): dividing
# float32 logits by a smaller one overflows to inf and samples garbage.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0                # presence and frequency penalties lie in [-2, 2] (OpenAI, vLLM)
# vLLM takes any repetition penalty above 0; past this one a seen token is
# ruled out anyway, and a bound keeps every value finite on the device.
MAX_REPETITION_PENALTY = 100.0
MAX_STOP_STRINGS = 16            # OpenAI allows 4; a few more cost nothing
# Text that may still begin a stop string is held back from the stream, so a
# long stop string delays every token's text by its length.
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
INT64_MAX = (1 << 63) - 1
# A seed may be any integer of 64 bits, signed or unsigned; it is used modulo
# 2**63 (seeds are int64 tensors on the device), so s and s + 2**63 coincide.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# What a structured output constrains the text to (pdd.grammar turns each into
# a grammar): any JSON object, a JSON schema's instances, a regular
# expression's matches, one of a list of strings, a Lark or GBNF grammar's
# sentences.
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# A schema or grammar travels in every Admit/Reserve/Prefill of its request.
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


@dataclass
class StructuredOutput:
    """The grammar a request's output must follow, as the client gave it: every
    engine that runs the request (prefill, decode, a worker it migrates to)
    compiles it and replays the request's output tokens into it, so the
    constraint holds in every layout without carrying matcher state."""
    kind: str        # one of STRUCTURED_KINDS
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON
    # array of strings; grammar: Lark or GBNF text; json_object: "".
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(f"structured_output.kind: must be one of {', '.join(STRUCTURED_KINDS)}, "
                                 f"got {_shown(self.kind)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidRequest(f"structured_output.spec: must be a string of at most "
                                 f"{MAX_STRUCTURED_SPEC_CHARS} characters")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0   # below GREEDY_BELOW_TEMPERATURE: greedy
    top_k: int = 0          # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    # None: a random seed is drawn at admission, so the request's randomness is
    # still a function of (seed, position) and survives preemption or migration.
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings are matched on text, where text is made (router, offline API);
    # the engine only sees token ids.
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None   # top-N logprobs per sampled token; 0 = only the sampled one
    # Penalties as vLLM defines them (pdd.engine.penalties): presence and
    # frequency count the request's output tokens, repetition its prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Top-N logprobs per prompt token (0 = only the prompt's own token); None: off.
    prompt_logprobs: int | None = None
    # The output must follow this grammar (tokens it forbids are never sampled,
    # and EOS only where it may end); None: free text.
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Some penalty is not neutral: the sampler needs the request's tokens so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> "SamplingParams":
        """Check every field (InvalidRequest naming the first bad one) and
        normalise in place: a near-zero temperature becomes 0 (greedy), a
        missing seed is drawn, the seed is reduced modulo 2**63."""
        _integer("max_tokens", self.max_tokens, 1, INT64_MAX)
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _integer("top_k", self.top_k, -1, INT64_MAX, "-1, 0 (off) or a positive integer")
        _number("top_p", self.top_p, 0.0, 1.0, lo_exclusive=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _integer("seed", self.seed, SEED_MIN, SEED_MAX, "an integer of at most 64 bits")
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens, "in [0, max_tokens]")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_exclusive=True)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        self._validate_stops()
        so = self.structured_output
        if so is not None:
            if not isinstance(so, StructuredOutput):
                raise InvalidRequest(f"structured_output: must be a StructuredOutput, got {_shown(so)}")
            so.validate()
        if self.greedy:
            self.temperature = 0.0
        if self.seed is None:
            self.seed = random.getrandbits(63)
        self.seed &= INT64_MAX
        return self

    def _validate_stops(self) -> None:
        ids, stop = self.stop_token_ids, self.stop
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids: must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        for t in ids:
            _integer("stop_token_ids", t, 0, INT64_MAX, "a list of non-negative token ids")
        if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: must be a list of at most {MAX_STOP_STRINGS} strings")
        for s in stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"stop: each stop string must be a non-empty string of at most "
                                     f"{MAX_STOP_STRING_CHARS} characters, got {_shown(s)}")


def _integer(name: str, value, lo: int, hi: int, expected: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequest(f"{name}: must be {expected or f'an integer in [{lo}, {hi}]'}, got {_shown(value)}")


def _number(name: str, value, lo: float, hi: float, lo_exclusive: bool = False) -> None:
    """An int or float in [lo, hi] ((lo, hi] if lo_exclusive): NaN fails every
    comparison and the bounds are finite, so inf and NaN are refused too."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (lo < value if lo_exclusive else lo <= value) and value <= hi)
    if not ok:
        interval = f"{'(' if lo_exclusive else '['}{lo:g}, {hi:g}]"
        raise InvalidRequest(f"{name}: must be a number in {interval}, got {_shown(value)}")


def _shown(value) -> str:
    """A value for an error message, cut short: it may be a megabyte of poison."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class StepSample:
    """One engine step, as the engine measured it, a worker journals it and a
    heartbeat carries it to the router (histograms, and the step-cost model of
    pdd.router.estimator, which prices decode and prompt tokens apart and a
    chunk deep in its prompt by its query-key pairs)."""
    latency_s: float = 0.0
    num_tokens: int = 0                 # tokens computed: decodes + prompt-chunk tokens
    num_decodes: int = 0                # decode tokens among them (one per decoding request)
    prefill_chunks: list[int] = field(default_factory=list)   # tokens of each prompt chunk
    prefill_pairs: int = 0              # query-key pairs of its prompt chunks (query_key_pairs)


def query_key_pairs(start: int, n: int) -> int:
    """The attention work of a prompt chunk: `n` tokens after `start` computed
    ones, each query seeing the keys before it and itself. Steps report it
    (pdd.api.StepSample.prefill_pairs) and the router's step model prices it."""
    return n * start + n * (n + 1) // 2
