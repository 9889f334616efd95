"""The choices of one OpenAI request (n per prompt; a completions request
may give a list of prompts), as a handler streams or gathers them: each is a
request at the router with its own text stream and logprobs; their pieces are
merged in the order they come, each carrying its choice's index. The usage
counts each prompt once and every choice's tokens.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdd.http import responses as r
from pdd.http.text_stream import TextStream
from pdd.router.requests import RequestState


@dataclass
class Choice:
    index: int
    state: RequestState
    text: TextStream
    logprobs: r.LogprobsBuilder | None
    # Completions with echo: the prompt's text, shown before the generated text
    # (None: no echo), and the prompt's token ids its logprobs cover.
    echo_text: str | None = None
    finish_reason: str | None = None
    echoed: bool = False    # its echo went out (with its first event)
    ended: bool = False     # its last piece is made

    @property
    def echo_chars(self) -> int:
        return len(self.echo_text or "")

    @property
    def full_text(self) -> str:
        return (self.echo_text or "") + self.text.text


def usage(groups: list[list[Choice]], echo_only: bool = False) -> dict:
    """groups: each prompt's choices. Each prompt once (as OpenAI for n > 1);
    the tokens every choice's answer is made of (none when only the prompt is
    echoed); as cached, per prompt what the choice that found most of it cached
    found (the later choices reuse the first one's blocks)."""
    prompt = sum(len(group[0].state.prompt_token_ids) for group in groups)
    completion = 0 if echo_only else sum(c.text.num_tokens for group in groups for c in group)
    cached = sum(max(c.state.num_cached_tokens for c in group) for group in groups)
    return r.usage(prompt, completion, cached)


async def merged(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(source index, item) from several async iterators, as their items come.
    An exception from one is raised here (after the items before it). Use it
    under contextlib.aclosing: closing it stops every source."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    # Bounded: a client that does not read stops the sources from taking their
    # requests' events, which then count against router.max_buffered_tokens.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(sources))
    done = object()

    async def pump(i: int, source: AsyncIterator) -> None:
        try:
            async for item in source:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:   # noqa: BLE001 -- handed to the consumer, which raises it
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
