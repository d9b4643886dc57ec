"""Allocating a flat buffer's states: the first step, a re-pack, a load, a state read before any step.

:func:`ensure_state` gives a buffer every state its group's settings keep (AdamW's AMSGrad adds one), the
FP32 master copy (``master_weights``) and the Kahan compensation buffer (``kahan``), each in the dtype
:mod:`dml_optim.core.dtypes` rules; the precision they were allocated with is recorded on the buffer
(changing it afterwards is refused by the next step).
"""

from __future__ import annotations

import torch

from dml_optim.core.dtypes import master_dtype, precision, state_dtype
from dml_optim.core.quant import QuantizedState, format_for

__all__ = ["ensure_state", "new_state"]


def ensure_state(cls, group, flat) -> None:
    """Allocate the flat states, master copy and compensation buffer of ``flat`` for optimizer class ``cls``
    under ``group``'s settings, where missing (first step, or after a re-pack)."""
    names = cls.group_state_names(group)
    if flat.precision is not None and all(n in flat.states for n in names):
        return
    flat.precision = precision(group)
    with torch.no_grad():
        for name in names:
            if name not in flat.states:
                flat.states[name] = new_state(cls, group, flat, name)
        if group["master_weights"] and flat.master is None:
            flat.master = flat.data.to(master_dtype(group, flat.dtype))
        if group["kahan"] and flat.kahan is None:
            flat.kahan = torch.zeros(flat.numel, dtype=flat.dtype, device=flat.device)
    flat.scratch = []


def new_state(cls, group, flat, name: str):
    """A fresh flat state (its initial value everywhere): a tensor of the state dtype, or, in a
    quantized buffer, a :class:`~dml_optim.core.quant.QuantizedState` (signed unless ``unsigned_states``)."""
    value = cls.initial_state(group, name)
    if flat.bits:
        return QuantizedState.full(flat.numel, value, format_for(flat.bits, signed=name not in cls.unsigned_states),
                                   flat.device)
    return torch.full((flat.numel,), value, dtype=state_dtype(group, flat.dtype), device=flat.device)
