"""Reasoning in the Responses API (issue 37): a reasoning model's answer is a
"reasoning" output item (its text in one reasoning_text part) before the
message, streamed as response.reasoning_text.delta events and one .done, as
OpenAI's and vLLM's; an output given back as input (reasoning item and all)
is the conversation again. With the openai client against a real app whose
router stand-in replays a given output of the tiny thinking checkpoint
(random weights never write </think>: tests/http/test_reasoning.py)."""
from __future__ import annotations

import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from pdd.http.responses_api import to_chat
from pdd.http.stored_responses import ResponseStore
from pdd.http.validate import Fields
from pdd.model.tokenizer import Tokenizer
from tests.http.engine_server import run
from tests.http.test_reasoning import CALL, THOUGHT, ScriptedRouter, _serve, thinking_model  # noqa: F401

TOOLS = [{"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


def _answers(thinking_model, output: str, **fields):
    """(the whole response, the stream's events, a follow-up given the output as input)."""
    async def main():
        server, url = await _serve(ScriptedRouter(Tokenizer(thinking_model), output), thinking_model)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        try:
            whole = await client.responses.create(model="tiny", input="What is 2 + 2?", **fields)
            events = [e async for e in await client.responses.create(model="tiny", input="What is 2 + 2?",
                                                                     stream=True, **fields)]
            again = await client.responses.create(model="tiny", input=[
                {"role": "user", "content": "What is 2 + 2?"}, *[i.model_dump() for i in whole.output],
                {"role": "user", "content": "And 3 + 3?"}], **fields)
            return whole, events, again
        finally:
            await client.close()
            await server.cleanup()
    return run(main())


def test_the_reasoning_is_an_item_before_the_message(thinking_model):
    whole, events, again = _answers(thinking_model, THOUGHT)
    Response.model_validate(whole.model_dump())
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me think.")]
    assert message.type == "message" and whole.output_text == "The answer is 4."
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert again.status == "completed"


def test_the_reasoning_streams_as_reasoning_text_events(thinking_model):
    whole, events, _ = _answers(thinking_model, THOUGHT)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e.model_dump())
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == done.text == "Let me think."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert {d.output_index for d in deltas} == {0} and done.item_id == events[-1].response.output[0].id
    final = events[-1].response
    assert final.output[0].content[0].text == "Let me think." and final.output_text == whole.output_text


def test_a_call_after_the_reasoning_is_a_function_call_item(thinking_model):
    whole, events, _ = _answers(thinking_model, "I should add.</think>" + CALL, tools=TOOLS)
    assert [i.type for i in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "I should add." and whole.output[1].name == "add"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "function_call"]


def test_a_reasoning_item_given_back_is_its_answers_reasoning_content():
    items = [{"role": "user", "content": "What is 2 + 2?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "2 and 2"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
             {"role": "user", "content": "And 3 + 3?"}]
    chat, _ = to_chat(Fields({"model": "tiny", "input": items}), ResponseStore())
    assert chat["messages"][1] == {"role": "assistant", "reasoning_content": "2 and 2",
                                   "content": [{"type": "text", "text": "4"}]}
    assert len(chat["messages"]) == 3
