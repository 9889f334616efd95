"""Tokenizer of a HF checkpoint: `tokenizer.json` through the `tokenizers`
library, chat templates from `tokenizer_config.json` rendered with Jinja the
way transformers renders them, and incremental detokenization for streaming.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from pdd.model.bpe import byte_alphabet
from pdd.model.config import CheckpointError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = self.model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        self._encode_fast = getattr(self._tok, "encode_batch_fast", None)
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        if self.chat_template is None and (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, read from its vocabulary entry: a piece
        of a multi-byte character decodes to U+FFFD, which says nothing of its
        bytes. Known for every token under a byte-level decoder (GPT-2's map of
        bytes to characters: Llama 3, Qwen) and for byte-fallback tokens
        ("<0xE6>": Llama 2, Mistral); None otherwise (its text says them)."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            return None
        if self._byte_decoding == "ByteLevel":
            if all(ch in _BYTE_LEVEL_CHARS for ch in token):   # not an added token written as text
                return bytes(_BYTE_LEVEL_CHARS[ch] for ch in token)
        elif self._byte_decoding == "ByteFallback":
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    return bytes([int(token[3:5], 16)])
                except ValueError:
                    return None
        return None

    def plain_piece(self, token_id: int) -> str | None:
        """The text `token_id` adds after any other tokens' text, when that is
        its own and fixed: a vocabulary token (not an added one) whose bytes are
        whole UTF-8 characters, under a decoder that is only GPT-2's byte-level
        map (its decode is the tokens' bytes joined, then read as UTF-8: Llama
        3, Qwen). None otherwise, where the text of the tokens decoded together
        says it (a piece of a character, an added or special token, a decoder
        that strips or joins). Remembered: streams decode each token this way."""
        pieces = self._plain_pieces
        if pieces is None:
            return None
        piece = pieces.get(token_id, False)
        if piece is False:
            raw = None if token_id in self._added_ids else self.token_bytes(token_id)
            try:
                piece = raw.decode() if raw is not None else None
            except UnicodeDecodeError:   # a piece of a character
                piece = None
            if len(pieces) < self.ONE_CACHE_SIZE * 4:
                pieces[token_id] = piece
        return piece

    @cached_property
    def _plain_pieces(self) -> dict[int, str | None] | None:
        """plain_piece's memory, or None where no token has a plain piece."""
        steps = self._decoder_steps
        return {} if steps and all(kind == "ByteLevel" for kind in steps) else None

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @cached_property
    def _byte_decoding(self) -> str | None:
        """"ByteLevel" or "ByteFallback" where the decoder (or a step of its
        sequence) is one: how token_bytes reads a token; None otherwise."""
        return next((k for k in ("ByteLevel", "ByteFallback") if k in self._decoder_steps), None)

    @cached_property
    def _decoder_steps(self) -> list[str]:
        """The decoder's kind, or the kinds of its sequence's steps ([]: no decoder)."""
        decoder = self._tok.decoder
        if decoder is None:
            return []
        spec = json.loads(decoder.__getstate__())
        steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
        return [step.get("type") for step in steps]

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids alone: tokenizers' batch path without offsets where it has
        one (>= 0.21; a fifth less of a short prompt's encode), else encode()."""
        if self._encode_fast is not None:
            return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._ids(text, add_special_tokens)
        if add_special_tokens and self.add_bos:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ONE_CACHE_SIZE = 1 << 16   # single-token texts kept, per skip_special_tokens

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), remembered: a stream decodes each of its tokens
        alone once (IncrementalDetokenizer's prefix), and a few thousand ids make
        most of any text."""
        cache = self._one_cache[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
            if len(cache) < self.ONE_CACHE_SIZE:
                cache[token_id] = text
        return text

    @cached_property
    def _one_cache(self) -> dict[bool, dict[int, str]]:
        return {True: {}, False: {}}

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **extra) -> str:
        """continue_final_message: the text ends inside the last message (after its
        content, before whatever the template closes it with), so the model goes on
        writing it; as transformers does it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **extra)
        if continue_final_message:
            final = messages[-1]["content"].strip()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise ValueError("continue_final_message: the template does not write the last "
                                 "message's content as given")
            text = text[:end + len(final)]
        return text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        # The template writes any special tokens itself (BOS included).
        return self._ids(self.apply_chat_template(messages, add_generation_prompt, **extra), False)


# GPT-2's byte-level alphabet read backwards: symbol -> the byte it stands for.
_BYTE_LEVEL_CHARS = {symbol: b for b, symbol in enumerate(byte_alphabet())}


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


class GrowingText:
    """Text that grows a piece at a time, joined when read. (`text += piece`
    on an attribute copies the whole text at every piece: at 32k tokens that
    is ~6 us a token, for each stream, on the router's loop.)"""
    __slots__ = ("_parts", "chars")

    def __init__(self):
        self._parts: list[str] = []
        self.chars = 0

    def append(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            self.chars += len(piece)

    def value(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting
    half of a multi-byte character: a delta is released only once the decoded
    window no longer ends in U+FFFD (an incomplete byte sequence).

    The window starts in the prompt's last few tokens (`prompt_ids`): decoders
    such as SentencePiece's strip the leading space of a sequence's first
    token, so decoding the output alone would turn " Paris" into "Paris".

    What is held back is bounded: a character is at most 4 bytes, so once
    MAX_HELD_TOKENS tokens still end in U+FFFD, the bytes before the last
    UTF8_TAIL_TOKENS tokens can never complete one (the model emits invalid
    bytes) and go out as U+FFFD. Else the window, decoded again at every
    token, would grow with the output: work quadratic in its length on the
    router's event loop, and no text for the client until the end."""

    PROMPT_CONTEXT = 6    # tokens: enough for any decoder's look-back seen, cheap to re-decode
    MAX_HELD_TOKENS = 8   # more than any character needs (4 bytes; a skipped special token may sit between)
    UTF8_TAIL_TOKENS = 3  # an unfinished character's lead byte is in one of these (at least a byte each)

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT:])
        if self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.ids = []   # a prompt ending inside a character: its bytes would be released twice
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.released = GrowingText()
        self._decode_one = getattr(tokenizer, "decode_one", None)
        self._plain_piece = getattr(tokenizer, "plain_piece", None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_plain(self, token_id: int) -> str | None:
        """The token's own text, released, when nothing is held back and its text
        is its own (Tokenizer.plain_piece): no decode. None: add() it."""
        if self.read_offset != len(self.ids) or self._plain_piece is None:
            return None
        piece = self._plain_piece(token_id)
        if piece is not None:
            self.ids.append(token_id)
            self._release(piece, len(self.ids))
        return piece

    def add(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:
            piece = self.add_plain(token_ids[0])
            if piece is not None:
                return piece
        self.ids.extend(token_ids)
        if self.read_offset - self.prefix_offset == 1 and self._decode_one is not None:   # a token at a time
            prefix = self._decode_one(self.ids[self.prefix_offset], self.skip_special_tokens)
        else:
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            return self._release(window[len(prefix):], len(self.ids))
        if len(self.ids) - self.read_offset >= self.MAX_HELD_TOKENS:   # invalid bytes: they stay so
            # The last token boundary before the tail that cuts no character:
            # the text up to it is the start of the window's.
            for end in range(len(self.ids) - self.UTF8_TAIL_TOKENS, self.read_offset, -1):
                settled = self._decode(self.ids[self.prefix_offset:end])
                if len(settled) > len(prefix) and window.startswith(settled):
                    return self._release(settled[len(prefix):], end)
        return ""

    def _release(self, delta: str, read_to: int) -> str:
        """`delta`: the text of the tokens up to `read_to`, after what went out already."""
        self.prefix_offset, self.read_offset = self.read_offset, read_to
        self.released.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (even if broken)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        delta = window[len(prefix):] if len(window) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.released.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All the text released so far."""
        return self.released.value()


def write_word_tokenizer(model_dir: str | Path, vocab_size: int) -> Path:
    """A stand-in tokenizer.json for a config-only checkpoint (dummy weights):
    token i is the word "t<i>", so text and token ids map one to one. For
    tests and benchmarks of shapes whose real tokenizer is not at hand."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(model_dir) / "tokenizer.json"
    tok.save(str(path))
    return path


def servable_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """`model_dir` if it has a tokenizer; else `out_dir` holding its config.json
    and a word tokenizer (write_word_tokenizer), which the router can serve."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = (model_dir / "config.json").read_text()
    (out_dir / "config.json").write_text(config)
    write_word_tokenizer(out_dir, json.loads(config)["vocab_size"])
    return out_dir
