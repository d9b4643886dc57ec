"""Subcommands of the ``dml-optim`` command line, one module each."""
