"""The ``dml-optim`` command line: a thin layer over the library.

Each subcommand lives in ``dml_optim/commands/<name>.py`` and provides
``add_parser(subparsers)`` (which registers its arguments and sets ``run``)
and ``run(args) -> int``.  This module only wires them together, turns usage
errors into one line on stderr with exit status 2, and makes sure no command
ever ends in a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from dml_optim.commands import UsageError

__all__ = ["main", "build_parser", "UsageError", "COMMANDS"]

#: Subcommands in the order ``--help`` lists them.
COMMANDS = ("train", "info", "validate", "audit", "compare", "bench")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``prog: error: message``, exit 2)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from dml_optim import __version__

    parser = _Parser(
        prog="dml-optim",
        description="DirectML-native training optimizers, a DirectML ADAM_OPTIMIZER "
        "descriptor validator, and FP16/FP32 optimizer-state comparisons.",
        epilog="Run 'dml-optim COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"dml-optim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"dml_optim.commands.{name}")
        module.add_parser(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The subcommand's parser (the top-level one without a command)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command that got them: `dml-optim info: error: ...`, like every other error
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:  # one line, whatever the message holds
        print(f"dml-optim {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dml-optim {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`dml-optim ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except Exception as exc:  # the promise: never a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"dml-optim {args.command}: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
