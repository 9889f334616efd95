"""The cost of constrained decoding, per token, at batch 1 and 64.

mask: the host's work per step for B requests under a JSON schema (an array
of small objects that never ends in the measured steps: keys, strings,
numbers, enums), with a vocabulary of a real tokenizer's size: computing the
B allowed-token bitmasks, then feeding each matcher its sampled token; for
llguidance (what pdd uses) and, if installed, xgrammar, on the same token
sequences. apply: unpacking the masks onto [B, vocab] logits on the device.
handover: what carrying a request's grammar state to another engine costs in
pdd's design, where the state is rebuilt from the tokens: a matcher from the
compiled grammar plus replaying k tokens (k = 1: a decode worker after the
prefill worker's first token; larger k: a migration).
engine (--engine, a GPU): decode step times with and without the grammar, for
the 8B shape with dummy weights; the overhead is their difference.

The vocabulary: a byte-level BPE tokenizer trained (once, cached) on the
Python standard library's sources, about 123k tokens, padded to --vocab as a
checkpoint pads its embedding: checkpoints' tokenizers cannot be downloaded
here, and pdd's tiny models have 1k tokens, where a mask costs nothing.

    pdd bench grammar                       # CPU: mask, apply, handover
    pdd bench grammar --engine --model conf/models/llama-3.1-8b --load-format dummy
"""
from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np

ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "maxLength": 24},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "score": {"type": "number"}},
        "required": ["name", "age", "email", "role", "score"], "additionalProperties": False}
# 1000 items (>= 20k tokens) outlast every measured request; far larger minimums
# make the grammar itself too large for llguidance's parser limits (ParserTooComplex).
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}
EOS = "<|end|>"


def bench_tokenizer(cache: Path) -> Path:
    """tokenizer.json of a byte-level BPE trained on the standard library (cached)."""
    path = cache / "tokenizer.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=128000, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train_from_iterator((p.read_bytes().decode("utf-8", "replace") for p in files), trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"tokenizer.json.{os.getpid()}"
    tok.save(str(tmp))
    os.replace(tmp, path)
    print(f"trained a {tok.get_vocab_size()}-token tokenizer on {len(files)} files in "
          f"{time.perf_counter() - t0:.0f} s: {path}")
    return path


def _sequences(compiler, so, batch: int, steps: int, xgr_compiled=None) -> list[list[int]]:
    """One token sequence per row: random tokens that the grammar allows (in
    both libraries when xgrammar is there: their JSON grammars differ in
    details, e.g. which escapes a string may hold)."""
    from pdd.grammar import fill_masks

    rng = random.Random(0)
    matchers = [compiler.matcher(so) for _ in range(batch)]
    seqs = [[] for _ in range(batch)]
    other = None
    if xgr_compiled is not None:
        import torch
        import xgrammar as xgr
        other = [xgr.GrammarMatcher(xgr_compiled) for _ in range(batch)]
        other_mask = torch.zeros(batch, compiler.words, dtype=torch.int32)
    for _ in range(steps):
        mask = fill_masks([(m, i) for i, m in enumerate(matchers)], batch)
        if other is not None:
            for i, m in enumerate(other):
                m.fill_next_token_bitmask(other_mask, i)
            mask &= other_mask.numpy()
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        for i, m in enumerate(matchers):
            allowed = np.flatnonzero(bits[i])
            token = int(allowed[rng.randrange(len(allowed))])
            m.sync(seqs[i] + [token])
            if other is not None:
                other[i].accept_token(token)
            seqs[i].append(token)
    return seqs


def _llguidance(compiler, so, seqs) -> dict:
    from pdd.grammar import fill_masks

    t0 = time.perf_counter()
    compiler._compiled.clear()
    compiler.matcher(so)
    compile_s = time.perf_counter() - t0
    matchers = [compiler.matcher(so) for _ in seqs]
    fill, feed = [], []
    for step in range(len(seqs[0])):
        t0 = time.perf_counter()
        fill_masks([(m, i) for i, m in enumerate(matchers)], len(seqs))
        t1 = time.perf_counter()
        for m, seq in zip(matchers, seqs):
            m.sync(seq[:step + 1])
        fill.append(t1 - t0)
        feed.append(time.perf_counter() - t1)
    return {"compile_ms": 1e3 * compile_s, **_per_step(fill, feed, len(seqs))}


def _xgrammar_compile(tokenizer_path: Path, vocab: int, eos: int):
    """(compiled JSON schema, seconds it took) with xgrammar; None if not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    encoded = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    return compiled, time.perf_counter() - t0


def _xgrammar(xgr_compiled, seqs) -> dict | None:
    if xgr_compiled is None:
        return None
    import xgrammar as xgr

    compiled, compile_s = xgr_compiled
    vocab = compiled.tokenizer_info.vocab_size
    matchers = [xgr.GrammarMatcher(compiled) for _ in seqs]
    batch = xgr.BatchGrammarMatcher()
    mask = xgr.allocate_token_bitmask(len(seqs), vocab)
    fill, feed = [], []
    for step in range(len(seqs[0])):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        t1 = time.perf_counter()
        for m, seq in zip(matchers, seqs):
            if not m.accept_token(seq[step]):
                return {"error": f"xgrammar refused a token llguidance allowed at step {step}"}
        fill.append(t1 - t0)
        feed.append(time.perf_counter() - t1)
    return {"compile_ms": 1e3 * compile_s, **_per_step(fill, feed, len(seqs))}


def _per_step(fill: list[float], feed: list[float], batch: int) -> dict:
    """Per step: the median and the mean (a grammar state met for the first
    time costs more: the mean is what a request pays over its tokens)."""
    f, c = statistics.mean(fill), statistics.mean(feed)
    return {"fill_ms": 1e3 * statistics.median(fill), "fill_mean_ms": 1e3 * f,
            "fill_p90_ms": 1e3 * statistics.quantiles(fill, n=10)[-1], "feed_mean_ms": 1e3 * c,
            "per_token_us": 1e6 * (f + c) / batch}


def _apply(batch: int, vocab: int, device: str, reps: int = 50) -> float:
    import torch

    from pdd.engine.sampler import apply_allowed
    logits = torch.randn(batch, vocab, device=device)
    allowed = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, device=device)
    apply_allowed(logits, allowed)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_allowed(logits, allowed)
    sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def _handover(compiler, so, seq: list[int]) -> dict:
    out = {}
    for k in [k for k in (1, 128, 1024) if k <= len(seq)]:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            compiler.matcher(so).replay(seq[:k])
            times.append(time.perf_counter() - t0)
        out[f"replay_{k}_ms"] = 1e3 * statistics.median(times)
    return out


def _engine(args, model_dir: Path, max_batch: int):
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format=args.load_format, device=args.device,
                                    num_blocks=args.num_blocks, max_num_seqs=max(64, max_batch), max_model_len=8192,
                                    enable_prefix_caching=False))
    if engine.device.type == "cuda":
        engine.warm_up()   # kernels compiled now, not in the first measured steps
    return engine


def _engine_steps(args, engine, batch: int, so) -> dict:
    """Median decode step time (ms) of `batch` requests, and the host time of
    the masks per step when `so` constrains them."""
    import torch

    import pdd.grammar
    from pdd.api import SamplingParams
    from pdd.bench.gpu import _timed_steps

    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"b{batch}-{so is not None}-{i}",
                           torch.randint(0, 30000, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=args.steps + 200, temperature=1.0, seed=i, ignore_eos=True,
                                          structured_output=so))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    live = [r for r in engine.scheduler.requests.values() if not r.status.finished]
    assert len(live) == batch, f"{batch - len(live)} of {batch} requests ended during their prefill"
    mask_s = []
    original = pdd.grammar.fill_masks

    def timed(*a):   # the masks' computation alone (the runner also waits there for the step before)
        t0 = time.perf_counter()
        try:
            return original(*a)
        finally:
            mask_s.append(time.perf_counter() - t0)
    pdd.grammar.fill_masks = timed
    try:
        times = _timed_steps(engine, args.steps)
    finally:
        pdd.grammar.fill_masks = original
    assert not any(r.status.finished for r in engine.scheduler.requests.values()), "a request ended early"
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    engine.wait_in_flight()
    return {"step_ms": 1e3 * statistics.median(times),
            "mask_host_ms": 1e3 * statistics.median(mask_s) if mask_s else 0.0}


def main(args) -> int:
    from pdd.api import StructuredOutput
    from pdd.grammar import GrammarCompiler

    cache = Path(os.environ.get("PDD_CACHE", "~/.cache/pdd")).expanduser() / "bench-grammar"
    tok_path = Path(args.tokenizer) if args.tokenizer else bench_tokenizer(cache)
    tokenizer_json = tok_path.read_text()
    from tokenizers import Tokenizer
    real_vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    eos = Tokenizer.from_file(str(tok_path)).token_to_id(EOS) or 0
    compiler = GrammarCompiler(tokenizer_json, args.vocab, (eos,))
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    batches = [int(b) for b in args.batches.split(",")]
    report = {"tokenizer_tokens": real_vocab, "vocab": args.vocab, "cpus": os.cpu_count(), "mask": {},
              "apply_ms": {}, "handover": {}, "engine": {}}
    xgr_compiled = _xgrammar_compile(tok_path, args.vocab, eos)
    seqs = _sequences(compiler, so, max(batches), args.tokens, xgr_compiled and xgr_compiled[0])
    print(f"vocabulary {real_vocab} tokens (padded to {args.vocab}); {os.cpu_count()} CPUs; "
          f"{args.tokens} tokens per request")
    for b in batches:
        rows = {"llguidance": _llguidance(compiler, so, seqs[:b]),
                "xgrammar": _xgrammar(xgr_compiled, seqs[:b])}
        report["mask"][b] = rows
        for lib, r in rows.items():
            if r is None:
                print(f"mask  batch {b:3d}  {lib:10s}  not installed")
            elif "error" in r:
                print(f"mask  batch {b:3d}  {lib:10s}  {r['error']}")
            else:
                print(f"mask  batch {b:3d}  {lib:10s}  fill median {r['fill_ms']:7.3f} ms, mean "
                      f"{r['fill_mean_ms']:7.3f} (p90 {r['fill_p90_ms']:.3f})  feed {r['feed_mean_ms']:6.3f} ms  "
                      f"= {r['per_token_us']:7.1f} us/token  (compile {r['compile_ms']:.0f} ms)")
        report["apply_ms"][b] = _apply(b, args.vocab, args.apply_device)
        print(f"apply batch {b:3d}  {args.apply_device}: {report['apply_ms'][b]:.3f} ms")
    report["handover"] = _handover(compiler, so, seqs[0])
    print("handover (matcher from the compiled grammar + replay): " +
          ", ".join(f"{k} {v:.3f}" for k, v in report["handover"].items()))
    if args.engine:
        model_dir = Path(args.workdir or cache / "model")
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        shutil.copy(Path(args.model) / "config.json", model_dir / "config.json")
        shutil.copy(tok_path, model_dir / "tokenizer.json")
        engine = _engine(args, model_dir, max(batches))
        for b in batches:
            free, guided = _engine_steps(args, engine, b, None), _engine_steps(args, engine, b, so)
            overhead = guided["step_ms"] / free["step_ms"] - 1
            report["engine"][b] = {"free_step_ms": free["step_ms"], "guided_step_ms": guided["step_ms"],
                                   "mask_host_ms": guided["mask_host_ms"], "overhead": overhead}
            print(f"engine batch {b:3d}: step {free['step_ms']:.2f} ms free, {guided['step_ms']:.2f} ms guided "
                  f"({100 * overhead:+.1f}%), mask on the host {guided['mask_host_ms']:.2f} ms/step")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
