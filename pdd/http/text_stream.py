"""Token ids -> text deltas for one request, with stop strings.

Used wherever text leaves pdd (router, offline API). Text that could still be
the beginning of a stop string is held back until it cannot be, so a stop
string never reaches the client even when it spans several tokens.

As in vLLM: neither a stop string nor the token that ended generation (EOS
or one of `stop_token_ids`: `stop_token_ids` here holds both) is part of the
text unless `include_stop_str` is set, and neither ends it within the first
`min_tokens` tokens. Which token ended generation is known from the token
itself (the engine's rule, Request.check_stop), not from a later event: its
text is never released early, and nothing else is held back for it.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from pdd.model.tokenizer import GrowingText, IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 *, prompt_ids: Sequence[int] = (), stop_token_ids: Collection[int] = (),
                 min_tokens: int = 0, include_stop_str: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self.stop = [s for s in stop if s]
        self.stop_token_ids = frozenset(stop_token_ids)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = min_tokens
        self.include_stop_str = include_stop_str
        self.pending = ""
        self.released = GrowingText()   # everything released so far
        self.num_tokens = 0     # tokens taken in, up to the one that stopped the text
        self.stopped_on: str | int | None = None    # the stop string, or the stop token's id

    def add(self, token_ids: list[int]) -> str:
        """New tokens -> text safe to release now ('' if none)."""
        if self.stopped_on is not None:
            return ""
        if len(token_ids) == 1 and token_ids[0] not in self.stop_token_ids:   # the common case: one token
            self.num_tokens += 1
            if not self.stop and not self.pending:   # nothing to look for or hold back
                piece = self.detok.add_plain(token_ids[0])
                if piece is not None:
                    self.released.append(piece)
                    return piece
            return self._take(token_ids, final=False)
        for i, token in enumerate(token_ids):
            self.num_tokens += 1
            if token in self.stop_token_ids and self.num_tokens > self.min_tokens:
                shown = token_ids[:i + 1] if self.include_stop_str else token_ids[:i]
                out = self._take(shown, final=False)   # a stop string may end the text first
                if self.stopped_on is None:
                    out += self.finish()
                    self.stopped_on = token
                return out
        return self._take(token_ids, final=False)

    def finish(self) -> str:
        """End of generation: release what is left."""
        if self.stopped_on is not None:
            return ""
        self.pending += self.detok.flush()
        return self._release(final=True)

    def _take(self, token_ids: list[int], final: bool) -> str:
        if token_ids:
            self.pending += self.detok.add(token_ids)
        return self._release(final)

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.released.value()

    @property
    def stopped(self) -> bool:
        return self.stopped_on is not None

    @property
    def generated_chars(self) -> int:
        """Characters of text the tokens so far decode to, released or held back
        (a logprobs `text_offset`)."""
        return self.detok.released.chars

    def _release(self, final: bool) -> str:
        if not self.stop:   # the common case, once per token: nothing to look for or hold back
            out, self.pending = self.pending, ""
            self.released.append(out)
            return out
        looking = self.num_tokens > self.min_tokens
        hit = min(((self.pending.find(s), s) for s in self.stop if s in self.pending),
                  default=None) if looking else None
        if hit is not None:
            idx, self.stopped_on = hit
            end = idx + len(self.stopped_on) if self.include_stop_str else idx
            out, self.pending = self.pending[:end], ""
        elif final:
            out, self.pending = self.pending, ""
        else:
            cut = len(self.pending) - self.hold
            if cut <= 0:
                return ""
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.released.append(out)
        return out
