"""The decode roofline counts the bytes a step reads: an untied embedding table
is looked up (the batch's rows), a tied one is read whole as the LM head."""
import dataclasses

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
