from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from pdd.model.make_model import FORMAT_VERSION, default_model_dir, ensure_builtin_model, make_model
from pdd.model.make_presets import ARCHS, PRESETS
from pdd.model.make_weights import TIED_FINAL_NORM_GAIN

transformers = pytest.importorskip("transformers")

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Corpus-like text: prose, code, digits, punctuation, 2-, 3- and 4-byte UTF-8 (NFC, as the
# tokenizer normalises to NFC, like Qwen's).
SAMPLE = (
    "The café's naïve owner said: \"Hello, world!\" at 7:45 — 日本語 and 你好, 25°C, €20 🙂\n"
    "def f(x: int) -> int:\n    return x ** 2 + 1024  # tabs\tand  spaces\n\n"
    "SELECT id FROM users WHERE price >= 3.99;  Ünïcödé ÀÉÎ ß ж λ\n"
)

CHATML_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, "tiny", arch, seed=0) for arch in ARCHS}


def test_writes_all_files(models: dict[str, Path]) -> None:
    for d in models.values():
        assert sorted(p.name for p in d.iterdir()) == sorted(FILES)


def test_deterministic_and_seeded(tmp_path: Path, models: dict[str, Path]) -> None:
    again = make_model(tmp_path / "again", "tiny", "llama", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (models["llama"] / name).read_bytes(), name

    other = make_model(tmp_path / "other", "tiny", "llama", seed=1)
    assert _sha(other / "model.safetensors") != _sha(again / "model.safetensors")
    for name in FILES:  # only the weights depend on the seed
        if name != "model.safetensors":
            assert (other / name).read_bytes() == (again / name).read_bytes(), name


def test_golden_bytes(models: dict[str, Path]) -> None:
    # Pins the output across machines and library versions (same bytes were seen with
    # Python 3.11/torch 2.13 and Python 3.12/torch 2.11). ensure_builtin_model caches by
    # name only, so a change here must be deliberate: update the hashes knowingly.
    golden = {
        "tokenizer.json": "0b4858d8dc0b67306d26f51f087c8eb19084cd15a78bb651242f9c2dce509685",
        "model.safetensors": "e3ab3e7f180674d3c079583d6e84af4f20916340efd53df12c68b6ab2dcb2b7d",
        "config.json": "2940fc7b72a08bd15e23f11b333fee22adb1b7ab049b4d7f2355895df1e9537d",
    }
    assert {name: _sha(models["llama"] / name) for name in golden} == golden


@pytest.mark.parametrize("arch", ARCHS)
def test_weights(models: dict[str, Path], arch: str) -> None:
    cfg = json.loads((models[arch] / "config.json").read_text())
    w = load_file(models[arch] / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in w.values())
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= PRESETS["tiny"]["tokenizer_vocab_size"]
    assert w["model.embed_tokens.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert ("lm_head.weight" in w) == (not cfg["tie_word_embeddings"])
    assert cfg["tie_word_embeddings"] == (arch == "llama")
    assert ("model.layers.0.self_attn.q_proj.bias" in w) == (arch == "qwen2")
    assert "model.layers.0.self_attn.o_proj.bias" not in w
    if arch == "qwen3":
        assert cfg["head_dim"] == 48 != cfg["hidden_size"] // cfg["num_attention_heads"]
        assert w["model.layers.0.self_attn.q_norm.weight"].shape == (48,)
    # Norms are random around 1 (the tied head's final norm around its larger
    # gain), never exactly ones, so a skipped weight shows up.
    norm = w["model.layers.0.input_layernorm.weight"]
    assert not torch.all(norm == 1) and abs(norm.mean().item() - 1) < 0.1
    final = w["model.norm.weight"]
    gain = TIED_FINAL_NORM_GAIN if cfg["tie_word_embeddings"] else 1.0
    assert not torch.all(final == gain) and abs(final.mean().item() - gain) < 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_generates(models: dict[str, Path], arch: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(models[arch], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == json.loads((models[arch] / "config.json").read_text())["architectures"][0]
    prompt = torch.tensor([[10, 200, 300, 400]])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    assert out.shape == (1, 12)


@pytest.mark.parametrize("arch", ARCHS)  # transformers picks a different tokenizer class per model_type
def test_tokenizer(models: dict[str, Path], arch: str) -> None:
    d = models[arch]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == PRESETS["tiny"]["tokenizer_vocab_size"]

    corpus = (Path(__file__).parents[2] / "pdd" / "model" / "corpus.txt").read_text(encoding="utf-8")
    for text in (SAMPLE, corpus):
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    assert len(tok.encode("the café")) < len("the café".encode())  # merges were learned

    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == CHATML_HI
    assert tok.encode(chat) == raw.encode(chat).ids

    gen = json.loads((d / "generation_config.json").read_text())
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    for t, i in ids.items():
        assert tok.encode(t) == raw.encode(t).ids == [i]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["pad_token_id"] == ids["<|endoftext|>"] and gen.get("bos_token_id") is None
    assert tok.encode("hi")[0] != tok.convert_tokens_to_ids(tok.bos_token)  # no BOS prepended


def test_small_preset(tmp_path: Path) -> None:
    d = make_model(tmp_path / "small", "small", "qwen3", seed=3)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["max_position_embeddings"]) == (256, 6, 8192)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path, preset="huge")
    with pytest.raises(ValueError):
        make_model(tmp_path, arch="gpt2")


def test_ensure_builtin_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: dict[str, Path]) -> None:
    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path))
    d = ensure_builtin_model("tiny", "mistral", seed=0)
    assert d == default_model_dir("tiny", "mistral", 0) == tmp_path / f"tiny-mistral-seed0-v{FORMAT_VERSION}"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model("tiny", "mistral", seed=0) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp  # built once
    assert [p.name for p in tmp_path.iterdir()] == [f"tiny-mistral-seed0-v{FORMAT_VERSION}"]  # no temp dir left
    assert _sha(d / "model.safetensors") == _sha(models["mistral"] / "model.safetensors")
