"""Stored responses (issue 37): GET and DELETE /v1/responses/{id} and POST
/v1/responses/{id}/cancel, with the openai client against a real server
running the tiny model. A response made with store false, an unknown id or a
deleted one is a 404 naming the id; an id made by another router (ids carry
the router's index) says which router keeps it."""
from __future__ import annotations

import openai
import pytest

from pdd import LLM
from pdd.http.stored_responses import ResponseStore
from tests.http.test_responses_api import with_client


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def test_a_stored_response_is_retrieved_deleted_and_then_gone(llm):
    async def body(client, url, s):
        made = await client.responses.create(model="tiny", input="Hi", max_output_tokens=4, temperature=0)
        streamed = [e async for e in await client.responses.create(model="tiny", input="Hi", max_output_tokens=4,
                                                                   temperature=0, stream=True)]
        got = await client.responses.retrieve(made.id)
        got_streamed = await client.responses.retrieve(streamed[-1].response.id)
        with pytest.raises(openai.BadRequestError) as cancelled:
            await client.responses.cancel(made.id)
        async with s.delete(url + f"/v1/responses/{made.id}") as r:
            deleted = r.status, await r.json()
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.delete(made.id)
        again = e.value.body
        gone = []
        for call in (client.responses.retrieve, client.responses.cancel):
            with pytest.raises(openai.NotFoundError) as e:
                await call(made.id)
            gone.append(e.value.body)
        unstored = await client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.retrieve(unstored.id)
        gone.append(e.value.body)
        return made, streamed[-1].response, got, got_streamed, cancelled.value.body, deleted, again, gone, unstored

    made, streamed, got, got_streamed, cancelled, deleted, again, gone, unstored = with_client(llm, body)
    assert got.model_dump() == made.model_dump()
    assert got_streamed.model_dump() == streamed.model_dump()
    assert "cannot be cancelled" in cancelled["message"] and made.id in cancelled["message"]
    assert deleted == (200, {"id": made.id, "object": "response", "deleted": True})
    assert made.id in again["message"]
    for error, rid in zip(gone, (made.id, made.id, unstored.id)):
        assert rid in error["message"] and "store false" in error["message"]


def test_ids_name_the_router_and_another_routers_id_says_where_it_lives():
    here = ResponseStore(router=0)
    rid = ResponseStore(router=2).new_id("abc")
    assert rid == "resp_r2_abc"
    message = here.not_found(rid).message
    assert rid in message and "made by router 2" in message and "this is router 0" in message
    assert "made by router" not in here.not_found(here.new_id("abc")).message
    assert here.not_found("resp_foreign").status == 404
