"""The tokenizer files of a made checkpoint: a BPE learned over the embedded
corpus, the special and reasoning tokens, the chat templates (pdd.model.make_model)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pdd.model.bpe import tokenizer_json, train_bpe
from pdd.model.make_presets import PRESETS

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # appended in this order after the BPE vocab

# ChatML. The '\\n' stays a backslash escape in the template; Jinja turns it into a newline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML for a reasoning model, DeepSeek-R1 style: the generation prompt opens
# <think> (unless chat_template_kwargs.enable_thinking is false), so the output
# starts inside the reasoning and ends it with </think>; a reasoning_effort the
# request gives is said in a system line (a template variable, as gpt-oss's).
THINKING_CHAT_TEMPLATE = (
    "{% if reasoning_effort is defined %}"
    "{{ '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "thinking": THINKING_CHAT_TEMPLATE}
# A reasoning checkpoint's markers are tokens of their own, as Qwen3's and
# DeepSeek-R1's are (added, not special: they decode as their text), after the
# tokenizer's other ids.
THINK_TOKENS = ("<think>", "</think>")

_CORPUS = Path(__file__).with_name("corpus.txt")


@lru_cache(maxsize=4)
def _learn_tokenizer(vocab_size: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """BPE vocab and merges for the embedded corpus (cached: it is arch/seed independent)."""
    # Read bytes and drop CRs so a Windows checkout with autocrlf learns the same merges.
    text = _CORPUS.read_bytes().decode("utf-8").replace("\r\n", "\n")
    vocab, merges = train_bpe(text, vocab_size - len(SPECIAL_TOKENS))
    return tuple(vocab), tuple(merges)


def special_ids(preset: str) -> dict[str, int]:
    base = PRESETS[preset]["tokenizer_vocab_size"] - len(SPECIAL_TOKENS)
    return {tok: base + i for i, tok in enumerate(SPECIAL_TOKENS)}


def text_token_ids(preset: str, chat_template: str) -> dict[str, int]:
    """The added tokens that are text (THINK_TOKENS for the thinking template), id -> past the others."""
    if chat_template != "thinking":
        return {}
    base = PRESETS[preset]["tokenizer_vocab_size"]
    return {tok: base + i for i, tok in enumerate(THINK_TOKENS)}


def tokenizer_json_for(preset: str, chat_template: str = "chatml") -> dict[str, Any]:
    vocab, merges = _learn_tokenizer(PRESETS[preset]["tokenizer_vocab_size"])
    return tokenizer_json({tok: i for i, tok in enumerate(vocab)}, list(merges), special_ids(preset),
                          text_token_ids(preset, chat_template))


def tokenizer_config(preset: str, chat_template: str = "chatml") -> dict[str, Any]:
    specials = special_ids(preset)
    decoder = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": tok in specials}
        for tok, i in {**specials, **text_token_ids(preset, chat_template)}.items()
    }
    return {
        "add_bos_token": False,  # Qwen-style: the BOS string exists but is never prepended
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATES[chat_template],
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": PRESETS[preset]["max_position_embeddings"],
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        # The generic class loads tokenizer.json as written rather than rebuilding
        # it from a family recipe. (transformers 5 still forces Qwen2Tokenizer on
        # model_type qwen2, hence Qwen2's text pipeline in bpe.py.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }
