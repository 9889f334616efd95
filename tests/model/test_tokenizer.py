"""Tokenizer, chat template, incremental detokenization, stop strings."""
from __future__ import annotations

import pytest

from pdd.engine.text_stream import TextStream
from pdd.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Le café naïve — 日本語 🙂 ok! def f(x): return x**2\n"


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def test_chat_template_matches_transformers(tok, tiny_model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ours = tok.apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)


def test_incremental_detokenizer_never_splits_characters(tok):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters span several byte-level tokens: some steps must hold back.
    assert "" in pieces[:-1]


def test_text_stream_stop_string_spanning_tokens(tok):
    ids = tok.encode("one two three four five")
    stream = TextStream(tok, stop=["hree fo"])
    out = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert out == "one two t"
    assert stream.stopped_on == "hree fo"


def test_text_stream_without_stop_releases_everything(tok):
    ids = tok.encode(TEXT)
    stream = TextStream(tok)
    out = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert out == TEXT and not stream.stopped


def test_text_stream_holds_back_possible_stop_prefix(tok):
    stream = TextStream(tok, stop=["xyz!"])
    released = stream.add(tok.encode("abc xy"))
    assert not released.endswith("xy")           # could still become "xyz!"
    assert released + stream.finish() == "abc xy"
