"""A seeded random workload driven through one engine's add/step/abort, checked
against each request run alone (tests/engine/test_fuzz.py; also a hunting tool:
`python -m tests.engine.fuzz FIRST_SEED COUNT`).

One seed picks an engine configuration (block size, a KV pool tight enough to
preempt, small prefill chunks and step budgets, long-prompt thresholds, async
scheduling on or off) and a timeline: requests arrive at random steps with
prompts that share prefixes with earlier prompts and outputs (equal, strict
prefixes, continuations: prefix-cache hits, also on blocks freed but still
cached), greedy or seeded sampling, stop tokens, max_tokens 1, min_tokens,
penalties, logprobs, prompt logprobs, a grammar. Some are the other roles' requests:
prefill-only, resumed from output made elsewhere, reserved and then prefilled
here after all (after the first token or not). Some take the id of a request
that is over (aborted while its step may still be in flight). Some are
aborted before their first step, mid-prefill, mid-decode, while reserved, or
right after they finish (refused).

Checked: each request's tokens and finish reason equal its run alone (an
aborted one's tokens are a prefix of them, and nothing comes after the
abort), positions are contiguous, the engine never stalls, and at the end
no request, block or reference is left. The run alone is on an engine that
caches nothing and waits for every step; its output equals Hugging Face's
(test_hf_equivalence.py). Sampling is counter-based (pdd.engine.sampler): a
seeded request's tokens do not depend on its batch, so seeded requests are
compared exactly too.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from pdd import LLM, SamplingParams
from pdd.api import StructuredOutput
from tests.engine.helpers import assert_all_blocks_free

# Logprob gap under which two tokens are a tie: a batch changes a matmul's
# summation order, so a near-tie may resolve either way without any defect.
TIE = 1e-4


@dataclass
class Solo:
    tokens: list[int]
    reason: str | None
    # Per token: the gap between the two likeliest tokens' logprobs, or None
    # where the sample was not an argmax.
    gaps: list
    prompt_logprobs: list | None = None


@dataclass
class Reference:
    """Solo runs of requests on one engine that never shares or reuses KV."""
    model: str
    _llm: LLM | None = None
    _runs: dict = field(default_factory=dict)

    def run(self, prompt: list[int], sp: SamplingParams, num_prior: int = 0) -> Solo:
        """The request alone: `prompt`, whose last `num_prior` tokens are output
        made elsewhere."""
        key = (tuple(prompt), repr(sp), num_prior)
        if key not in self._runs:
            if self._llm is None:
                self._llm = LLM(self.model, num_blocks=1024, enable_prefix_caching=False, async_scheduling=False)
            engine = self._llm.engine
            engine.add_request("solo", prompt, dataclasses.replace(sp, logprobs=2), num_prior_output_tokens=num_prior)
            tokens, logprobs, reason, prompt_logprobs = [], [], None, None
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
                    logprobs += out.logprobs
                    reason = out.finish_reason
                    prompt_logprobs = out.prompt_logprobs or prompt_logprobs
            gaps = [top[0][1] - top[1][1] if self._argmax(sp) else None for _, top in logprobs]
            self._runs[key] = Solo(tokens, reason, gaps, prompt_logprobs)
        return self._runs[key]

    @staticmethod
    def _argmax(sp: SamplingParams) -> bool:
        """Its tokens are the model's likeliest (nothing banned, penalized or masked)."""
        return sp.greedy and not sp.penalized and not sp.min_tokens and sp.structured_output is None


@dataclass
class Planned:
    key: int                       # its index in the plan
    prompt: list[int]
    sampling: SamplingParams
    arrive: int                    # step index it is added before
    # add: an ordinary request; prefill_only: the prefill role's; resumed: the
    # prompt ends with num_prior tokens of output made elsewhere; reserve: the
    # decode role's reservation, then a local prefill `local_after` steps
    # later, after the first token when first_token (or an abort meanwhile).
    kind: str = "add"
    num_prior: int = 0
    local_after: int = 0
    first_token: bool = False
    abort_after: int | None = None  # steps after its arrival it is aborted (0: before its first step)
    abort_when_done: bool = False   # abort it as soon as it finishes (must be refused)
    prefill_chunk: int = 0
    reuse_id: bool = False          # take the engine id of a request that is over

    def expected(self, reference: Reference) -> Solo:
        """Its run alone (a prefill-only request: the first token, any reason)."""
        solo = reference.run(self.prompt, self.sampling, self.num_prior)
        if self.kind == "prefill_only":
            return Solo(solo.tokens[:1], None, solo.gaps[:1], solo.prompt_logprobs)
        return solo


def engine_config(rng: random.Random) -> dict:
    block_size = rng.choice([2, 4, 8, 16])
    # A pool of 24..160 tokens: a few requests fill it (preemptions), one always fits.
    num_blocks = 1 + max(2, rng.randint(24, 160) // block_size)
    budget = rng.choice([4, 8, 16, 32, 64, 2048])
    return dict(
        block_size=block_size, num_blocks=num_blocks,
        chunk_size=rng.choice([1, 3, 8, 16, 512]),
        max_num_batched_tokens=budget,
        max_num_seqs=rng.choice([1, 2, 3, 8, 256]),
        chunk_only_beside_decodes=rng.random() < 0.5,
        prefill_tokens_beside_decodes=rng.choice([None, None, 2, 7]),
        long_prefill_token_threshold=rng.choice([0, 5, 12, 4096]),
        max_long_partial_prefills=rng.choice([1, 2, 4]),
        long_prefill_min_share=rng.choice([0.1, 0.25, 1.0]),
        enable_prefix_caching=rng.random() < 0.85,
        async_scheduling=rng.random() < 0.6,
    )


def sampling(rng: random.Random, vocab: int) -> SamplingParams:
    kw = dict(max_tokens=rng.choice([1, 1, 2, 3, 5, 8, 12, 16]), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(2**32),
                  top_k=rng.choice([0, 0, 5, 50]), top_p=rng.choice([1.0, 1.0, 0.9]))
    r = rng.random()
    if r < 0.15:
        kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.1:
        kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    if rng.random() < 0.1:
        kw["logprobs"] = rng.choice([0, 3])
    if rng.random() < 0.05:
        kw["prompt_logprobs"] = 1
    if rng.random() < 0.05:
        kw["structured_output"] = StructuredOutput("regex", "[a-z]{2,5}-[0-9]{3}")
    return SamplingParams(**kw)


def plan(rng: random.Random, reference: Reference, vocab: int, max_len: int, num_requests: int) -> list[Planned]:
    """Requests and when they arrive. Prompts reuse earlier prompts and the
    prompt + output of earlier requests (their blocks are in the cache)."""
    texts: list[list[int]] = []
    planned = []
    arrive = 0
    for i in range(num_requests):
        sp = sampling(rng, vocab)
        longest = max_len - sp.max_tokens
        r = rng.random()
        if texts and r < 0.15:
            prompt = list(rng.choice(texts))                      # equal
        elif texts and r < 0.35:
            t = rng.choice(texts)
            prompt = t[:rng.randint(1, len(t))]                  # a prefix (maybe strict)
        elif texts and r < 0.7:
            t = rng.choice(texts)
            prompt = t[:rng.randint(0, len(t))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        prompt = prompt[:longest] or [rng.randrange(vocab)]
        if rng.random() < 0.05:   # the stop token the request's third token would be
            tokens = reference.run(prompt, sp).tokens
            if len(tokens) > 3:
                sp.stop_token_ids = [tokens[2]]
        arrive += rng.choice([0, 0, 0, 1, 1, 2, 5])
        p = Planned(i, prompt, sp, arrive, prefill_chunk=rng.choice([0, 0, 0, 1, 5]), reuse_id=rng.random() < 0.1)
        k = rng.random()
        if k < 0.1:
            p.kind = "prefill_only"
        elif k < 0.2:
            p.kind = "reserve"
            p.local_after, p.first_token = rng.choice([0, 1, 3]), rng.random() < 0.5
        elif k < 0.3:
            tokens = reference.run(prompt, sp).tokens
            if tokens and len(prompt) + len(tokens) < max_len:
                p.kind = "resumed"
                p.num_prior = rng.randint(1, len(tokens))
                p.prompt = prompt + tokens[:p.num_prior]
        tokens = p.expected(reference).tokens
        texts.append(p.prompt)
        if len(p.prompt) + len(tokens) < max_len:
            texts.append(p.prompt + tokens)
        a = rng.random()
        if a < 0.2:
            p.abort_after = rng.choice([0, 0, 1, 1, 2, 3, 5, 8, 13])
        elif a < 0.3:
            p.abort_when_done = True
        planned.append(p)
    return planned


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finished: str | None = None
    aborted: bool = False
    cached: int = 0
    prompt_logprobs: list | None = None


class Driver:
    """One engine through a plan, keeping what each request emitted."""

    def __init__(self, llm: LLM, planned: list[Planned], reference: Reference, where: str):
        self.engine, self.reference, self.where = llm.engine, reference, where
        self.pending = list(planned)
        self.outcomes = {p.key: Outcome() for p in planned}
        self.live: dict[str, tuple[Planned, int]] = {}   # engine id -> (request, step it arrived at)
        self.reserved: dict[str, tuple[Planned, int]] = {}
        self.over: list[str] = []                         # engine ids free for reuse
        self.step_no = 0

    def run(self) -> None:
        engine = self.engine
        while self.pending or engine.has_unfinished() or self.reserved:
            while self.pending and self.pending[0].arrive <= self.step_no:
                self.arrive(self.pending.pop(0))
            for rid, (p, at) in list(self.reserved.items()):
                if self.step_no - at >= p.local_after and rid in self.live:
                    del self.reserved[rid]
                    first = None
                    if p.first_token:
                        first = p.expected(self.reference).tokens[0]
                        self.outcomes[p.key].tokens.append(first)
                    out = engine.prefill_locally(rid, first)
                    if out is not None:
                        self.take(out)
            for rid, (p, at) in list(self.live.items()):
                if p.abort_after is not None and self.step_no - at >= p.abort_after:
                    assert engine.abort_request(rid), f"{self.where}: abort of live {rid} refused"
                    self.outcomes[p.key].aborted = True
                    self.end(rid)
            for out in engine.step():
                self.take(out)
            self.step_no += 1
            assert self.step_no < 3000, f"{self.where}: no progress (a stalled engine)"

    def arrive(self, p: Planned) -> None:
        rid = f"r{p.key}"
        if p.reuse_id and self.over:
            rid = self.over.pop(0)
        sp = dataclasses.replace(p.sampling)
        if p.kind == "reserve" and self.engine.reserve(rid, p.prompt, sp) is not None:
            self.reserved[rid] = (p, self.step_no)
        else:
            self.engine.add_request(rid, p.prompt, sp, prefill_chunk=p.prefill_chunk,
                                    prefill_only=p.kind == "prefill_only", num_prior_output_tokens=p.num_prior)
        self.live[rid] = (p, self.step_no)

    def end(self, rid: str) -> None:
        del self.live[rid]
        self.reserved.pop(rid, None)
        self.over.append(rid)

    def take(self, out) -> None:
        where = f"{self.where}: {out.request_id}"
        assert out.request_id in self.live, f"{where} (over) produced {out.new_token_ids}"
        p, _ = self.live[out.request_id]
        o = self.outcomes[p.key]
        assert out.position == len(o.tokens) + p.num_prior, f"{where} skipped or repeated a position"
        o.tokens += out.new_token_ids
        o.cached = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            o.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            o.finished = out.finish_reason
            self.end(out.request_id)
            if p.abort_when_done:
                assert not self.engine.abort_request(out.request_id), f"{where}: abort after its end accepted"


def run(model: str, seed: int, reference: Reference, num_requests: int = 24) -> dict:
    """Drive one engine through seed's workload and check it; returns a summary
    (config, counts) for the caller to report. Raises AssertionError naming the
    seed, the request and what differs."""
    rng = random.Random(seed)
    cfg = engine_config(rng)
    llm = LLM(model, **cfg)
    engine = llm.engine
    planned = plan(rng, reference, engine.model_config.vocab_size, engine.max_model_len, num_requests)
    where = f"seed {seed}, engine {cfg}"
    driver = Driver(llm, planned, reference, where)
    driver.run()
    check(llm, planned, driver.outcomes, reference, where)
    return dict(cfg=cfg, steps=driver.step_no, preemptions=engine.scheduler.num_preemptions,
                hit_tokens=engine.kv.num_hit_tokens, aborted=sum(o.aborted for o in driver.outcomes.values()))


def check(llm: LLM, planned: list[Planned], outcomes: dict[int, Outcome], reference: Reference, where: str) -> None:
    engine = llm.engine
    for p in planned:
        o = outcomes[p.key]
        solo = p.expected(reference)
        got, want = o.tokens, solo.tokens
        if o.aborted:
            assert len(got) <= len(want), f"{where}: aborted {p.key} ran on"
            want = want[:len(got)]
        else:
            assert o.finished is not None, f"{where}: {p.key} never finished"
        diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diverged is not None and solo.gaps[diverged] is not None and solo.gaps[diverged] < TIE:
            continue   # a near-tie: the batch's arithmetic may pick the other token
        assert got == want, (f"{where}: {p.key} ({p.kind}, prompt of {len(p.prompt)}, {p.sampling}) gave {got}, "
                             f"alone {want}")
        if not o.aborted and solo.reason is not None:
            assert o.finished == solo.reason, f"{where}: {p.key} finished with {o.finished}, alone {solo.reason}"
        assert 0 <= o.cached <= len(p.prompt), f"{where}: {p.key} reports {o.cached} cached tokens"
        # A reservation given its first token has its prompt's logprobs from where that token was made.
        if got and solo.prompt_logprobs is not None and not (p.kind == "reserve" and p.first_token):
            assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(solo.prompt_logprobs), \
                f"{where}: {p.key} gave prompt logprobs {o.prompt_logprobs}, alone {solo.prompt_logprobs}"
            for (a, _, _), (b, _, _) in zip(o.prompt_logprobs, solo.prompt_logprobs):
                assert abs(a - b) < 1e-3, f"{where}: {p.key} prompt logprobs differ from its run alone"
    kv = engine.kv
    assert 0 <= kv.num_hit_tokens <= kv.num_queried_tokens
    if not engine.cfg.enable_prefix_caching:
        assert kv.num_hit_tokens == kv.num_queried_tokens == 0
    pool = kv.pool
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h, f"{where}: cache map and block {b} disagree"
    assert not engine.scheduler.requests and not kv.req_blocks, f"{where}: state left behind"
    assert_all_blocks_free(llm)


if __name__ == "__main__":
    import sys
    import tempfile
    import traceback

    from pdd.model.make_model import make_model

    first, count = int(sys.argv[1]), int(sys.argv[2])
    model = str(make_model(tempfile.mkdtemp(), preset="tiny", arch="llama"))
    ref = Reference(model)
    failures = 0
    for s in range(first, first + count):
        try:
            summary = run(model, s, ref)
            print(s, "ok", summary["steps"], summary["preemptions"], summary["hit_tokens"], summary["aborted"],
                  flush=True)
        except Exception:
            failures += 1
            print(s, "FAIL", flush=True)
            traceback.print_exc()
    print("failures", failures)
