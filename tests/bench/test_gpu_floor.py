"""The decode roofline counts the bytes a step reads: an untied embedding table
is looked up (the batch's rows), a tied one is read whole as the LM head."""
import dataclasses

import pytest
import torch

from pdd.bench.gpu import decode_weight_bytes
from pdd.model.config import ModelConfig
from pdd.model.llama import CausalLM


def _model(tied: bool) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = dataclasses.replace(ModelConfig.from_dir("conf/models/llama-3.1-8b"), tie_word_embeddings=tied)
    with torch.device("meta"):     # sizes without memory: the 8B shape
        return cfg, CausalLM(cfg).to(torch.bfloat16)


def test_an_untied_embedding_counts_only_the_rows_looked_up():
    cfg, model = _model(tied=False)
    table = cfg.vocab_size * cfg.hidden_size
    assert decode_weight_bytes(model, 1) == 2 * (cfg.num_parameters() - table + cfg.hidden_size)
    assert decode_weight_bytes(model, 32) - decode_weight_bytes(model, 1) == 2 * 31 * cfg.hidden_size


def test_a_tied_embedding_is_read_whole_as_the_lm_head():
    cfg, model = _model(tied=True)
    assert decode_weight_bytes(model, 1) == 2 * cfg.num_parameters()


def test_a_mixture_of_experts_counts_the_experts_a_batch_chose():
    cfg = ModelConfig.from_dir("conf/models/qwen3-30b-a3b")
    with torch.device("meta"):
        model = CausalLM(cfg).to(torch.bfloat16)
    table = cfg.vocab_size * cfg.hidden_size
    # One token reads its 8 experts of 128 in each layer: the 3.3B active parameters.
    active = cfg.num_active_parameters() - table + cfg.hidden_size
    assert decode_weight_bytes(model, 1) == pytest.approx(2 * active)
    # 128 tokens choose nearly every expert: nearly all 30.5B.
    assert decode_weight_bytes(model, 128) == pytest.approx(2 * (cfg.num_parameters() - table), rel=1e-3)
    assert decode_weight_bytes(model, 1) < decode_weight_bytes(model, 8) < decode_weight_bytes(model, 32)
