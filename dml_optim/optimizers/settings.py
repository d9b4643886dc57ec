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

__all__ = ["items", "unchanged", "structure_of", "changed_scalars", "tensors_given", "moved", "watch"]

_MISSING = object()
_FREE: dict[type, tuple[frozenset, frozenset, dict]] = {}
_PLAIN = frozenset({float, int, bool, str, type(None)})  # (setting types that are no tensor, at a glance)


def items(group: dict) -> tuple:
    """A group's settings as :func:`unchanged` compares them: a shallow copy of the group (keys and values)
    and the values' types, in order (True == 1.0: types count)."""
    return dict(group), list(map(type, group.values()))


def _versions(value) -> tuple | None:
    """The version counters of a setting given as a tensor, or as a tuple of tensors (``betas``); None for
    any other value."""
    if isinstance(value, torch.Tensor):
        return (value._version,)
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(v._version for v in value)
    return None


def tensors_given(group: dict, watched: tuple = ()) -> dict[str, Any]:
    """The settings of ``group`` given as tensors (``lr=torch.tensor(1e-3)``, ``betas`` of two tensors), before
    validation writes them into the group as numbers, and those ``watched`` before whose key still holds the
    number written from them: ``{key: tensor}`` (:func:`watch`)."""
    sources = {k: src for k, src, _, written in watched if group.get(k) is written}
    for k, v in group.items():
        if type(v) not in _PLAIN and k != "params" and _versions(v) is not None:
            sources[k] = v
    return sources


def watch(group: dict, sources: dict[str, Any]) -> tuple:
    """What to watch after ``group`` was validated and written: each tensor setting of ``sources``
    (:func:`tensors_given`, read before the write) as ``(key, tensor, versions, number written)``.  torch.optim
    keeps such a tensor in the group, so that ``lr.fill_(x)`` (the caller's, or a scheduler's on a tensor
    ``lr``) takes effect at the next step: :func:`moved` finds it."""
    return tuple((k, src, _versions(src), group.get(k)) for k, src in sources.items())


def moved(group: dict, watched: tuple) -> dict[str, Any]:
    """The watched tensor settings written into in place since they were validated, whose key still holds the
    number written from them: ``{key: tensor}``, to validate again (:func:`watch`)."""
    return {k: src for k, src, versions, written in watched if group.get(k) is written and _versions(src) != versions}


def unchanged(group: dict, checked: tuple | None, watched: tuple = ()) -> bool:
    """``group``'s settings are the ones recorded as ``checked`` (:func:`items`): the same keys with equal
    values of the same types.

    Two C-level passes, the cheapest found (about 0.7 us for 21 settings, where three tuples of keys, values
    and types cost 1.1): dict ``==`` tries ``is`` before ``__eq__``, so the unchanged ``params`` list (whose
    contents are the layout's business) and unchanged values cost a pointer comparison each; then the
    types.  The same settings in another key order may read as changed (validated again, harmlessly).
    ``watched``: the tensor settings (:func:`watch`); one written into in place is a change.
    """
    if checked is None or (watched and moved(group, watched)):
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
