"""pdd: an LLM serving daemon built around prefill/decode disaggregation."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy: `import pdd` (router, admin CLI) must not pay for importing torch.
    if name == "LLM":
        from pdd.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdd.api import SamplingParams
        return SamplingParams
    raise AttributeError(name)
