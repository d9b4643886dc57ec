"""Whether dynamo is tracing the caller: the one test of it, for the core and the backends.

Core code that a compiled kernel traces takes a different op chain there only where the eager op's form
costs the kernel work and the result is the same bit for bit (:func:`dml_optim.core.functional.axpy_`: an
``addcmul`` with a tensor coefficient traces as ``x + 1.0 * (y * c)``, a vector multiply by one that inductor
keeps; ``x + y * c`` is the same value), or where it decodes the same values without a table gather
(:mod:`dml_optim.core.quant`).
"""

from __future__ import annotations

import torch

__all__ = ["is_compiling"]

_IS_COMPILING = getattr(torch.compiler, "is_compiling", None) or getattr(torch._dynamo, "is_compiling", None)


def is_compiling() -> bool:
    """True while dynamo traces the caller (our compiled kernel, or a user's compiled training step)."""
    return bool(_IS_COMPILING and _IS_COMPILING())
