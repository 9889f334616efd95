"""A request whose grammar fails while it decodes (pdd.grammar.Matcher.failed)
ends on the worker with RequestFailed (not retriable), never with a "stop".
A real Worker driven by the fake router."""
from __future__ import annotations

from pdd.api import SamplingParams, StructuredOutput
from pdd.protocol import messages as m
from tests.engine.helpers import random_prompts
from tests.worker.harness import run_worker, worker_config

# A parser row of 2,500 items (over max_items_in_row): fails at the first token.
WIDE = StructuredOutput("grammar", "start: " + " | ".join(f'"ch{i}"' for i in range(2500)))


def test_a_failing_grammar_fails_its_request(tiny_model):
    async def scenario(router):
        await router.send(m.Admit("g", 1, random_prompts([6], seed=1)[0],
                                  SamplingParams(max_tokens=20, seed=1, structured_output=WIDE)))
        failed = await router.next(m.RequestFailed)
        return failed, router.items("g", 1)

    (failed, items), code = run_worker(worker_config(tiny_model), scenario)
    assert (failed.request_id, failed.epoch, failed.retriable) == ("g", 1, False)
    assert "max is 2000" in failed.error
    assert not any(item.finished for item in items)
    assert code == 0
