"""Large prompts are tokenized in a child process, with the same result as inline."""
from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from pdd.http.tokenize import INLINE_BYTES, OffLoopTokenizer
from pdd.model.tokenizer import Tokenizer


def test_large_texts_go_to_a_child_process_and_come_back_the_same(tiny_model):
    tok = Tokenizer(tiny_model)
    off = OffLoopTokenizer(tok)
    text = "the quick brown fox jumps over the lazy dog. " * 2000
    messages = [{"role": "user", "content": text}]

    async def main():
        small = await off.call(100, "encode", "hello there")
        assert off._pool is None                      # inline: no child for a small text
        big = await off.call(len(text), "encode", text)
        chat = await off.call(len(text), "encode_chat", messages)
        child = next(iter(off._pool._processes.values()))
        return small, big, chat, child

    try:
        small, big, chat, child = asyncio.run(main())
        assert len(text) > INLINE_BYTES and child.pid != os.getpid()
        assert small == tok.encode("hello there")
        assert big == tok.encode(text) and chat == tok.encode_chat(messages)
        # The child dies: that call fails, the next one starts another child.
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        with pytest.raises(BrokenProcessPool):
            asyncio.run(off.call(len(text), "encode", text))
        assert asyncio.run(off.call(len(text), "encode", text)) == big
    finally:
        off.close()
