"""Tokenization that never holds the router's event loop.

Small texts are tokenized inline (microseconds). Large ones go to a child
process: the `tokenizers` library holds the GIL for most of a large encode
(measured: a 4 MB text, 6 s, stalled the event loop and every stream it relays
for 5.4 s when encoded in a thread), so a thread is not enough. A child is
started at the first large text of its lane ('spawn': the router has ZeroMQ
threads that a fork must not copy), loads the same tokenizer, and takes one
text at a time.

Two lanes, each its own child: generation (chat and completions prompts) and
utility (/tokenize, /detokenize). A /tokenize of 4 MB takes its child seconds;
in a lane of its own it never queues a chat request behind it. The utility
lane takes UTILITY_IN_FLIGHT large texts at once (one running, the others
waiting); past that a large utility call is refused at once (429 with
Retry-After), not queued: a flood of them costs their child's time only.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pdd.http.validate import APIError
from pdd.lifetime import die_with_parent
from pdd.model.tokenizer import Tokenizer
from pdd.router.inflight import Overloaded

log = logging.getLogger(__name__)

# Texts longer than this (bytes of the request body) go to a child process.
INLINE_BYTES = 16 * 1024
# Large /tokenize and /detokenize calls at once (running or waiting for the utility child).
UTILITY_IN_FLIGHT = 2

_child: Tokenizer | None = None


def _load(model_dir: str, router_pid: int) -> None:
    global _child
    # A router killed with -9 cannot stop its child: the kernel does; else the
    # child, and multiprocessing's resource tracker with it, would outlive it.
    die_with_parent(router_pid, signal.SIGKILL)
    _child = Tokenizer(model_dir)


def _apply(fn: Callable, args: tuple):
    return fn(_child, *args)


def _method(tokenizer: Tokenizer, method: str, arg, kwargs: dict):
    return getattr(tokenizer, method)(arg, **kwargs)


def tokenize(tokenizer: Tokenizer, text: str | None, messages: list[dict] | None, template_args: dict | None,
             add_special_tokens: bool, token_strs: bool) -> tuple[list[int], list[str] | None]:
    """/tokenize's work, wherever it runs: a text's tokens, or a conversation's
    through the chat template (exactly a chat completion's without added
    special tokens); with `token_strs`, each token's vocabulary string."""
    if messages is None:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    elif not add_special_tokens:
        ids = tokenizer.encode_chat(messages, **template_args)
    else:
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, **template_args), add_special_tokens=True)
    return ids, ([tokenizer.id_to_token(t) for t in ids] if token_strs else None)


class _Lane:
    """One child process, started at its first call, started again after it died."""

    def __init__(self, name: str, tokenizer: Tokenizer):
        self.name = name
        self.tokenizer = tokenizer
        self.pool: ProcessPoolExecutor | None = None
        self.in_flight = 0

    async def run(self, fn: Callable, *args):
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                            initargs=(str(self.tokenizer.model_dir), os.getpid()))
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, _apply, fn, args)
        except BrokenProcessPool:
            # The child died (killed, out of memory): the next large text starts another.
            log.error("the %s tokenizer process died; a new one starts with the next large text", self.name)
            self.pool = None
            raise
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


class OffLoopTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._generation = _Lane("generation", tokenizer)
        self._utility = _Lane("utility", tokenizer)

    async def call(self, size: int, method: str, arg, **kwargs) -> list[int]:
        """tokenizer.<method>(arg, **kwargs) (encode, encode_chat) for a prompt; `size`: the body's bytes."""
        if size <= INLINE_BYTES:
            return getattr(self.tokenizer, method)(arg, **kwargs)
        return await self._generation.run(_method, method, arg, kwargs)

    async def utility(self, size: int, fn: Callable, *args):
        """fn(tokenizer, *args) for /tokenize or /detokenize; `size`: the body's bytes.
        Overloaded (429) when UTILITY_IN_FLIGHT large ones are already in its lane;
        APIError 503 when its child died."""
        if size <= INLINE_BYTES:
            return fn(self.tokenizer, *args)
        if self._utility.in_flight >= UTILITY_IN_FLIGHT:
            raise Overloaded(f"{UTILITY_IN_FLIGHT} large /tokenize or /detokenize requests are in progress; "
                             "retry later", retry_after_s=1)
        try:
            return await self._utility.run(fn, *args)
        except BrokenProcessPool:
            raise APIError(503, "the tokenizer process died; retry", type="server_error") from None

    async def encode_chat(self, size: int, messages: list[dict], template_args: dict) -> list[int]:
        """A conversation's tokens through the chat template; the template's errors are the client's (400)."""
        try:
            return await self.call(size, "encode_chat", messages, **template_args)
        except BrokenProcessPool:
            raise APIError(503, "the tokenizer process died; retry", type="server_error") from None
        except Exception as e:  # template errors come from Jinja as any exception type
            raise template_error(e) from None

    def close(self) -> None:
        self._generation.close()
        self._utility.close()


def template_error(e: Exception) -> APIError:
    return APIError(400, f"messages: cannot apply the chat template ({e})", param="messages")
