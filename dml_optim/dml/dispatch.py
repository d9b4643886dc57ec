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

from collections import Counter
from functools import lru_cache
from importlib import resources

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["dispatch_table", "resolution", "is_native", "is_fallback", "foreach_element_op", "Resolver", "kind_of",
           "to_meta", "overload_of"]

_MAX_DEPTH = 4


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


# -- resolving an op with the table, through decompositions -------------------------------


def kind_of(how: str) -> str:
    """``native``, ``fallback``, ``composite`` or ``unknown`` for a table entry."""
    for kind in ("native", "fallback", "composite"):
        if how.startswith(kind):
            return kind
    return "unknown"


def overload_of(name: str):
    """``"aten::mul_.Scalar"`` → ``torch.ops.aten.mul_.Scalar`` (None if absent)."""
    base, _, overload = name.split("::", 1)[1].partition(".")
    try:
        return getattr(getattr(torch.ops.aten, base), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


class _NameRecorder(TorchDispatchMode):
    """Records the ops a decomposition calls (run on meta tensors), with one example call each."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        self.names.append(name)
        self.calls.setdefault(name, (func, args, kwargs))
        return func(*args, **kwargs)


def _decomposition(func, args, kwargs) -> tuple[list[str], dict[str, tuple]] | None:
    """The ops ``func``'s composite kernel calls (names, and one example call
    ``(func, args, kwargs)`` per name), run on meta copies of the arguments."""
    keys = torch._C.DispatchKey
    name = func.name()
    for key in ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            continue
        margs, mkwargs = to_meta(list(args)), to_meta(dict(kwargs))
        if "device" in mkwargs:
            mkwargs["device"] = torch.device("meta")
        recorder = _NameRecorder()
        try:
            with recorder:
                func._op_dk(getattr(keys, key), *margs, **mkwargs)
        except Exception:  # a kernel that cannot run on meta: leave the op composite
            return None
        return recorder.names, recorder.calls
    return None


class Resolver:
    """Resolves op names for DirectML (composites through their decomposition), cached by name.

    ``resolver(name, func, args, kwargs) -> (kind, text)``: kind is ``native``,
    ``fallback``, ``composite`` or ``unknown``.  An op the table marks
    ``composite`` is resolved through what it decomposes into: its
    ``CompositeExplicitAutograd`` (or implicit) kernel is run on ``meta``
    copies of its arguments under a second recorder, and the ops it calls are
    resolved in turn (``slice.Tensor`` → ``as_strided``: native).
    """

    def __init__(self):
        self._cache: dict[str, tuple[str, str]] = {}

    def __call__(self, name: str, func=None, args=(), kwargs=None, depth: int = 0) -> tuple[str, str]:
        """``(kind, text)``: kind is native/fallback/composite/unknown."""
        if name in self._cache:
            return self._cache[name]
        how = resolution(name)
        kind = kind_of(how)
        if kind == "composite" and depth < _MAX_DEPTH:
            func = func if func is not None else overload_of(name)
            inner = _decomposition(func, args, kwargs or {}) if func is not None else None
            if inner is not None:
                kind, how = self._combine(*inner, depth)
        result = (kind, how)
        if func is not None or kind != "composite":
            self._cache[name] = result
        return result

    def _combine(self, inner: list[str], calls: dict[str, tuple], depth: int) -> tuple[str, str]:
        if not inner:
            return "native", "composite → no kernel (metadata only)"
        parts, kinds = [], []
        for sub, n in Counter(inner).items():
            func, args, kwargs = calls[sub]
            k, how = self(sub, func, args, kwargs, depth=depth + 1)
            kinds.append(k)
            parts.append(f"{'%d x ' % n if n > 1 else ''}{sub} ({how})")
        kind = "fallback" if "fallback" in kinds else "native" if all(k == "native" for k in kinds) else (
            "unknown" if "unknown" in kinds else "composite")
        return kind, "composite → " + ", ".join(parts)
