"""Kernel-developer tools and studies: tile sweeps, FP8 error, KV copy and
engine micro-benchmarks, stall and overhead studies. Not part of the pdd wheel
(setup.cfg packages only pdd*): run from a checkout, e.g.

    .venv/bin/python -m benchmarks.gemv --help

Each module imports only pdd's public names. What an operator runs against a
cluster or a GPU is `pdd bench` (pdd/bench/)."""
