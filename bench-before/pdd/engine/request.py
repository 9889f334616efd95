"""A request as the engine sees it: tokens so far, how many have KV, its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from pdd.api import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1   # blocks reserved, KV arriving from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13   # it cannot go on (its grammar failed): `Request.error` says why

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Tokens produced before this engine saw the request (a resumed or migrated
    # request): they count towards max_tokens and sampling positions.
    num_prior_output_tokens: int = 0
    # Prefill-only requests stop after the first sampled token (prefill role).
    prefill_only: bool = False
    # The most of its prompt tokens one step takes beside running decodes
    # (0: the scheduler's chunk_size); a step where nothing decodes is not capped.
    prefill_chunk: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is written, or being written by a launched step (the
    # scheduler advances it when it schedules, so the next step can be
    # scheduled before this one's results are back).
    num_computed_tokens: int = 0
    # Tokens sampled by a launched step whose value the host does not have yet
    # (0 or 1 between steps): the next step may already compute them, reading
    # them on the GPU.
    num_in_flight: int = 0
    num_cached_tokens: int = 0          # prompt tokens found in the prefix cache
    num_preemptions: int = 0

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes: list[int] = []
        self._distinct_prompt_ids: np.ndarray | None = None
        # Prompt logprobs (sampling.prompt_logprobs), one entry per prompt
        # position but the last, filled chunk by chunk; handed out once, with
        # the first output token (take_prompt_logprobs).
        self.prompt_logprobs: list | None = [] if self.wants_prompt_logprobs else None
        # Its structured output's matcher (pdd.grammar.Matcher), fed its output tokens; None: free text.
        self.grammar = None
        self.error: str | None = None   # why it ended FINISHED_ERROR
        # Its grammar compiles (off the step): not scheduled until its matcher is there.
        self.awaiting_grammar = False

    @property
    def output_start(self) -> int:
        """Where the request's output begins in all_token_ids: a resumed request's
        prompt ends with the output made before this engine saw it."""
        return self.num_prompt_tokens - self.num_prior_output_tokens

    def distinct_prompt_ids(self) -> np.ndarray:
        """The distinct token ids of the request's own prompt (repetition penalty)."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = np.unique(np.asarray(self.prompt_token_ids[:self.output_start],
                                                             dtype=np.int64))
        return self._distinct_prompt_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prompt's logprobs are asked for and not given yet (a resumed
        request gave them with its first token, elsewhere)."""
        return self.sampling.prompt_logprobs is not None and self.num_prior_output_tokens == 0

    def take_prompt_logprobs(self) -> list | None:
        """The prompt's logprobs, once: None after the first call, and when not asked for."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_in_flight(self) -> int:
        return len(self.all_token_ids) + self.num_in_flight

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_prior_output_tokens

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def decoding(self) -> bool:
        """Past its prompt, with tokens still to generate here (a prefill-only
        request never is; one whose last token is in flight is done)."""
        return (not self.prefill_only and self.num_computed_tokens >= self.num_prompt_tokens
                and not self.stops_after_in_flight())

    def stops_after_in_flight(self) -> bool:
        """The token in flight ends the request whatever its value (a prefill-only
        request, or the last of max_tokens): nothing to schedule after it."""
        return self.num_in_flight > 0 and (
            self.prefill_only or self.num_output_tokens + self.num_in_flight >= self.sampling.max_tokens)

    def stop_ids_banned_at(self, position: int) -> tuple[int, ...]:
        """The tokens that may not be sampled at `position`: while fewer than
        `min_tokens` come before it, those that would end the request (as vLLM,
        which masks them; the sampler does too)."""
        sp = self.sampling
        if self.grammar is not None:
            return ()   # the grammar says when the output may end
        if not sp.min_tokens or position - self.num_prompt_tokens + self.num_prior_output_tokens >= sp.min_tokens:
            return ()
        return (*sp.stop_token_ids, *(() if sp.ignore_eos else self.eos_token_ids))

    def check_stop(self) -> bool:
        """Set a finished status if the last token ends the request."""
        sp = self.sampling
        last = self.all_token_ids[-1]
        if self.grammar is not None:
            self.grammar.sync(self.output_token_ids)
            self.error = self.grammar.failed
            if self.error:   # the output would no longer follow the grammar: no "stop" that lies
                self.status = RequestStatus.FINISHED_ERROR
                return True
            if self.grammar.stopped:   # complete: nothing but EOS could follow
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if self.num_output_tokens > sp.min_tokens:
            if (not sp.ignore_eos and last in self.eos_token_ids) or last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if self.num_output_tokens >= sp.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
