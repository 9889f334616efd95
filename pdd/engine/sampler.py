"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seed,
penalties (pdd.engine.penalties), and the logprobs of given tokens (a prompt's).

Randomness is counter-based: the uniform noise for (request seed, position,
vocab index) is a fixed integer hash, computed on whatever device the logits
are on. So a request's token at a position depends only on its seed, its
position and the logits — not on batch composition, step timing, preemption,
or which worker runs it — and a request resumed elsewhere from
(prompt + first k tokens) continues exactly. The token is the Gumbel-max
choice argmax(log p - log(-log u)), which samples from p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd import ops
from pdd.engine.penalties import Penalties, apply_penalties
from pdd.engine.staging import Staging

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic for signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] positions -> [B, vocab] float32 uniforms in (0, 1)."""
    row = _mix64(seeds * _GOLDEN + _mix64(positions + 1))  # [B]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return unit_float(_mix64(row[:, None] + idx[None, :] * _GOLDEN))


def unit_float(bits: torch.Tensor) -> torch.Tensor:
    """int64 random bits -> float32 in (0, 1): the top 23 bits k as (k + 0.5) /
    2^23, exact in float32, so never 0 or 1. (From 24 bits the largest value,
    2^24 - 0.5, rounds up to 2^24: u = 1 makes the Gumbel noise +inf, a token
    masked to -inf then scores NaN, and argmax picks NaN: a token outside the
    grammar, top-k or top-p, about once in 130 rows of a 128k vocabulary.)"""
    return (_shr(bits, 41).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device."""
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor        # [B] int64; 0 = off
    top_p: torch.Tensor        # [B] float32
    min_p: torch.Tensor        # [B] float32
    seeds: torch.Tensor        # [B] int64
    positions: torch.Tensor    # [B] int64: position of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int | None   # None: no row wants logprobs

    max_top_k: int = 0         # largest top_k of the batch (a host int: no sync to find it)
    # (rows, token ids) that may not be sampled (min_tokens: the tokens that
    # would stop the request too early); None: none in this batch.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None   # None: no row has a penalty
    # (rows, token ids, biases) added to the logits (logit_bias); None: none.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [B, ceil(V / 32)] int32: the tokens each row's grammar allows, packed (bit
    # t % 32 of word t // 32; pdd.grammar); None: no row of this batch has one.
    allowed: torch.Tensor | None = None

    @classmethod
    def build(cls, params: list, positions: list[int], device: torch.device,
              staging=None, banned: list | None = None) -> "SamplingBatch":
        """staging: the runner's pdd.engine.staging.Staging (uploads without making
        the host wait for the GPU); None = a new one for `device`. banned: per
        row, token ids it may not sample (Request.stop_ids_banned_at)."""
        temps = [p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        staging = staging or Staging(device)
        ints = staging.upload([top_k, [p.seed for p in params], positions], torch.int64)
        floats = staging.upload([temps, top_p, min_p], torch.float32)
        pairs = [(row, t) for row, ids in enumerate(banned or ()) for t in ids]
        if pairs:
            banned_rows, banned_ids = staging.upload([[r for r, _ in pairs], [t for _, t in pairs]], torch.int64)
        biased = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias.items()]
        if biased:
            bias_rows, bias_ids = staging.upload([[r for r, _, _ in biased], [t for _, t, _ in biased]], torch.int64)
            (bias_values,) = staging.upload([[b for _, _, b in biased]], torch.float32)
        return cls(
            temperature=floats[0], top_k=ints[0], top_p=floats[1], min_p=floats[2], seeds=ints[1],
            positions=ints[2], all_greedy=all(x == 0.0 for x in temps), any_top_k=any(top_k),
            any_top_p=any(x < 1.0 for x in top_p), any_min_p=any(x > 0.0 for x in min_p),
            max_logprobs=max(wanted) if wanted else None, max_top_k=max(top_k),
            banned=(banned_rows, banned_ids) if pairs else None,
            bias=(bias_rows, bias_ids, bias_values) if biased else None,
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor                   # [B] int64
    logprobs: torch.Tensor | None = None   # [B] logprob of the sampled token
    top_ids: torch.Tensor | None = None    # [B, N]
    top_logprobs: torch.Tensor | None = None


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits [B, V] float32 -> one token per row. Logprobs are the model's,
    before any token is biased, banned, penalized or masked by a grammar."""
    raw = logits
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if batch.allowed is not None:
        logits = apply_allowed(logits, batch.allowed)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, logits.new_full((), float("-inf")))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    greedy = ops.argmax(logits)  # torch's argmax is a slow generic reduce on the GPU
    if batch.all_greedy:
        tokens = greedy
    else:
        tokens = torch.where(batch.temperature == 0.0, greedy, _sample_random(logits, batch))
    result = SampleResult(tokens=tokens)
    if batch.max_logprobs is not None:
        # Logprobs of the model's distribution (before temperature/top-k/top-p), as
        # the OpenAI API reports them.
        logp = torch.log_softmax(raw, dim=-1)
        result.logprobs = logp.gather(1, tokens[:, None])[:, 0]
        if batch.max_logprobs > 0:
            result.top_logprobs, result.top_ids = logp.topk(batch.max_logprobs, dim=-1)
    return result


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token the packed mask `allowed` [B, W] leaves
    out at -inf (greedy and random sampling alike then pick an allowed one)."""
    shifts = torch.arange(32, device=allowed.device, dtype=torch.int32)
    bits = (allowed[:, :, None] >> shifts) & 1          # [B, W, 32]; >> keeps the sign, & 1 the bit
    keep = bits.view(allowed.shape[0], -1)[:, :logits.shape[-1]].bool()
    return logits.masked_fill(~keep, float("-inf"))


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temp = torch.where(batch.temperature == 0.0, 1.0, batch.temperature)
    x = logits / temp[:, None]
    if batch.any_top_k:
        x = _apply_top_k(x, batch.top_k, batch.max_top_k)
    if batch.any_top_p or batch.any_min_p:
        probs = torch.softmax(x, dim=-1)
        if batch.any_min_p:
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(probs < floor, float("-inf"))
        if batch.any_top_p:
            x = _apply_top_p(x, batch.top_p)
    logp = torch.log_softmax(x, dim=-1)
    u = uniform_noise(batch.seeds, batch.positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return (logp + gumbel).argmax(dim=-1)


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    k_max = max_top_k
    kth = x.topk(min(k_max, x.shape[-1]), dim=-1).values  # [B, k_max], descending
    k = torch.where(top_k > 0, top_k, k_max).clamp(max=x.shape[-1]) - 1
    threshold = kth.gather(1, k[:, None])
    keep = (x >= threshold) | (top_k == 0)[:, None]
    return x.masked_fill(~keep, float("-inf"))


def _apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p. The
    # likeliest token always stays: a tiny top_p rounds to 0 in float32, and a
    # row with every token dropped would sample garbage.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
