"""Subcommands of the ``dml-optim`` command line, one module each, and the one usage error they raise.

May import: core, dml, backends, optimizers, training, precision, job, benchmark, top.
"""

__all__ = ["UsageError"]


class UsageError(Exception):
    """A bad command-line value found after parsing: one line on stderr, exit status 2.

    Every subcommand raises it for a usage error found after argparse: a bad
    value, an unusable device, an unknown model, an output path it cannot
    write.  The message names the argument and the value.
    """
