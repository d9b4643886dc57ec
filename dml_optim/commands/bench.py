"""``dml-optim bench``: placeholder until its issue lands."""

from __future__ import annotations

HELP = "(not implemented yet)"


def add_parser(sub):
    p = sub.add_parser("bench", help=HELP, description=HELP)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    raise NotImplementedError("dml-optim bench is not implemented yet")
