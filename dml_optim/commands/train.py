"""``dml-optim train``: placeholder until its issue lands."""

from __future__ import annotations

HELP = "(not implemented yet)"


def add_parser(sub):
    p = sub.add_parser("train", help=HELP, description=HELP)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    raise NotImplementedError("dml-optim train is not implemented yet")
