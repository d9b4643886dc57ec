"""Choosing how a rule runs over a flat buffer: ``eager`` or ``compiled``.

``eager`` is the DirectML-native op chain of :mod:`dml_optim.functional`
(always used on DirectML).  ``compiled`` (CPU, CUDA) fuses the same rule into
one kernel with ``torch.compile``.  ``auto`` picks per device and buffer size.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["resolve", "rule_runner"]

Runner = Callable[..., None]


def resolve(backend: str, device, numel: int) -> str:
    """The concrete backend (``"eager"`` or ``"compiled"``) for a flat buffer."""
    if backend == "compiled":
        return "compiled"
    return "eager"


def rule_runner(opt, group: dict[str, Any], flat) -> Runner:
    """A callable ``(x, g, states, scalars, scratch) -> None`` applying ``opt``'s rule."""
    return opt._rule
