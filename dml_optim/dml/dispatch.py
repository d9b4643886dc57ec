"""How torch-directml 0.2.5 resolves each aten operator on its device.

The table ships as ``dml_optim/data/torch-directml-dispatch.tsv`` (read from
the real dispatcher of torch 2.4.1 + torch-directml 0.2.5.dev240914): for each
overload, ``native``, ``native via aten::X.out`` (a structured op whose ``.out``
kernel is native), ``fallback`` (runs on the CPU, tensors copied each way),
``fallback via ...``, ``composite`` (decomposes into other ops) or
``structured``.  It is the ground truth for "does this op fall back to the CPU
on DirectML".
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

__all__ = ["dispatch_table", "resolution", "is_native", "is_fallback", "foreach_element_op"]


@lru_cache(maxsize=1)
def dispatch_table() -> dict[str, str]:
    """``{"aten::mul_.Tensor": "native via aten::mul.out", ...}``."""
    text = resources.files("dml_optim").joinpath("data/torch-directml-dispatch.tsv").read_text()
    table = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        op, _, how = line.partition("\t")
        table[op] = how.strip()
    return table


def _normalize(op: str) -> str:
    op = op if op.startswith("aten::") else f"aten::{op}"
    if "." not in op.split("::", 1)[1]:
        return op
    return op.removesuffix(".default")


def resolution(op: str) -> str:
    """The table's entry for ``op`` (``"aten::add_.Tensor"``, ``"add_.Tensor"`` or
    an ``OpOverload`` name such as ``"aten.add_.Tensor"``); ``"unknown"`` if absent."""
    op = op.replace("aten.", "aten::", 1) if op.startswith("aten.") else op
    return dispatch_table().get(_normalize(op), "unknown")


def is_native(op: str) -> bool:
    return resolution(op).startswith("native")


def is_fallback(op: str) -> bool:
    return resolution(op).startswith("fallback")


_FOREACH_OVERLOAD = {"List": "Tensor", "Scalar": "Scalar", "ScalarList": "Scalar", "Tensor": "Tensor", "": ""}


def foreach_element_op(op: str) -> str | None:
    """The per-tensor op a ``_foreach_*`` op decomposes into on DirectML.

    torch-directml has no foreach kernels: ``aten::_foreach_lerp_.Scalar`` runs as
    one ``aten::lerp_.Scalar`` per tensor.  Returns None for a non-foreach op.
    """
    op = _normalize(op.replace("aten.", "aten::", 1) if op.startswith("aten.") else op)
    name = op.split("::", 1)[1]
    if not name.startswith("_foreach_"):
        return None
    base, _, overload = name[len("_foreach_"):].partition(".")
    element = f"aten::{base}"
    mapped = _FOREACH_OVERLOAD.get(overload, overload)
    candidates = [f"{element}.{mapped}"] if mapped else []
    candidates += [element, f"{element}.Tensor", f"{element}.Scalar"]
    table = dispatch_table()
    for cand in candidates:
        if cand in table:
            return cand
    return candidates[0] if candidates else element
