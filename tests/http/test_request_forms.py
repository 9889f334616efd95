"""What evaluation and benchmark clients send that a one-prompt, known-fields
parser refused or dropped: a list of prompts (each its own choice), and
fields pdd does not know (accepted, and said: never silently)."""
from __future__ import annotations

import logging

import orjson
import pytest

from pdd.http import schemas, validate
from pdd.http.schemas import APIError, Prompt, parse_chat_request, parse_completion_request

MODELS = ["tiny"]


def cmpl(**fields) -> bytes:
    return orjson.dumps({"model": "tiny", "prompt": "Hello", **fields})


def refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_completion_request(body, MODELS, vocab_size=1000)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("prompt, want", [
    (["Hello", "The cat"], [Prompt("Hello", None), Prompt("The cat", None)]),
    ([[1, 2], [3], [4, 5, 6]], [Prompt(None, [1, 2]), Prompt(None, [3]), Prompt(None, [4, 5, 6])]),
    (["only one"], [Prompt("only one", None)]),
])
def test_a_list_of_prompts_is_one_prompt_each(prompt, want):
    assert parse_completion_request(cmpl(prompt=prompt), MODELS, vocab_size=1000).prompts == want


@pytest.mark.parametrize("prompt, param, words", [
    (["a", [1]], "prompt", ["only strings or only lists of token ids", "index 1 is array"]),
    ([[1], "a"], "prompt", ["index 0 is array", "index 1 is string"]),
    ([[1], 2], "prompt", ["index 1 is integer"]),
    (["a", ""], "prompt[1]", ["'prompt[1]' must not be empty"]),
    ([[1], [2, 5000]], "prompt[1]", ["token id 5000 at index 1", "vocabulary"]),
    ([[1], []], "prompt[1]", ["must not be empty"]),
])
def test_a_bad_prompt_in_a_list_is_named_by_its_index(prompt, param, words):
    err = refused(cmpl(prompt=prompt))
    assert err.param == param, err.message
    for w in words:
        assert w in err.message, err.message


def test_fields_nothing_reads_are_accepted_and_named():
    newer = {"reasoning_effort": "low", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
             "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
             "parallel_tool_calls": True, "temperture": 0.5}
    req = parse_completion_request(cmpl(max_tokens=2, **newer), MODELS)
    assert req.ignored_fields == tuple(newer)
    chat = parse_chat_request(orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                            "top_p": 0.5, **newer}), MODELS)
    # Chat reads parallel_tool_calls (it goes with tools) and reasoning_effort (a
    # template variable); completions have neither tools nor a template.
    read = ("parallel_tool_calls", "reasoning_effort")
    assert chat.ignored_fields == tuple(name for name in newer if name not in read)
    # Known fields, sent or not, are never among them; a known field set to what
    # pdd does not do is still refused, naming it.
    assert parse_completion_request(cmpl(stream=False, seed=3, user="u", top_k=5), MODELS).ignored_fields == ()
    assert refused(cmpl(use_beam_search=True, metadata={})).param == "use_beam_search"


def test_each_ignored_name_is_logged_once_and_the_header_lists_what_it_can(caplog, monkeypatch):
    monkeypatch.setattr(validate, "_logged_ignored", set())
    with caplog.at_level(logging.WARNING, logger="pdd.http.validate"):
        assert validate.say_ignored(("store", "metadata")) == "store, metadata"
        assert validate.say_ignored(("metadata", "store")) == "metadata, store"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "'store'" in logged[0] and "'metadata'" in logged[1]
    assert validate.say_ignored(()) is None
    # A name a header cannot carry (a comma, a newline, too long) is counted, not listed.
    assert validate.say_ignored(("a,b", "x\ny", "n" * 100, "ok")) == "ok, (+3 more)"


def test_a_client_inventing_names_grows_neither_the_log_nor_the_set(caplog, monkeypatch):
    monkeypatch.setattr(validate, "_logged_ignored", set())
    with caplog.at_level(logging.WARNING, logger="pdd.http.validate"):
        for i in range(validate.MAX_LOGGED_IGNORED + 50):
            validate.say_ignored((f"f{i}",))
    assert len(caplog.records) == validate.MAX_LOGGED_IGNORED + 1    # and one saying no more are named
    assert "no more" in caplog.records[-1].getMessage()
    assert len(validate._logged_ignored) == validate.MAX_LOGGED_IGNORED + 1
    many = tuple(f"g{i}" for i in range(100))
    assert validate.say_ignored(many).endswith(f"(+{100 - validate.MAX_LISTED_IGNORED} more)")


def test_the_choices_of_a_list_of_prompts_are_bounded():
    """Each choice is a request at the router: prompts x n is capped (a small body
    holds many one-token prompts), the refusal naming the numbers."""
    limit = schemas.MAX_BATCH_CHOICES
    assert len(parse_completion_request(cmpl(prompt=[[1]] * (limit // 2), n=2), MODELS).prompts) == limit // 2
    err = refused(cmpl(prompt=[[1]] * (limit // 2 + 1), n=2))
    assert err.param == "n" and f"at most {limit} choices" in err.message and f"{limit // 2 + 1} prompts" in err.message
