"""Seeded prompt sets for `pdd bench serve`: what each request asks for.

    random         prompts of --input-len tokens, --output-len tokens out
    mixed          a long-tailed mix: most prompts of --input-len, a --long-fraction of
                   --long-input-len (defaults 90% 256-2048, 10% 8k-16k; 256 out)
    shared-prefix  one of --num-prefixes common prefixes of --prefix-len tokens, then a
                   distinct suffix of --input-len (a system prompt for chat)
    multi-turn     conversations of --turns user turns; each later turn resends the
                   history with the previous answers (text prompts or chat only)

Lengths are ranges MIN:MAX, drawn uniformly. A workload depends on its config
alone (the seed included), never on the request rate or the server.
Prompts are token ids (what pdd and vLLM accept as `prompt`; exact lengths) or
text made of corpus words (one word per nominal token; the server's `usage`
gives the real count).
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "mixed", "shared-prefix", "multi-turn")

# Lengths each dataset uses when the command line names none: for mixed, the
# workload of the docs/benchmarks.md sweeps; vLLM's random-dataset defaults
# (1024 in, 128 out) otherwise.
DEFAULT_LENGTHS = {
    "random": {"input_len": (1024, 1024), "output_len": (128, 128)},
    "mixed": {"input_len": (256, 2048), "output_len": (256, 256)},
    "shared-prefix": {"input_len": (128, 128), "output_len": (128, 128)},
    "multi-turn": {"input_len": (128, 128), "output_len": (128, 128)},
}

Content = list[int] | str


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    num_prompts: int = 100              # items: requests, or conversations for multi-turn
    input_len: tuple[int, int] | None = None   # None: the dataset's default
    output_len: tuple[int, int] | None = None
    long_input_len: tuple[int, int] = (8192, 16384)
    long_fraction: float = 0.1
    prefix_len: int = 1024
    num_prefixes: int = 1
    turns: int = 4
    prompt_format: str = "ids"          # ids | text
    token_id_range: tuple[int, int] = (10, 1000)   # [lo, hi): below any tiny model's special ids
    seed: int = 0

    def lengths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        d = DEFAULT_LENGTHS[self.dataset]
        return self.input_len or d["input_len"], self.output_len or d["output_len"]


@dataclass(frozen=True)
class Turn:
    content: Content        # what the user sends this turn (after any prefix and history)
    input_len: int          # its nominal length in tokens
    output_len: int         # max_tokens


@dataclass(frozen=True)
class Item:
    """What one arrival starts: one request, or a conversation's turns in order."""
    turns: tuple[Turn, ...]
    prefix: Content | None = None   # shared-prefix: sent before the first turn (chat: as the system prompt)
    prefix_len: int = 0


def build_workload(cfg: WorkloadConfig) -> list[Item]:
    """The items of `cfg`, the same for the same config."""
    _check(cfg)
    rng = random.Random(f"workload:{cfg.seed}")
    make = functools.partial(_content, rng, cfg)
    (ilo, ihi), (olo, ohi) = cfg.lengths()

    def turn(lo: int, hi: int) -> Turn:
        n = rng.randint(lo, hi)
        return Turn(make(n), n, rng.randint(olo, ohi))

    if cfg.dataset == "random":
        return [Item((turn(ilo, ihi),)) for _ in range(cfg.num_prompts)]
    if cfg.dataset == "mixed":
        llo, lhi = cfg.long_input_len
        return [Item((turn(llo, lhi) if rng.random() < cfg.long_fraction else turn(ilo, ihi),))
                for _ in range(cfg.num_prompts)]
    if cfg.dataset == "shared-prefix":
        prefixes = [make(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
        return [Item((turn(ilo, ihi),), prefix=prefixes[rng.randrange(cfg.num_prefixes)],
                     prefix_len=cfg.prefix_len)
                for _ in range(cfg.num_prompts)]
    return [Item(tuple(turn(ilo, ihi) for _ in range(cfg.turns))) for _ in range(cfg.num_prompts)]


def warmup_config(cfg: WorkloadConfig, n: int) -> WorkloadConfig:
    """n items like `cfg`'s but of another seed: warm-up prompts that share no cache with the measured ones."""
    return dataclasses.replace(cfg, num_prompts=n, seed=cfg.seed + 7919)


def _check(cfg: WorkloadConfig) -> None:
    if cfg.dataset not in DATASETS:
        raise ValueError(f"--dataset {cfg.dataset!r}: choose from {', '.join(DATASETS)}")
    if cfg.prompt_format not in ("ids", "text"):
        raise ValueError(f"--prompt-format {cfg.prompt_format!r}: choose ids or text")
    if cfg.dataset == "multi-turn" and cfg.prompt_format == "ids":
        # The stream returns the answer as text only: its ids cannot be resent.
        raise ValueError("multi-turn resends the previous answers, which come back as text: use --prompt-format text")
    ranges = {"--input-len": cfg.lengths()[0], "--output-len": cfg.lengths()[1],
              "--long-input-len": cfg.long_input_len, "--token-id-range": cfg.token_id_range}
    for flag, (lo, hi) in ranges.items():
        if lo < 1 or hi < lo:
            raise ValueError(f"{flag} {lo}:{hi}: want 1 <= MIN <= MAX")
    if cfg.token_id_range[1] - cfg.token_id_range[0] < 1:
        raise ValueError("--token-id-range: empty")
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"--long-fraction {cfg.long_fraction}: want 0..1")
    if cfg.num_prompts < 1 or cfg.turns < 1 or cfg.num_prefixes < 1 or cfg.prefix_len < 1:
        raise ValueError("--num-prompts, --turns, --num-prefixes and --prefix-len must be >= 1")


def _content(rng: random.Random, cfg: WorkloadConfig, n: int) -> Content:
    if cfg.prompt_format == "ids":
        lo, hi = cfg.token_id_range
        return [rng.randrange(lo, hi) for _ in range(n)]
    words = _words()
    return " ".join(rng.choice(words) for _ in range(n))


@functools.cache
def _words() -> tuple[str, ...]:
    """Distinct lower-case words of the built-in tokenizer's corpus: plain English, about a token each."""
    text = (Path(__file__).parent.parent / "model" / "corpus.txt").read_text()
    return tuple(sorted(set(re.findall(r"[a-z]+", text.lower()))))
