"""Offline engine throughput: N mixed requests submitted together (continuous
batching) vs the same requests one at a time, and optionally vs HF
transformers `generate` one at a time on the same model and device.

    pdd bench offline [--model DIR] [--num-requests 64] [--hf]

With --ttft-by-length, instead: the prompts arrive together, --long-share of
them long, and each class's time to first token is reported in engine steps
(which a noisy machine does not change) and seconds, prompts first come first
served (engine.long_prefill_token_threshold 0) vs short ones first (the
threshold given), and how many requests' outputs differ between the two.

    pdd bench offline --ttft-by-length --max-tokens 1 --long-prefill-token-threshold 4096
"""
from __future__ import annotations

import json
import platform
import random
import time

import numpy as np
import torch


def _requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mixed_queue(args, vocab: int) -> tuple[list[list[int]], list[bool]]:
    """Short and long prompts, shuffled together; which of them are long."""
    n_long = round(args.num_requests * args.long_share)
    short = _requests(args.num_requests - n_long, args.min_prompt, args.max_prompt, vocab, seed=0)
    long = _requests(n_long, args.min_long_prompt, args.max_long_prompt, vocab, seed=1)
    queue = [(p, False) for p in short] + [(p, True) for p in long]
    random.Random(2).shuffle(queue)
    return [p for p, _ in queue], [is_long for _, is_long in queue]


def _first_tokens(engine, prompts: list[list[int]], sp) -> tuple[list[int], list[float], list[list[int]]]:
    """Submit every prompt at once and step to the end: per request, the
    engine step (call) that returned its first token, the seconds until then,
    and its output."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    steps, seconds, tokens = [0] * len(prompts), [0.0] * len(prompts), [[] for _ in prompts]
    step, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        step += 1
        for o in outs:
            i = int(o.request_id)
            if o.new_token_ids and not tokens[i]:
                steps[i], seconds[i] = step, time.perf_counter() - t0
            tokens[i].extend(o.new_token_ids)
    return steps, seconds, tokens


def _class_stats(steps: list[int], seconds: list[float]) -> dict:
    if not steps:
        return {"count": 0}
    pct = lambda x, p: round(float(np.percentile(x, p)), 3)  # noqa: E731
    return {"count": len(steps), "steps_mean": round(float(np.mean(steps)), 2), "steps_p50": pct(steps, 50),
            "steps_p90": pct(steps, 90), "steps_max": max(steps), "s_mean": round(float(np.mean(seconds)), 3),
            "s_p50": pct(seconds, 50), "s_p90": pct(seconds, 90)}


def run_ttft_by_length(args) -> dict:
    from pdd.api import SamplingParams
    from pdd.engine.args import engine_kwargs
    from pdd.engine.llm import LLM

    kw = engine_kwargs(args)
    model, threshold = kw.pop("model"), kw.pop("long_prefill_token_threshold")
    if not threshold:
        raise SystemExit("--ttft-by-length compares against a threshold: give --long-prefill-token-threshold > 0")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "num_requests": args.num_requests,
                    "short_prompt": [args.min_prompt, args.max_prompt],
                    "long_prompt": [args.min_long_prompt, args.max_long_prompt], "max_tokens": args.max_tokens}
    outputs = {}
    for name, t in (("fcfs", 0), ("short_first", threshold)):
        llm = LLM(model, **kw, long_prefill_token_threshold=t)
        engine = llm.engine
        prompts, is_long = _mixed_queue(args, engine.model_config.vocab_size)
        for _ in range(max(1, args.passes)):   # the last pass counts (kernels compiled in the first)
            engine.kv.pool.reset_prefix_cache()
            steps, seconds, outputs[name] = _first_tokens(engine, prompts, sp)
        result.update(device=str(engine.device), budget=engine.cfg.max_num_batched_tokens)
        result[name] = {"threshold": t, **{
            cls: _class_stats([s for s, lg in zip(steps, is_long) if lg == want],
                              [x for x, lg in zip(seconds, is_long) if lg == want])
            for cls, want in (("short", False), ("long", True))}}
        del llm, engine
        _free(torch.device(result["device"]))
    # Equal on the CPU (tests/engine/test_long_prefills.py); in bf16 a request
    # batched with others in steps of another shape may round to another token.
    result["outputs_differ"] = sum(a != b for a, b in zip(outputs["fcfs"], outputs["short_first"]))
    return result


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        import gc
        gc.collect()
        torch.cuda.empty_cache()


def run(args) -> dict:
    from pdd.engine.llm import LLM
    from pdd.api import SamplingParams
    from pdd.engine.args import engine_kwargs

    kw = engine_kwargs(args)
    llm = LLM(kw.pop("model"), **kw)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    if llm.tokenizer is not None:
        vocab = min(vocab, llm.tokenizer.vocab_size)
    prompts = _requests(args.num_requests, args.min_prompt, args.max_prompt, vocab)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    out_tokens = args.num_requests * args.max_tokens
    in_tokens = sum(map(len, prompts))

    llm.generate(prompts[:2], sp)  # warm-up (allocator, kernels)
    # The whole batch more than once: on a machine whose Triton cache is cold the
    # first pass also compiles kernels for shapes the warm-up did not reach
    # (17.2 s vs 10.5 s on an H200, 256 x 1024 in / 256 out); the last pass is reported.
    pass_times = []
    for _ in range(max(1, args.passes)):
        engine.kv.pool.reset_prefix_cache()
        _sync(engine.device)
        t0 = time.perf_counter()
        batched = llm.generate(prompts, sp)
        _sync(engine.device)
        pass_times.append(time.perf_counter() - t0)
    t_batched = pass_times[-1]

    t_solo = None
    if not args.no_solo:
        engine.kv.pool.reset_prefix_cache()
        t0 = time.perf_counter()
        solo = [llm.generate([p], sp)[0] for p in prompts]
        _sync(engine.device)
        t_solo = time.perf_counter() - t0
        assert [o.token_ids for o in batched] == [o.token_ids for o in solo], "batched != solo output"

    result = {
        "model": str(engine.model_dir), "device": str(engine.device), "dtype": str(engine.dtype),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "num_requests": args.num_requests, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "pdd_batched_s": t_batched, "pdd_batched_out_tok_s": out_tokens / t_batched,
        "pdd_batched_passes_s": pass_times,
    }
    if t_solo is not None:
        result.update(pdd_solo_s=t_solo, pdd_solo_out_tok_s=out_tokens / t_solo,
                      batched_vs_solo=out_tokens / t_batched / (out_tokens / t_solo))
    if args.hf or args.hf_batched or args.hf_cb:
        model_dir, dev, dtype, load_format = engine.model_dir, engine.device, engine.dtype, engine.cfg.load_format
        del llm, engine, batched  # free the GPU for the HF model
        _free(dev)
        hf = _load_hf(model_dir, dev, dtype, load_format)
        if args.hf:
            result.update(_run_hf(hf, dev, prompts, args.max_tokens))
            result["batched_vs_hf_solo"] = result["pdd_batched_out_tok_s"] / result["hf_solo_out_tok_s"]
        if args.hf_batched:
            result.update(_run_hf_batched(hf, dev, prompts, args.max_tokens))
            result["batched_vs_hf_batched"] = result["pdd_batched_out_tok_s"] / result["hf_batched_out_tok_s"]
        if args.hf_cb:
            result.update(_run_hf_continuous(hf, dev, prompts, args.max_tokens))
            if "hf_cb_out_tok_s" in result:
                result["batched_vs_hf_cb"] = result["pdd_batched_out_tok_s"] / result["hf_cb_out_tok_s"]
    return result


def _load_hf(model_dir, dev, dtype, load_format: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":  # same shapes, random weights: throughput only
        with torch.device(dev):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()


def _run_hf_batched(hf, dev, prompts, max_tokens: int) -> dict:
    """HF generate on every prompt at once, left-padded (its static-batch path)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], do_sample=False, max_new_tokens=4, pad_token_id=0)
        _sync(dev)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens, pad_token_id=0)
        _sync(dev)
    t = time.perf_counter() - t0
    return {"hf_batched_s": t, "hf_batched_out_tok_s": len(prompts) * max_tokens / t}


def _run_hf_continuous(hf, dev, prompts, max_tokens: int) -> dict:
    """HF's own continuous batching (`generate_batch`, paged KV cache), when the
    installed transformers has it. EOS is disabled so every request makes
    max_tokens tokens, as ours do; the tokens it actually returned are counted."""
    if not hasattr(hf, "generate_batch"):
        return {"hf_cb": "generate_batch not in this transformers"}
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(prompts[:2], generation_config=config)  # warm-up (also captures its graphs)
    _sync(dev)
    t0 = time.perf_counter()
    outputs = hf.generate_batch(prompts, generation_config=config)
    _sync(dev)
    t = time.perf_counter() - t0
    made = sum(len(o.generated_tokens) for o in outputs.values() if o.error is None)
    failed = sum(1 for o in outputs.values() if o.error is not None) + len(prompts) - len(outputs)
    return {"hf_cb_s": t, "hf_cb_out_tok_s": made / t, "hf_cb_tokens": made, "hf_cb_failed": failed}


def _run_hf(hf, dev, prompts, max_tokens: int) -> dict:
    """HF generate one request at a time."""
    def gen(p):
        ids = torch.tensor([p], device=dev)
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens)

    with torch.no_grad():
        gen(prompts[0])
        _sync(dev)
        t0 = time.perf_counter()
        for p in prompts:
            gen(p)
        _sync(dev)
    t = time.perf_counter() - t0
    return {"hf_solo_s": t, "hf_solo_out_tok_s": len(prompts) * max_tokens / t}


def _print_ttft_table(result: dict) -> None:
    print(f"{result['num_requests']} prompts at once on {result['device']}, step budget {result['budget']}: "
          f"short {result['short_prompt']}, long {result['long_prompt']} tokens, max_tokens {result['max_tokens']}")
    print("| policy | class | n | TTFT steps mean | p50 | p90 | max | TTFT s mean | p50 | p90 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("fcfs", "short_first"):
        for cls in ("short", "long"):
            c = result[name][cls]
            if c["count"]:
                print(f"| {name} (threshold {result[name]['threshold']}) | {cls} | {c['count']} | {c['steps_mean']} | "
                      f"{c['steps_p50']:g} | {c['steps_p90']:g} | {c['steps_max']} | {c['s_mean']} | {c['s_p50']} | "
                      f"{c['s_p90']} |")
    print(f"requests whose output differs between the two: {result['outputs_differ']}")


def main(args) -> int:
    if args.ttft_by_length:
        result = run_ttft_by_length(args)
        _print_ttft_table(result)
    else:
        result = run(args)
        for k, v in result.items():
            print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
