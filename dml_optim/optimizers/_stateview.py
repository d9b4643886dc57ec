"""``optimizer.state`` as a live view of the flat buffers.

torch.optim keeps ``optimizer.state[p]`` as a dict of tensors, and users and
tools (``ZeroRedundancyOptimizer.load_state_dict``, inspection code,
``torch.distributed.checkpoint``) read and assign it.  Here the states live in
flat buffers, so ``optimizer.state`` is a mapping whose entries are made on
demand:

* ``opt.state[p]["exp_avg"]`` is a view of the flat state buffer (in-place
  edits change the optimizer); a quantized state (``state_bits``) shows its
  decoded values, a copy (assign it back to change the optimizer); ``opt.state[p]["step"]`` is a float tensor of
  that parameter's completed steps, as in torch.optim; a parameter without
  state (not stepped yet, or frozen) gives an empty dict, as torch.optim's
  ``defaultdict`` does;
* assigning ``opt.state[p] = {...}`` or ``opt.state[p]["exp_avg"] = t``
  copies into the buffers (cast to the state dtype), and ``"step"`` sets the
  parameter's step count;
* iteration lists the parameters that have taken a step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, MutableMapping
from typing import Any, Iterator

import torch

from dml_optim.core.flat import local_tensor, param_piece, store_param_piece
from dml_optim.optimizers.state_dict import ABSMAX, CODES, EXTRA_STATES, param_state
from dml_optim.core.quant import QuantizedState
from dml_optim.optimizers.states import ensure_state

__all__ = ["StateView", "ParamStateView"]


class ParamStateView(dict):
    """The state of one parameter: a snapshot dict whose assignments write through."""

    def __init__(self, opt, gi: int, flat, index: int):
        counts = flat.counter.counts() if flat is not None else []
        super().__init__(param_state(opt, flat, index, counts[index], decoded=True) if flat is not None else {})
        self._where = (opt, gi, flat, index)

    def __setitem__(self, key: str, value) -> None:
        opt, gi, flat, i = self._where
        if flat is None:
            raise KeyError(f"{type(opt).__name__}: this parameter is frozen (requires_grad=False) and holds no state; "
                           "unfreeze it first (or load a state dict that has its state)")
        group = opt.param_groups[gi]
        names = type(opt).group_state_names(group)
        extras = {"master_param": flat.master, "kahan_comp": flat.kahan}
        if key == "step":
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(f"state['step'] must be a scalar, got a tensor of shape {tuple(value.shape)}")
            count = value.item() if isinstance(value, torch.Tensor) else value
            if (isinstance(count, bool) or not isinstance(count, numbers.Real) or not math.isfinite(count)
                    or not float(count).is_integer() or count < 0 or count > type(opt).max_step):
                raise ValueError(f"state['step'] must be a whole number in [0, {type(opt).max_step}], got {value!r}")
            ensure_state(type(opt), group, flat)
            counts = flat.counter.counts()
            counts[i] = int(count)
            flat.counter.set_counts(counts)
        elif key.endswith((CODES, ABSMAX)) and key[: -len(CODES if key.endswith(CODES) else ABSMAX)] in names:
            # a quantized state's codes or scales, as a state dict holds them (ZeRO's load_state_dict
            # assigns them back one by one): copied into the parameter's blocks, bit for bit
            name = key[: -len(CODES if key.endswith(CODES) else ABSMAX)]
            ensure_state(type(opt), group, flat)
            state = flat.states[name]
            if not isinstance(state, QuantizedState):
                raise KeyError(f"state[{key!r}]: {name!r} is not quantized in this optimizer (state_bits)")
            piece = param_piece(flat, state, i)
            target = piece.codes if key.endswith(CODES) else piece.scales
            value_local = local_tensor(value) if isinstance(value, torch.Tensor) else value
            if not isinstance(value_local, torch.Tensor) or value_local.shape != target.shape:
                got = tuple(value_local.shape) if isinstance(value_local, torch.Tensor) else type(value).__name__
                raise ValueError(f"state[{key!r}] must be a tensor of shape {tuple(target.shape)}, got {got}")
            with torch.no_grad():
                target.copy_(value_local)
        elif key in names or (key in EXTRA_STATES and extras[key] is not None):
            shape = flat.shapes[i]
            value_local = local_tensor(value) if isinstance(value, torch.Tensor) else value
            if not isinstance(value_local, torch.Tensor) or value_local.shape != shape:
                got = tuple(value_local.shape) if isinstance(value_local, torch.Tensor) else type(value).__name__
                raise ValueError(f"state[{key!r}] must be a tensor of shape {tuple(shape)}, got {got}")
            ensure_state(type(opt), group, flat)
            buffer = extras[key] if key in EXTRA_STATES else flat.states[key]
            store_param_piece(flat, buffer, i, value_local)  # (a quantized state: encoded)
        else:
            raise KeyError(f"{type(opt).__name__} has no state {key!r} (it keeps {', '.join(('step',) + names)})")
        super().__setitem__(key, value)

    def update(self, other=(), **kwargs) -> None:
        for key, value in dict(other, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


class StateView(MutableMapping):
    """``optimizer.state``: parameter → :class:`ParamStateView`, backed by the flat buffers."""

    def __init__(self, opt):
        self._opt = opt

    def __getitem__(self, p) -> ParamStateView:
        return ParamStateView(self._opt, *self._opt._locate(p))

    def __setitem__(self, p, value: Mapping[str, Any]) -> None:
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[p] must be assigned a mapping, got {type(value).__name__}")
        view = self[p]
        for key, item in value.items():
            view[key] = item

    def __delitem__(self, p) -> None:
        raise TypeError("optimizer.state entries cannot be deleted: the states live in flat buffers")

    def __iter__(self) -> Iterator[torch.Tensor]:
        for gi in range(len(self._opt.param_groups)):
            for flat in self._opt._buffers_of(gi):
                if not flat.states:
                    continue
                yield from (p for p, n in zip(flat.params, flat.counter.counts()) if n)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state)"
