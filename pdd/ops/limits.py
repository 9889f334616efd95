"""Sizes the dispatcher (pdd.ops) and the kernels it loads agree on: a leaf,
because a kernel module that imported them from the dispatcher, which imports
it lazily, would close an import circle."""
from __future__ import annotations

GEMV_MAX_M = 16   # rows (tokens of a step) up to which a linear runs as the GEMV
