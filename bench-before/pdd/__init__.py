"""pdd: an LLM serving daemon built around prefill/decode disaggregation."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "build_info"]


def build_info() -> dict[str, str]:
    """This process's build: pdd's and Python's versions, and torch's where it
    is already imported (a worker; the router and the admin CLI never import it)."""
    import platform
    import sys

    info = {"version": __version__, "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = str(torch.__version__)
        if torch.version.cuda:
            info["cuda"] = str(torch.version.cuda)
    return info


def __getattr__(name):
    # Lazy: `import pdd` (router, admin CLI) must not pay for importing torch.
    if name == "LLM":
        from pdd.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdd.api import SamplingParams
        return SamplingParams
    raise AttributeError(name)
