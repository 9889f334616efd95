"""The command line every benchmark module shares: its docstring as the help,
its add_args(parser) for the flags, its main(args) to run, so that
`python -m benchmarks.NAME` and the tests build the same parser."""
from __future__ import annotations

import argparse
import sys
from types import ModuleType


def parser(module: ModuleType) -> argparse.ArgumentParser:
    name = module.__spec__.name if module.__spec__ else module.__name__
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_args(p)
    return p


def add_batch_args(p: argparse.ArgumentParser, prompt: tuple[int, int], max_tokens: int, of: str) -> None:
    """How many prompts, of which lengths (uniform, tokens), asking for how many tokens."""
    p.add_argument("--num-requests", type=int, default=64, help=f"prompts {of}")
    p.add_argument("--min-prompt", type=int, default=prompt[0], help="shortest prompt, tokens")
    p.add_argument("--max-prompt", type=int, default=prompt[1], help="longest prompt, tokens")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens generated per request")


def run(module: ModuleType, argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line's) with `module`'s flags and run
    it; a ValueError (bad input) is its message and exit status 2, as with `pdd`."""
    p = parser(module)
    args = p.parse_args(argv)
    try:
        return module.main(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2


def run_as_main(name: str) -> None:
    """The `if __name__ == "__main__"` of a benchmark module."""
    sys.exit(run(sys.modules[name]))
