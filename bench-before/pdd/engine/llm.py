"""Offline API: `pdd.LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdd.api import SamplingParams
from pdd.config import EngineConfig
from pdd.engine.engine import LLMEngine
from pdd.http.text_stream import TextStream
from pdd.model.config import CheckpointError
from pdd.model.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    # SamplingParams.prompt_logprobs: (logprob, rank, top) per prompt token but the first
    prompt_logprobs: list | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.engine.model_dir)
        except CheckpointError:
            if self.engine.cfg.load_format != "dummy":
                raise
            # A config-only shape for benchmarks: token ids in, token ids out, no text.
            self.tokenizer = None
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists.
        All are submitted at once and run with continuous batching."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        outputs: dict[str, CompletionOutput] = {}
        streams: dict[str, TextStream] = {}
        order = []
        for prompt, sp in zip(prompts, sampling_params):
            if isinstance(prompt, str) and self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            # Each request gets its own params object: validate() may fill in the seed.
            sp = SamplingParams(**vars(sp))
            self.engine.add_request(rid, ids, sp)
            outputs[rid] = CompletionOutput(rid, ids)
            streams[rid] = self._text_stream(ids, sp) if self.tokenizer else None
            order.append(rid)
        while self.engine.has_unfinished():
            outs = self.engine.step()
            for out in outs:
                self._collect(outputs[out.request_id], streams[out.request_id], out)
            if not outs and not self.engine.last_step.num_tokens and self.engine.num_compiling:
                self.engine.wait_for_grammars(0.1)   # nothing to step on until a grammar compiles
        return [outputs[rid] for rid in order]

    def _text_stream(self, prompt_ids: list[int], sp: SamplingParams) -> TextStream:
        eos = () if sp.ignore_eos else self.engine.model_config.eos_token_ids
        return TextStream(self.tokenizer, sp.stop, prompt_ids=prompt_ids,
                          stop_token_ids={*sp.stop_token_ids, *eos}, min_tokens=sp.min_tokens)

    def _collect(self, result: CompletionOutput, stream: TextStream, out) -> None:
        result.token_ids.extend(out.new_token_ids)
        result.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            result.prompt_logprobs = out.prompt_logprobs
        result.num_cached_tokens = out.num_cached_tokens
        if stream is None:
            result.finish_reason = out.finish_reason if out.finished else None
            return
        result.text += stream.add(out.new_token_ids)
        if stream.stopped and not out.finished:
            self.engine.abort_request(out.request_id)
            result.finish_reason = "stop"
        elif out.finished:
            result.text += stream.finish()
            result.finish_reason = "stop" if stream.stopped else out.finish_reason

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> CompletionOutput:
        ids = self.tokenizer.encode_chat(messages)
        return self.generate([ids], sampling_params)[0]
