"""Token ids -> text deltas for one request, with stop strings.

Used wherever text leaves pdd (router, offline API). Text that could still be
the beginning of a stop string is held back until it cannot be, so a stop
string never reaches the client even when it spans several tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

from pdd.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.text = ""          # everything released so far
        self.stopped_on: str | None = None

    def add(self, token_ids: list[int]) -> str:
        """New tokens -> text safe to release now ('' if none)."""
        if self.stopped_on is not None:
            return ""
        self.pending += self.detok.add(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: release what is left."""
        if self.stopped_on is not None:
            return ""
        self.pending += self.detok.flush()
        return self._release(final=True)

    @property
    def stopped(self) -> bool:
        return self.stopped_on is not None

    def _release(self, final: bool) -> str:
        if not self.stop:   # the common case, once per token: nothing to look for or hold back
            out, self.pending = self.pending, ""
            self.text += out
            return out
        hit = min(((self.pending.find(s), s) for s in self.stop if s in self.pending), default=None)
        if hit is not None:
            idx, self.stopped_on = hit
            out, self.pending = self.pending[:idx], ""
        elif final:
            out, self.pending = self.pending, ""
        else:
            cut = len(self.pending) - self.hold
            if cut <= 0:
                return ""
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out
