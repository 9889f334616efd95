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
        assert off._generation.pool is None                      # inline: no child for a small text
        big = await off.call(len(text), "encode", text)
        chat = await off.call(len(text), "encode_chat", messages)
        child = next(iter(off._generation.pool._processes.values()))
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


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux: the kernel ends the child")
def test_the_child_does_not_outlive_a_killed_router(tiny_model):
    import subprocess
    import sys
    import time
    script = (
        "import asyncio, sys, time\n"
        "from pdd.http.tokenize import OffLoopTokenizer\n"
        "from pdd.model.tokenizer import Tokenizer\n"
        f"off = OffLoopTokenizer(Tokenizer({str(tiny_model)!r}))\n"
        "text = 'x ' * 20000\n"
        "asyncio.run(off.call(len(text), 'encode', text))\n"
        "print(next(iter(off._generation.pool._processes)), flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
    finally:
        parent.kill()
        parent.wait()

    def gone() -> bool:
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    deadline = time.monotonic() + 60
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(), "the tokenizer child outlived its parent"
