"""Grammars compile off the engine's step (pdd.grammar.GrammarCompiler): a
request waits for its own compile while the others step on; the compiled ones
are kept within grammar_cache_bytes and flushed on demand; the vocabulary is
built with the engine, on the CPU too."""
from __future__ import annotations

import threading

from pdd import LLM, SamplingParams
from pdd.api import StructuredOutput
from pdd.engine.engine import LLMEngine
from pdd.config import EngineConfig
from tests.engine.helpers import random_prompts


def heavy(n: int, width: int = 2000) -> StructuredOutput:
    """A regex whose first mask builds lexer states of ~450 bytes a character
    of its n * width: at the default, ~36 MB at n = 40 (0.1 s here; 2 s on a
    49k vocabulary)."""
    return StructuredOutput("regex", f"(a{{{width}}}){{{n}}}")


def light(i: int) -> StructuredOutput:
    """A regex that compiles in a millisecond, one of its own for each i."""
    return StructuredOutput("regex", f"a{{{50 + i}}}")


def sp(so: StructuredOutput | None, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=so is None, structured_output=so)


def test_the_grammar_compiler_is_built_with_the_engine_on_the_cpu(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=64))
    assert engine.device.type == "cpu"
    assert engine.grammar_compiler is not None and engine.grammar_compiler.tokenizer is not None


def test_a_bystander_steps_on_while_grammars_compile(tiny_model):
    engine = LLM(str(tiny_model), num_blocks=128, grammar_compile_threads=1,
                 grammar_compile_timeout_s=600).engine   # a busy machine must not fail a compile here
    compiler = engine.grammar_compiler
    release, compiling = threading.Event(), threading.Event()
    real = compiler._compile

    def held(so):
        # Forced: a compile that does not end until the test says so (a slow grammar, made certain).
        compiling.set()
        assert release.wait(60), "never released"
        return real(so)

    compiler._compile = held
    # Light grammars: the hold above is what keeps them compiling. Heavy ones
    # added nothing here but their compiles after the release, in niced threads
    # that a busy 2-core machine left waiting for half a minute.
    for i in range(8):
        engine.add_request(f"g{i}", random_prompts([6], seed=i)[0], sp(light(i)))
    engine.add_request("bystander", random_prompts([9], seed=20)[0], sp(None, max_tokens=12))
    assert compiling.wait(60)
    steps, bystander = 0, []
    while not (bystander and bystander[-1].finished):
        outs = engine.step()
        steps += 1
        bystander += [o for o in outs if o.request_id == "bystander"]
        assert not any(o.request_id.startswith("g") for o in outs)
    # The bystander ran all its steps while every grammar request still waited for its compile.
    assert sum(len(o.new_token_ids) for o in bystander) == 12 and steps >= 12
    assert engine.num_compiling == 8
    release.set()
    last = {}
    while engine.has_unfinished():
        last.update((o.request_id, o) for o in engine.step())
        if not last and engine.num_compiling:
            engine.wait_for_grammars(1.0)
    assert {rid: o.finish_reason for rid, o in last.items()} == {f"g{i}": "length" for i in range(8)}
    assert all(o.error is None for o in last.values())


def test_a_compile_past_its_deadline_fails_its_request(tiny_model):
    engine = LLM(str(tiny_model), num_blocks=64, grammar_compile_threads=1, grammar_compile_timeout_s=0.01).engine
    release = threading.Event()
    real = engine.grammar_compiler._compile
    # Forced: a compile that outlives its request's deadline.
    engine.grammar_compiler._compile = lambda so: (release.wait(60), real(so))[1]
    engine.add_request("slow", random_prompts([6], seed=1)[0], sp(heavy(3)))
    outs = []
    while not outs:
        outs = engine.step()
    release.set()
    (out,) = outs
    assert out.finish_reason == "error" and "grammar_compile_timeout_s" in out.error
    assert out.invalid   # the request's own fault: its client is told 400
    assert out.error.startswith("structured_output") and not engine.has_unfinished()


def test_the_cache_holds_grammars_within_its_bytes_and_a_flush_empties_it(tiny_model):
    # Eight grammars of ~3-5.5 MB each (a tenth of the compile work sixteen of ~36 MB
    # were) against a cache that holds two or three of them.
    cap = 12 * 2**20
    llm = LLM(str(tiny_model), num_blocks=64, grammar_compile_threads=1, grammar_cache_bytes=cap)
    compiler = llm.engine.grammar_compiler
    for i in range(8):
        out, = llm.generate(random_prompts([5], seed=i), sp(heavy(8 + i, width=1000), max_tokens=2))
        assert out.finish_reason == "length" and set(out.text) <= {"a"}, out.text
        assert compiler.cached_bytes <= cap
    kept = list(compiler._compiled.values())
    # Each is charged its lexer's memory (MBs), so not all 8 stay.
    assert 0 < len(kept) < 8 and all(c.nbytes > 2**20 for c in kept)
    assert compiler.cached_bytes == sum(c.nbytes for c in kept)
    assert llm.engine.flush_grammar_cache() == len(kept)
    assert compiler.num_cached == 0 and compiler.cached_bytes == 0
