"""The requests of an engine that wait for their grammars.

A request with a structured output is held, not scheduled, while its grammar
compiles in pdd.grammar.GrammarCompiler's pool (off the step: a heavy regex
takes seconds). Between two steps the engine asks `settle` what became of the
compiles: each that ended gives its request a matcher, and from then on the
request is scheduled; one that failed, or ran past
engine.grammar_compile_timeout_s, fails its request — the request's own fault
(a 400 to its client), never the server's.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdd.api import InvalidRequest
from pdd.engine.request import Request

if TYPE_CHECKING:
    from pdd.grammar import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class _Compile:
    """A request's grammar being compiled (GrammarCompiler.start)."""
    request: Request
    future: futures.Future
    deadline: float   # time.monotonic()


class GrammarJobs:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int,
                 cache_bytes: int, timeout_s: float):
        """The vocabulary for constrained decoding is built now (about a second
        for 128k tokens, holding the GIL): never on a first structured request
        in service."""
        from pdd.grammar import GrammarCompiler
        self.timeout_s = timeout_s
        self.compiler: GrammarCompiler | None = None
        self.unavailable = ""   # why there is no compiler
        try:
            self.compiler = GrammarCompiler.for_checkpoint(model_dir, vocab_size, eos_token_ids, threads=threads,
                                                           cache_bytes=cache_bytes)
        except InvalidRequest as e:
            self.unavailable = str(e)
            if (model_dir / "tokenizer.json").is_file():
                log.warning("structured outputs unavailable: %s", e)
        self._pending: dict[str, _Compile] = {}   # request id -> its compile

    def start(self, req: Request) -> None:
        """Compile `req`'s grammar; it waits (awaiting_grammar) until `settle`
        gives it its matcher. InvalidRequest naming structured_output where the
        checkpoint allows no grammar."""
        if self.compiler is None:
            raise InvalidRequest(self.unavailable)
        future = self.compiler.start(req.sampling.structured_output)
        req.awaiting_grammar = True
        self._pending[req.request_id] = _Compile(req, future, time.monotonic() + self.timeout_s)

    def settle(self, held: Callable[[Request], bool]) -> Iterator[tuple[Request, str | None]]:
        """(request, None) for each whose compile ended and who now has its matcher;
        (request, why) for each whose compile failed or outran its budget. A
        request no longer `held` (aborted) is dropped without a word."""
        now = time.monotonic()
        for rid, c in list(self._pending.items()):
            req = c.request
            if not held(req):
                del self._pending[rid]
            elif c.future.done():
                del self._pending[rid]
                try:
                    req.grammar = self.compiler.take(c.future)
                except InvalidRequest as e:
                    yield req, str(e)
                    continue
                req.awaiting_grammar = False
                if req.num_prior_output_tokens:   # a migrated request: its output so far is the prompt's tail
                    req.grammar.replay(req.prompt_token_ids[-req.num_prior_output_tokens:])
                yield req, None
            elif now >= c.deadline:
                del self._pending[rid]
                yield req, (f"structured_output: the grammar did not compile within "
                            f"engine.grammar_compile_timeout_s ({self.timeout_s:g} s)")

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Block until a pending compile ends, at most timeout_s."""
        futures.wait([c.future for c in self._pending.values()], timeout_s, futures.FIRST_COMPLETED)

    def flush(self) -> int:
        """Forget the compiled grammars (cache flush); how many there were."""
        return self.compiler.flush() if self.compiler is not None else 0
