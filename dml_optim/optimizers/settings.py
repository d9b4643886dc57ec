"""A param group's settings as a step sees them: unchanged, changed in scalars only, or changed in structure.

A step validates a group's settings only when they changed since they were last validated
(:func:`unchanged`: two C-level passes).  Two tokens stand for validated settings (compared by identity):

* the **settings token** (``GroupLayout.checked``): a new one at every change, a scheduler's new ``lr``
  included; what the host scalars of a step are kept under;
* the **structure token** (``GroupLayout.structure``): a new one only when something other than a float
  hyperparameter's value changed (an exact zero counts: it removes ops), so that a scheduler changing
  ``lr`` every step keeps the backend's decision, kernel keys and argument lists
  (:mod:`dml_optim.backends.choose`).

:func:`changed_scalars` recognizes the scheduler's case cheaply: the same keys, only float hyperparameters
that no torch name aliases changed (``lr`` in every optimizer), each validated alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["items", "unchanged", "structure_of", "changed_scalars"]

_MISSING = object()
_FREE: dict[type, tuple[frozenset, frozenset, dict]] = {}


def items(group: dict) -> tuple:
    """A group's settings as :func:`unchanged` compares them: a shallow copy of the group (keys and values)
    and the values' types, in order (True == 1.0: types count)."""
    return dict(group), list(map(type, group.values()))


def unchanged(group: dict, checked: tuple | None) -> bool:
    """``group``'s settings are the ones recorded as ``checked`` (:func:`items`): the same keys with equal
    values of the same types.

    Two C-level passes, the cheapest found (about 0.7 us for 21 settings, where three tuples of keys, values
    and types cost 1.1): dict ``==`` tries ``is`` before ``__eq__``, so the unchanged ``params`` list (whose
    contents are the layout's business) and unchanged values cost a pointer comparison each; then the
    types.  The same settings in another key order may read as changed (validated again, harmlessly).
    """
    if checked is None:
        return False
    try:
        return group == checked[0] and list(map(type, group.values())) == checked[1]
    except (RuntimeError, TypeError):  # a tensor value compared element-wise: revalidate
        return False


def _free(cls) -> tuple[frozenset, frozenset, dict]:
    """``(floats, free, by name)``: the class's float hyperparameters, those no torch name aliases, and the
    latter's :class:`~dml_optim.optimizers.spec.Hyperparameter` by name."""
    found = _FREE.get(cls)
    if found is None:
        spec = cls.spec
        aliased = {n for a in spec.torch.aliases for n in a.ours}
        floats = frozenset(h.name for h in spec.hyperparameters if h.kind == "float")
        free = frozenset(floats - aliased)
        found = _FREE[cls] = (floats, free, {n: spec.hyperparameter(n) for n in free})
    return found


def structure_of(cls, group: dict) -> tuple | None:
    """The structural part of validated settings: every setting but ``params``, a float hyperparameter
    by whether it is zero, a torch name that stands for float hyperparameters left out (ours say it).
    None when a value cannot be compared (a tensor): such settings are never the same structure."""
    floats = _free(cls)[0]
    derived = {a.torch for a in cls.spec.torch.aliases if set(a.ours) <= floats}
    out = []
    for k, v in group.items():
        if k == "params" or k in derived:
            continue
        if isinstance(v, torch.Tensor):
            return None
        if k in floats:
            v = v == 0
        out.append((k, type(v), v))
    return tuple(out)


def changed_scalars(cls, group: dict, checked: tuple | None) -> dict[str, Any] | None:
    """The changed values of ``group`` since ``checked`` (:func:`items`), validated, when only float
    hyperparameters that no torch name aliases changed, to plain numbers of the same zero-ness (a
    scheduler's ``lr``); None otherwise (the full validation runs, and names what is wrong)."""
    if checked is None:
        return None
    old = checked[0]
    _, free, hyperparameters = _free(cls)
    changed = {}
    for k in free:  # (the few free floats: then one C-level comparison of everything else)
        v = group.get(k, _MISSING)
        o = old.get(k, _MISSING)
        if v is not o:
            if type(v) not in (float, int) or type(o) not in (float, int) or (o == 0) != (v == 0):
                return None
            changed[k] = v
    if not changed:
        return None
    try:  # (everything else the same, of the same types: True == 1, but a bool option is no number)
        if {**old, **changed} != group or list(map(type, group.values())) != checked[1]:
            return None
    except (RuntimeError, TypeError):  # (a tensor value compared element-wise)
        return None
    spec = cls.spec
    try:
        checked_values = {k: hyperparameters[k].check(v) for k, v in changed.items()}
    except (TypeError, ValueError):
        return None
    if spec.constraints:
        candidate = {**group, **checked_values}
        if not all(holds(candidate) for holds, _ in spec.constraints):
            return None
    return checked_values
