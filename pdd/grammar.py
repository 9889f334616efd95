"""Constrained decoding: a request's StructuredOutput as a grammar, and the
token bitmask that keeps its output inside it (llguidance; docs/design.md says
why that library).

A reasoning model's constraint (`StructuredOutput.reasoning` names its
format) is composed with a free reasoning part before it (`grammar_for`), so
that the same matcher knows where the reasoning ended on every engine.

The router checks a spec here (`check`: a clear 400 for a bad schema or
regex, and for one that hits a limit of the parser: `LIMITS`, the same on
every engine); every engine that runs the request compiles it (`GrammarCompiler`,
once per distinct spec) and gives the request its own `Matcher`, which replays
the request's output tokens so far: a decode worker continuing after the
prefill worker's first token, or a worker taking over a migrated request,
reaches the same matcher state from the tokens alone, so the output is the
same in every layout.

The mask of a step is packed, 32 tokens per int32 word (bit t % 32 of word
t // 32 set: token t allowed), one row per sampled request; the sampler
unpacks it on the logits' device (pdd.engine.sampler). No torch here: the
router imports this module.
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdd.api import InvalidRequest, StructuredOutput
from pdd.closed_schema import closed

log = logging.getLogger(__name__)

# Tokens the router's check walks into a grammar (see `check`).
PROBE_TOKENS = 4
# Grammar compiles run this much nicer than the engine's thread (0-19, Linux).
COMPILE_NICENESS = 10


def _llg():
    import llguidance
    return llguidance


def limits():
    """The parser limits of every matcher, the router's check's and the
    engines' alike (llguidance's defaults, said here so that both sides use the
    same): a grammar that passes the check does not meet a lower one later."""
    return _llg().LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                 step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                                 verbose_errors=False)


# JSON is written with fixed separators and no other whitespace (as Python's
# json.dumps writes it): models write it that way anyway, and a grammar that
# allows free whitespace lets a weak model pad forever without ending.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


# A reasoning model's reasoning part, left free by a constraint after it
# (pdd.http.reasoning splits the same text off the answer). Each is one lazy
# lexeme: it ends at the first </think>, which the model cannot write again
# inside it. deepseek_r1's output begins inside the reasoning (the template
# opened <think>; one written again is part of it); qwen3's has it only when
# the output begins with <think>. Up to two newlines may follow the reasoning,
# as models write them, but no more: the answer must begin.
_REASONING_RULES = {
    "deepseek_r1": ['start: reasoning GAP? @answer', 'reasoning[lazy]: /(?s:.*)<\\/think>/'],
    "qwen3": ['start: (reasoning GAP?)? @answer', 'reasoning[lazy]: /\\s*<think>(?s:.*)<\\/think>/'],
}
_GAP_RULE = 'GAP: /\\n\\n?/'
# The same, for a tokenizer whose <think> and </think> are tokens of their own
# (Qwen3's, DeepSeek-R1's): llguidance takes such added tokens as special, never
# as text, so the grammar names them by id (<[id]>) around the free text.
_REASONING_TOKEN_RULES = {
    "deepseek_r1": ['start: reasoning GAP? @answer', 'reasoning: thought* <[{close}]>',
                    'thought: THOUGHT | <[{open}]>', 'THOUGHT: /(?s:.+)/'],
    "qwen3": ['start: (reasoning GAP?)? @answer', 'reasoning: SPACE? <[{open}]> THOUGHT? <[{close}]>',
              'THOUGHT: /(?s:.+)/', 'SPACE: /\\s+/'],
}
THINK_MARKS = ("<think>", "</think>")


def grammar_for(so: StructuredOutput, marks: tuple[int, int] | None = None) -> str:
    """llguidance's grammar text for a spec (after a reasoning part when
    `so.reasoning` names a format; `marks`: the ids of <think> and </think>
    where the tokenizer has them as tokens); InvalidRequest naming what is
    wrong when the spec cannot even be read (the grammar's own errors show
    when it is compiled: `check`)."""
    constraint = _constraint(so)
    if not so.reasoning:
        return constraint
    # The constraint becomes a grammar of its own, named "answer", which the
    # reasoning's Lark grammar refers to (llguidance's grammar lists).
    answer = (json.loads(constraint)["grammars"][0] if constraint.startswith("{")
              else {"lark_grammar": constraint})
    if marks is None:
        rules = "\n".join([*_REASONING_RULES[so.reasoning], _GAP_RULE])
    else:
        rules = "\n".join([r.format(open=marks[0], close=marks[1]) for r in _REASONING_TOKEN_RULES[so.reasoning]]
                          + [_GAP_RULE])
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": rules}, {**answer, "name": "answer"}]})


def _constraint(so: StructuredOutput) -> str:
    llg = _llg()
    kind, spec = so.kind, so.spec
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                raise InvalidRequest("structured_output: a JSON schema must be an object")
            # Objects closed where the schema leaves them open, as vLLM's
            # default backend does (pdd.closed_schema). The text, not the
            # parsed object: llguidance reads it without the GIL.
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)), overrides=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequest("structured_output: choice must be a non-empty array of non-empty strings")
            # One lexeme: as rule alternatives, each choice would be an item of
            # the parser's row (more than max_items_in_row fail on the first token).
            return llg.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark
            return llg.LLMatcher.grammar_from_lark(any_to_lark(spec))
    except InvalidRequest:
        raise
    except RecursionError:
        raise InvalidRequest(f"structured_output: the {kind} is nested too deep") from None
    except Exception as e:   # JSON errors, GBNF conversion errors, llguidance's ValueErrors
        raise InvalidRequest(f"structured_output: cannot read the {kind} ({e})") from None
    raise InvalidRequest(f"structured_output.kind: unknown kind {kind!r}")


def check(so: StructuredOutput) -> None:
    """InvalidRequest when the spec does not compile, or fails within its first
    PROBE_TOKENS tokens (the router's check, without the model's tokenizer).

    Most of what fails in a grammar fails only when a matcher runs: a language
    with no string in it (a cyclic $ref) at the first mask, a row of more than
    max_items_in_row items or a lexer out of fuel at the first tokens. So the
    grammar is run, on a tokenizer of the 256 bytes: each step takes the first
    byte it allows. An engine's matcher may still fail deeper in; its request
    then ends with an error (`Matcher.failed`)."""
    llg = _llg()
    grammar = grammar_for(so)
    error = llg.LLMatcher.validate_grammar(grammar, limits=limits())
    if not error:
        error = _probe(llg.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits()))
    if error:
        raise InvalidRequest(f"structured_output: invalid {so.kind}: {_first_lines(error)}")


def _probe(matcher) -> str:
    """The matcher's error within PROBE_TOKENS bytes of the start ("" if none)."""
    eos = BYTE_EOS
    for _ in range(PROBE_TOKENS):
        if matcher.is_error() or matcher.is_stopped():
            break
        mask = np.zeros(words(eos + 1), dtype=np.int32)
        _byte_executor().unsafe_compute_mask_ptr([(matcher, 0)], mask.ctypes.data, mask.nbytes, 1)
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:eos])
        if not len(allowed):
            break   # only the end may follow
        matcher.consume_token(int(allowed[0]))
    return matcher.get_error() if matcher.is_error() else ""


# The probe's vocabulary: one token per byte, then EOS.
BYTE_EOS = 256


@functools.cache
def _byte_tokenizer():
    from pdd.model.bpe import byte_alphabet, tokenizer_json
    spec = tokenizer_json({sym: i for i, sym in enumerate(byte_alphabet())}, [], {"<eos>": BYTE_EOS})
    return _llg().LLTokenizer(json.dumps(spec), eos_token=[BYTE_EOS])


@functools.cache
def _byte_executor():
    return _llg().LLExecutor(num_threads=1)


def _first_lines(text: str, limit: int = 600) -> str:
    text = text.removesuffix("\n<non-verbose/>")   # llguidance's mark for verbose_errors off
    return text if len(text) <= limit else text[:limit - 3] + "..."


def words(vocab_size: int) -> int:
    """int32 words of one mask row."""
    return (vocab_size + 31) // 32


class Matcher:
    """One request's position in its grammar, fed the request's output tokens
    (replayed from the start on any engine that takes the request over)."""

    def __init__(self, inner, compiler: "GrammarCompiler"):
        self.inner = inner
        self.compiler = compiler
        self.num_consumed = 0

    def replay(self, tokens: list[int]) -> None:
        """Consume output tokens produced before this engine had the request
        (the tail of a migrated request's prompt): `sync` counts from after them."""
        self._consume(tokens)

    def sync(self, tokens: list[int], pending: int | None = None) -> None:
        """Consume the tokens of `tokens` (the request's output so far, prefix
        of what it saw last time) not consumed yet, then `pending` (a token the
        host learned before it was appended) if not consumed yet."""
        n = len(tokens) + (pending is not None)
        if self.num_consumed >= n:
            return
        new = tokens[self.num_consumed:]
        if pending is not None:
            new = [*new, pending]
        self.num_consumed = n
        self._consume(new)

    def _consume(self, tokens: list[int]) -> None:
        # A refused token (or a limit hit on the way) leaves the matcher in
        # error for good: its request fails (`failed`).
        if tokens and not self.inner.is_error():
            self.inner.consume_tokens(tokens)

    @property
    def failed(self) -> str | None:
        """Why the matcher cannot go on (a limit of the parser hit, a token it
        refused), or None: the output so far is not known to follow the grammar."""
        if not self.inner.is_error():
            return None
        return f"structured_output: the grammar failed while decoding: {_first_lines(self.inner.get_error())}"

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete; or in error: see `failed`)."""
        return self.inner.is_stopped()


@dataclass
class Compiled:
    """A grammar compiled against the vocabulary: a pristine matcher (its first
    mask computed, so the lexer states it needs are built), copied per request."""
    pristine: object
    # Its memory: what the process's heap grew by while it compiled (llguidance
    # reports no size; its lexer states, 1-2 kB each, are most of it). What
    # other threads allocate meanwhile (another compile, a step) is charged too.
    nbytes: int


class GrammarCompiler:
    """The vocabulary of one checkpoint as llguidance sees it, the pool that
    compiles grammars against it off the engine's step, the compiled ones kept
    (LRU, up to `cache_bytes`), and the thread pool that fills a step's masks.

    Everything but `_compile` runs on the engine's thread: `start` hands out a
    compile's future, `take` turns its result into a request's matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 threads: int = 2, cache_bytes: int = 512 * 2**20):
        """vocab_size: the model's (the logits' width; the tokenizer's may be
        smaller: rows past it are padding, never allowed)."""
        llg = _llg()
        # EOS ids the tokenizer does not have (a stand-in tokenizer's) cannot be named to it.
        spec = json.loads(tokenizer_json)   # read once: a real one is megabytes
        known = _num_tokens(spec)
        eos = [t for t in eos_token_ids if t < known] or None
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=max(vocab_size, known), eos_token=eos)
        self.think_marks = _added_token_ids(spec, THINK_MARKS)
        self.vocab_size = vocab_size
        self.words = words(vocab_size)
        self.executor = llg.LLExecutor()
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._compiled: OrderedDict[tuple[str, str, str], Compiled] = OrderedDict()
        self._pending: dict[tuple[str, str, str], Future] = {}
        # llguidance drops the GIL while it compiles and computes masks: these
        # threads leave the engine's (and the event loop's) to run. They run at a
        # lower priority, so that on a host short of cores a compile waits for
        # the engine's steps rather than the steps for it.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pdd-grammar", initializer=_background)
        self.on_ready: Callable[[], None] | None = None   # called from a pool thread when a compile ends

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                       **kwargs) -> "GrammarCompiler":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise InvalidRequest("structured_output: this checkpoint has no tokenizer.json, which "
                                 "constrained decoding needs")
        try:
            return cls(path.read_text(), vocab_size, eos_token_ids, **kwargs)
        except (ValueError, OSError) as e:   # a tokenizer llguidance cannot read (e.g. not byte-level BPE)
            raise InvalidRequest(f"structured_output: constrained decoding cannot use this checkpoint's "
                                 f"tokenizer ({e})") from None

    def start(self, so: StructuredOutput) -> Future:
        """The compile of `so` (a Future of Compiled; InvalidRequest if it does
        not compile): done already when cached, shared while one runs."""
        key = (so.kind, so.spec, so.reasoning)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            done: Future = Future()
            done.set_result(hit)
            return done
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = self._pool.submit(self._compile, so)
            future.add_done_callback(self._ended)
        return future

    def take(self, future: Future) -> Matcher:
        """A fresh matcher from a compile `start` gave (done); InvalidRequest if
        it failed. Keeps what it compiled."""
        compiled = future.result()
        self.poll()
        return Matcher(compiled.pristine.deep_copy(), self)

    def matcher(self, so: StructuredOutput) -> Matcher:
        """A fresh matcher for the spec, compiled in the calling thread if not
        cached (benchmarks, tests); InvalidRequest if it does not compile."""
        key = (so.kind, so.spec, so.reasoning)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(so)
            self._keep(key, compiled)
        else:
            self._compiled.move_to_end(key)
        return Matcher(compiled.pristine.deep_copy(), self)

    def poll(self) -> None:
        """Keep the compiles that ended (LRU, within cache_bytes), those no
        request took too (one that ran past its request's deadline)."""
        for key, future in list(self._pending.items()):
            if future.done():
                del self._pending[key]
                if future.exception() is None:
                    self._keep(key, future.result())

    def _keep(self, key: tuple[str, str, str], compiled: Compiled) -> None:
        if key in self._compiled or compiled.nbytes > self.cache_bytes:
            return   # one larger than the whole cache serves its own requests only
        self._compiled[key] = compiled
        self.cached_bytes += compiled.nbytes
        while self.cached_bytes > self.cache_bytes:
            _, old = self._compiled.popitem(last=False)
            self.cached_bytes -= old.nbytes

    def flush(self) -> int:
        """Forget every compiled grammar (requests keep their matchers); how many there were."""
        n = len(self._compiled)
        self._compiled.clear()
        self.cached_bytes = 0
        return n

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def _compile(self, so: StructuredOutput) -> Compiled:
        """(A pool thread.) The grammar and its first mask: the costly part
        (the lexer's states over the vocabulary), never in an engine step."""
        before = _heap_bytes()
        grammar = grammar_for(so, self.think_marks)
        pristine = _llg().LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        if not pristine.is_error():
            mask = np.empty(self.words, dtype=np.int32)
            self.executor.unsafe_compute_mask_ptr([(pristine, 0)], mask.ctypes.data, mask.nbytes, 1)
        if pristine.is_error():
            raise InvalidRequest(f"structured_output: invalid {so.kind}: {_first_lines(pristine.get_error())}")
        return Compiled(pristine, max(_heap_bytes() - before, len(grammar)))

    def _ended(self, _future: Future) -> None:
        if self.on_ready is not None:
            self.on_ready()


def _background() -> None:
    """This thread, niced (Linux: a thread's own priority; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):
        pass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2 (2.33+), or None."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    fn.restype = _MallInfo2
    return fn


def _heap_bytes() -> int:
    """Bytes the process has allocated and not freed (glibc's count; llguidance
    allocates through malloc), else its resident set. The resident set is the
    poorer measure: memory freed by an evicted grammar is reused by the next
    one, which then shows no growth."""
    info = _mallinfo2()
    if info is not None:
        m = info()
        return m.uordblks + m.hblkhd
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _added_token_ids(spec: dict, contents: tuple[str, ...]) -> tuple[int, ...] | None:
    """The ids of these added tokens of a tokenizer.json document, in order, if it has every one; else None."""
    ids = {t.get("content"): t.get("id") for t in spec.get("added_tokens") or []}
    found = tuple(ids.get(c) for c in contents)
    return found if all(isinstance(i, int) for i in found) else None


def _num_tokens(spec: dict) -> int:
    """The ids a tokenizer.json document defines: its model's vocabulary and added tokens."""
    vocab = spec.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in spec.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def fill_masks(rows: list[tuple[Matcher, int]], num_rows: int) -> np.ndarray:
    """[num_rows, words] int32: row i holds the tokens its matcher allows for
    each (matcher, i) of `rows` (computed in parallel), every token elsewhere.
    The matchers are of one engine (one compiler)."""
    compiler = rows[0][0].compiler
    mask = np.full((num_rows, compiler.words), -1, dtype=np.int32)
    compiler.executor.unsafe_compute_mask_ptr([(m.inner, i) for m, i in rows], mask.ctypes.data,
                                              compiler.words * 4, num_rows)
    return mask
