"""What `pdd make-model` can make: the presets (shapes) and the architectures, with
the config.json keys each family's real checkpoints write (pdd.model.make_model)."""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tokenizer_vocab_size=1024,  # including the 3 special tokens
    ),
    "small": dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tokenizer_vocab_size=1024,
    ),
    # Llama-3.1-8B's shapes (its vocabulary size too; the tokenizer is still the
    # small one): for benchmarks of FP8 checkpoints without a download.
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tokenizer_vocab_size=1024,
        config=dict(vocab_size=128256, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ),
}

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    # Real Qwen3 sets head_dim explicitly and != hidden/heads; so do we.
    "head_dim": 48,
    "use_sliding_window": False,
    "sliding_window": None,
}

# Family-specific config.json keys, as real checkpoints of each family write them.
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        # Llama 3.x style scaling, so loaders exercise the llama3 rope path.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,  # 8x extended to the tiny preset's 4096
        },
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "qwen3": _QWEN3,
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    # Qwen3-30B-A3B's keys: top-k of many small experts, renormalized; layer 0
    # is dense (`mlp_only_layers`) so both kinds of layer are in every test.
    "qwen3_moe": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    # Mixtral-8x7B's keys: every layer sparse, top-2 of 8 experts of intermediate_size.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
    },
}


def check_preset(preset: str, arch: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
