"""A deterministic byte-level BPE tokenizer builder (trainer + tokenizer.json).

tokenizers' BpeTrainer is not used on purpose: its tie-breaking between pairs
of equal count is not guaranteed stable, and we need byte-identical
tokenizers across machines and library versions. Here ties go to the
lexicographically smallest pair and every structure is walked in sorted
order, so the merges depend only on the input text. tokenizer.json is written
field by field for the same reason (the library's own serialisation changes
between versions, e.g. the merges format).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from tokenizers import Tokenizer

Pair = tuple[str, str]

# The text pipeline is Qwen2's (NFC, Qwen split regex, then byte-level map),
# not GPT-2's ByteLevel(use_regex=True): transformers >= 5 rebuilds the
# tokenizer of every model_type "qwen2" checkpoint with this exact pipeline,
# ignoring tokenizer.json, so any other split would tokenize differently there.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NORMALIZER = {"type": "NFC"}
PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}


def byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-unicode table: entry b is the symbol for byte b.

    Printable Latin-1 bytes map to themselves; the rest (controls, space,
    ...) are shifted to code points 256+ so every symbol is a visible char.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def tokenizer_json(vocab: dict[str, int], merges: list[Pair], specials: dict[str, int],
                   texts: dict[str, int] | None = None) -> dict[str, Any]:
    """A tokenizer.json document; specials are added tokens (and in the vocab, to pin their ids);
    `texts` too, but not special: decoded as the text they stand for (a reasoning model's <think>)."""
    texts = texts or {}
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": tok in specials}
        for tok, i in {**specials, **texts}.items()
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": NORMALIZER,
        "pre_tokenizer": PRE_TOKENIZER,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {**vocab, **specials, **texts},
            # "a b" strings (not pairs) are readable by every tokenizers >= 0.19;
            # byte-level symbols never contain a literal space.
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


def pretokenize(text: str) -> Counter[str]:
    """Word counts, split exactly as the runtime tokenizer will split text."""
    # Built from the very JSON we write, so training and runtime cannot drift apart.
    alphabet = {sym: i for i, sym in enumerate(byte_alphabet())}
    probe = Tokenizer.from_str(json.dumps(tokenizer_json(alphabet, [], {})))
    normalized = probe.normalizer.normalize_str(text)
    return Counter(word for word, _ in probe.pre_tokenizer.pre_tokenize_str(normalized))


def _merge_word(symbols: list[str], pair: Pair) -> list[str]:
    """Replace non-overlapping occurrences of pair, left to right (as BPE encoding does)."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


class _PairStats:
    """Weighted pair counts over a word list, plus which words contain each pair."""

    def __init__(self, words: list[list[str]], weights: list[int]) -> None:
        self.words, self.weights = words, weights
        self.counts: Counter[Pair] = Counter()
        self.where: defaultdict[Pair, set[int]] = defaultdict(set)
        for i in range(len(words)):
            self._add(i, +1)

    def _add(self, i: int, sign: int) -> None:
        syms = self.words[i]
        for pair in zip(syms, syms[1:]):
            self.counts[pair] += sign * self.weights[i]
            if sign > 0:
                self.where[pair].add(i)
            elif self.counts[pair] == 0:
                del self.counts[pair]

    def best(self) -> Pair | None:
        """Most frequent pair; ties go to the lexicographically smallest."""
        if not self.counts:
            return None
        return min(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]

    def apply(self, pair: Pair) -> None:
        # `where` may list words that no longer hold the pair; merging is then a no-op.
        for i in sorted(self.where.pop(pair, ())):
            self._add(i, -1)
            self.words[i] = _merge_word(self.words[i], pair)
            self._add(i, +1)


def train_bpe(text: str, vocab_size: int) -> tuple[list[str], list[Pair]]:
    """Learn merges over text until the vocabulary holds vocab_size tokens.

    Returns (vocab in id order, merges in rank order). The vocabulary starts
    with the 256 byte symbols (id == byte value).
    """
    counts = pretokenize(text)
    ordered = sorted(counts)  # fixed order, independent of dict insertion
    stats = _PairStats([list(w) for w in ordered], [counts[w] for w in ordered])
    vocab = byte_alphabet()
    known = set(vocab)
    merges: list[Pair] = []
    while len(vocab) < vocab_size:
        pair = stats.best()
        if pair is None:
            raise ValueError(f"corpus too small: only {len(vocab)} tokens learnable, wanted {vocab_size}")
        merges.append(pair)
        stats.apply(pair)
        # Two merge paths can spell the same token ("ab"+"c", "a"+"bc"): keep one id.
        token = pair[0] + pair[1]
        if token not in known:
            known.add(token)
            vocab.append(token)
    return vocab, merges
