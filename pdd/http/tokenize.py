"""Tokenization that never holds the router's event loop.

Small texts are tokenized inline (microseconds). Large ones go to a child
process: the `tokenizers` library holds the GIL for most of a large encode
(measured: a 4 MB text, 6 s, stalled the event loop and every stream it relays
for 5.4 s when encoded in a thread), so a thread is not enough. The child is
started at the first large text ('spawn': the router has ZeroMQ threads that a
fork must not copy), loads the same tokenizer, and takes one text at a time.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pdd.http.validate import APIError
from pdd.lifetime import die_with_parent
from pdd.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Texts longer than this (bytes of the request body) go to the child process.
INLINE_BYTES = 16 * 1024

_child: Tokenizer | None = None


def _load(model_dir: str, router_pid: int) -> None:
    global _child
    # A router killed with -9 cannot stop its child: the kernel does; else the
    # child, and multiprocessing's resource tracker with it, would outlive it.
    die_with_parent(router_pid, signal.SIGKILL)
    _child = Tokenizer(model_dir)


def _call(method: str, arg, kwargs: dict):
    return getattr(_child, method)(arg, **kwargs)


class OffLoopTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None

    async def call(self, size: int, method: str, arg, **kwargs) -> list[int]:
        """tokenizer.<method>(arg, **kwargs) (encode, encode_chat); `size`: the body's bytes."""
        if size <= INLINE_BYTES:
            return getattr(self.tokenizer, method)(arg, **kwargs)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                             initargs=(str(self.tokenizer.model_dir), os.getpid()))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _call, method, arg, kwargs)
        except BrokenProcessPool:
            # The child died (killed, out of memory): the next large text starts another.
            log.error("the tokenizer process died; a new one starts with the next large prompt")
            self._pool = None
            raise

    async def encode_chat(self, size: int, messages: list[dict], template_args: dict) -> list[int]:
        """A conversation's tokens through the chat template; the template's errors are the client's (400)."""
        try:
            return await self.call(size, "encode_chat", messages, **template_args)
        except BrokenProcessPool:
            raise APIError(503, "the tokenizer process died; retry", type="server_error") from None
        except Exception as e:  # template errors come from Jinja as any exception type
            raise _template_error(e) from None

    def chat_text(self, messages: list[dict], template_args: dict) -> str:
        """The conversation as the chat template writes it (what encode_chat encodes)."""
        try:
            return self.tokenizer.apply_chat_template(messages, **template_args)
        except Exception as e:
            raise _template_error(e) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _template_error(e: Exception) -> APIError:
    return APIError(400, f"messages: cannot apply the chat template ({e})", param="messages")
