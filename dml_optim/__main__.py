"""``python -m dml_optim`` runs the ``dml-optim`` command line."""

from dml_optim.cli import main

raise SystemExit(main())
