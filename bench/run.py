#!/usr/bin/env python3
"""Optimizer-step benchmark: ``python bench/run.py [--quick] [--device cpu|cuda|privateuseone] [--out FILE]``.

The same as ``dml-optim bench`` (the logic lives in the package ``dml_optim/benchmark/``);
this script only makes it runnable from a source checkout without installing.
See ``bench/README.md`` for the method and the fields of the JSON it writes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dml_optim.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
