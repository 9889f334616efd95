"""Every `pdd bench` subcommand names a module with a main() (the parser and the
module it runs are tied by name only); what runs against a cluster or a GPU is
there, the developer tools are in benchmarks/ (tests/benchmarks)."""
from __future__ import annotations

import importlib

from pdd.cli import build_parser


def test_every_bench_subcommand_runs_a_module_with_main():
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "bench")
    assert set(bench.choices) == {"serve", "frontdoor", "chaos", "gpu"}
    for name, sub in bench.choices.items():
        module = importlib.import_module(f"pdd.bench.{sub.get_default('func').module}")
        assert callable(module.main), name
