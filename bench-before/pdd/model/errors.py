"""The error every checkpoint check raises (its own module: config and
quant_config both raise it)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (config, weights, tokenizer) that pdd cannot serve."""
