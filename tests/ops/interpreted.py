"""Import a kernel module so that, without a GPU, its kernels run under the
Triton interpreter (as tests/ops/test_kernels.py sets it up)."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from tests.ops.test_kernels import INTERPRET


def import_kernels(name: str) -> ModuleType:
    # Kernels are interpreted only if decorated while TRITON_INTERPRET is set.
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if INTERPRET:  # imported lazily at a kernel's first fp8 argument; it checks the mode on import
            importlib.import_module("triton.experimental.gluon")
        return importlib.import_module(name)
    finally:
        os.environ.pop("TRITON_INTERPRET", None) if saved is None else os.environ.update(TRITON_INTERPRET=saved)
