"""Tokenizer, chat template, incremental detokenization, stop strings."""
from __future__ import annotations

import pytest

from pdd.http.text_stream import TextStream
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


# ---- SentencePiece-style decoding (Llama 2, Mistral): a sequence's first space is stripped

@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A Metaspace tokenizer as Llama 2's: words "▁w<i>", byte fallback, and a
    decoder that strips the leading space of what it decodes."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({f"▁w{i}": len(vocab) + i for i in range(64)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken("</s>", special=True)])
    path = tmp_path_factory.mktemp("spm")
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def words(tokenizer, *names: str) -> list[int]:
    return [tokenizer.token_to_id(f"▁{n}") for n in names]


def test_first_output_token_keeps_its_space_after_the_prompt(spm):
    prompt, output = words(spm, "w1", "w2"), words(spm, "w3", "w4")
    assert spm.decode(output) == "w3 w4"          # decoded alone: the space is gone
    expected = spm.decode(prompt + output)[len(spm.decode(prompt)):]
    assert expected == " w3 w4"
    detok = IncrementalDetokenizer(spm, prompt_ids=prompt)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == expected
    stream = TextStream(spm, prompt_ids=prompt)
    assert "".join(stream.add([t]) for t in output) + stream.finish() == expected


def test_logprob_tokens_are_the_text_each_token_adds(spm):
    from pdd.http.responses import LogprobsBuilder
    prompt, output = words(spm, "w1"), words(spm, "w3", "w4")
    lp = LogprobsBuilder("completion", spm, 0, prev_token=prompt[-1])
    for t in output:
        lp.add(t, -0.5, [], 0)
    assert lp.result()["tokens"] == [" w3", " w4"]


SPLIT = "日本語 😀"   # each character over several byte tokens


def test_token_bytes_rebuild_characters_split_over_tokens(tok, spm):
    ids = tok.encode(SPLIT)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    assert b"".join(tok.token_bytes(t) for t in ids) == SPLIT.encode()
    ids = byte_tokens(spm, SPLIT)
    assert spm.decode(ids) == SPLIT
    assert b"".join(spm.token_bytes(t) for t in ids) == SPLIT.encode()
    assert spm.token_bytes(words(spm, "w1")[0]) is None   # whole text: its bytes are its text's


def byte_tokens(spm, text: str) -> list[int]:
    """text as byte-fallback tokens ("<0xE6>", ...): how Llama 2 writes what its vocabulary lacks."""
    return [spm.token_to_id(f"<0x{b:02X}>") for b in text.encode()]


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(tok, spm):
    from pdd.http.responses import LogprobsBuilder
    for tokenizer, ids in ((tok, tok.encode(SPLIT)), (spm, byte_tokens(spm, SPLIT))):
        lp = LogprobsBuilder("chat", tokenizer, 1)
        for t in ids:
            lp.add(t, -0.5, [(t, -0.5)], 0)
        content = lp.result()["content"]
        assert bytes(b for e in content for b in e["bytes"]).decode() == tokenizer.decode(ids)
        assert [e["bytes"] for e in content] == [e["top_logprobs"][0]["bytes"] for e in content]


# ---- the token that ends generation, min_tokens, include_stop_str

def test_stop_token_text_is_left_out_and_counted(tok):
    ids = tok.encode("one two three")
    stop = ids[-1]
    stream = TextStream(tok, stop_token_ids={stop})
    out = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert out == tok.decode(ids[:-1]) and stream.stopped_on == stop
    assert stream.num_tokens == len(ids)
    shown = TextStream(tok, stop_token_ids={stop}, include_stop_str=True)
    assert "".join(shown.add([t]) for t in ids) + shown.finish() == "one two three"


def test_stop_token_within_min_tokens_is_text(tok):
    ids = tok.encode("one two three")
    stream = TextStream(tok, stop_token_ids={ids[0]}, min_tokens=1)
    out = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert out == "one two three" and not stream.stopped


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("abc abc abc")
    n_first = next(k for k in range(1, len(ids) + 1) if "abc" in tok.decode(ids[:k]))
    stream = TextStream(tok, stop=["abc"], min_tokens=n_first)
    out = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert out == "abc " and stream.stopped_on == "abc"     # the second one stops it
    assert stream.num_tokens < len(ids)                      # the tokens after it are not counted


def test_include_stop_str_keeps_the_stop_string(tok):
    ids = tok.encode("one two three four")
    stream = TextStream(tok, stop=["two"], include_stop_str=True)
    assert "".join(stream.add([t]) for t in ids) + stream.finish() == "one two"


def test_generated_chars_counts_held_back_text(tok):
    ids = tok.encode("one two xy")
    stream = TextStream(tok, stop=["xyz!"])
    offsets = []
    for t in ids:
        offsets.append(stream.generated_chars)
        stream.add([t])
    plain = TextStream(tok)
    expected = []
    for t in ids:
        expected.append(len(plain.text))
        plain.add([t])
    assert offsets == expected and stream.text != plain.text   # text held back, offsets not


def test_continue_final_message_ends_inside_the_last_message(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    closed = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text.endswith("Once upon") and closed.startswith(text) and len(closed) > len(text)


def test_invalid_bytes_go_out_as_they_come_and_the_window_stays_bounded(tok):
    # A model emitting bytes that never form a character: without a bound the
    # window would hold them all, decoded again at every token (quadratic work
    # on the router's loop) and the client would get no text until the end.
    stray = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    ids = [stray] * 200 + tok.encode(TEXT) + [stray] * 50 + tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    pieces, held = [], []
    for t in ids:
        pieces.append(detok.add([t]))
        held.append(len(detok.ids) - detok.prefix_offset)
    assert max(held) <= 16                                   # twice MAX_HELD_TOKENS at most
    assert len("".join(pieces[:200])) >= 200 - 8            # all but MAX_HELD_TOKENS of them out
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)   # the characters after them whole, as decoded at once
    assert "🙂" in "".join(pieces[200:])


def test_plain_pieces_give_the_text_the_tokens_decode_to_together(tok):
    """The detokenizer's shortcut (a token's own text where nothing is held
    back) releases what the window decode releases, token for token, over text
    that splits characters across tokens, special tokens and invalid bytes."""
    import random

    class WindowOnly:   # the same tokenizer without the shortcut
        def __getattr__(self, name):
            if name == "plain_piece":
                raise AttributeError(name)
            return getattr(tok, name)

    assert [tok.plain_piece(t) for t in tok.encode("ok!")] == [tok.decode([t]) for t in tok.encode("ok!")]
    assert any(tok.plain_piece(t) is None for t in tok.encode("日本語"))   # pieces of characters
    stray = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    special = sorted(tok._added_ids)
    rng = random.Random(0)
    base = tok.encode(TEXT)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.choice(base + special + [stray]) if rng.random() < 0.3 else t for t in base * 2]
            fast, slow = IncrementalDetokenizer(tok, skip), IncrementalDetokenizer(WindowOnly(), skip)
            assert [fast.add([t]) for t in ids] == [slow.add([t]) for t in ids]
            assert fast.flush() == slow.flush()
            assert fast.text == tok.decode(ids, skip)
