"""The argument parser every `pdd` command is built with: help that shows
defaults, and usage errors as JSON where the command line asks for JSON."""
from __future__ import annotations

import argparse
import json
import sys

EXIT_USAGE = 2   # argparse's own


def error_document(kind: str, message: str, exit_code: int, command: str | None = None, **detail) -> dict:
    """A command's error as --json prints it (on stdout)."""
    return {"error": {"command": command, "kind": kind, "message": message, "exit_code": exit_code, **detail}}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, unless there is no default
    worth showing (None, False, empty, a suppressed one) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS, [], ()) or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with HelpFormatter; sub-parsers are of the same
    class. A parser whose `json_switch` is set decides, from the arguments it
    parses, whether usage errors (its own, its sub-parsers' and the top
    parser's) are printed as JSON: `--json` among them. The top parser
    (json_switch False) starts every parse with text errors."""
    json_errors = False

    def __init__(self, *args, json_switch: bool | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.json_switch = json_switch

    def parse_known_args(self, args=None, namespace=None):
        if self.json_switch is not None:
            Parser.json_errors = self.json_switch and "--json" in (sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if Parser.json_errors:
            print(json.dumps(error_document("usage", f"{self.prog}: {message}", EXIT_USAGE), indent=2))
            sys.exit(EXIT_USAGE)
        super().error(message)
