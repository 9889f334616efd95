"""The decode roofline counts the bytes a step reads: an untied embedding table
is looked up (the batch's rows), a tied one is read whole as the LM head."""
import dataclasses

from pdd.bench.gpu import decode_weight_bytes
from pdd.model.config import ModelConfig


def test_an_untied_embedding_counts_only_the_rows_looked_up():
    cfg = ModelConfig.from_dir("conf/models/llama-3.1-8b")
    assert not cfg.tie_word_embeddings
    table = cfg.vocab_size * cfg.hidden_size
    assert decode_weight_bytes(cfg, 1, 2) == 2 * (cfg.num_parameters() - table + cfg.hidden_size)
    assert decode_weight_bytes(cfg, 32, 2) - decode_weight_bytes(cfg, 1, 2) == 2 * 31 * cfg.hidden_size


def test_a_tied_embedding_is_read_whole_as_the_lm_head():
    cfg = dataclasses.replace(ModelConfig.from_dir("conf/models/llama-3.1-8b"), tie_word_embeddings=True)
    assert decode_weight_bytes(cfg, 1, 2) == 2 * (cfg.num_parameters() + cfg.hidden_size)
