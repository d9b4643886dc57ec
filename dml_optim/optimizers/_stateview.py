"""``optimizer.state`` as a live view of the flat buffers.

torch.optim keeps ``optimizer.state[p]`` as a dict of tensors, and users and
tools (``ZeroRedundancyOptimizer.load_state_dict``, inspection code) read and
assign it.  Here the states live in flat buffers, so ``optimizer.state`` is a
mapping whose entries are made on demand:

* ``opt.state[p]["exp_avg"]`` is a view of the flat state buffer (in-place
  edits change the optimizer); ``opt.state[p]["step"]`` is a float tensor of
  that parameter's completed steps, as in torch.optim;
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

__all__ = ["StateView", "ParamStateView"]


class ParamStateView(dict):
    """The state of one parameter: a snapshot dict whose assignments write through."""

    def __init__(self, opt, group, flat, index: int):
        super().__init__(opt._param_state(group, flat, index))
        self._where = (opt, group, flat, index)

    def __setitem__(self, key: str, value) -> None:
        opt, group, flat, i = self._where
        if key == "step":
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(f"state['step'] must be a scalar, got a tensor of shape {tuple(value.shape)}")
            count = value.item() if isinstance(value, torch.Tensor) else value
            if (isinstance(count, bool) or not isinstance(count, numbers.Real) or not math.isfinite(count)
                    or not float(count).is_integer() or count < 0):
                raise ValueError(f"state['step'] must be a non-negative whole number, got {value!r}")
            opt._ensure_state(group, flat)
            flat.steps[i] = int(count)
            if flat.device_steps is not None:
                flat.device_steps[i].fill_(int(count))
                flat.step_history[i] = int(count)
        elif key in opt.state_names or (key == "master_param" and flat.master is not None):
            if not isinstance(value, torch.Tensor) or value.shape != flat.params[i].shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"state[{key!r}] must be a tensor of shape {tuple(flat.params[i].shape)}, got {shape}")
            opt._ensure_state(group, flat)
            buffer = flat.master if key == "master_param" else flat.states[key]
            flat.views(buffer)[i].copy_(value)
        else:
            raise KeyError(f"{type(opt).__name__} has no state {key!r} (it keeps {', '.join(('step',) + opt.state_names)})")
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

    def _locate(self, p):
        for group, flats in zip(self._opt.param_groups, self._opt._flats):
            for flat in flats:
                for i, q in enumerate(flat.params):
                    if q is p:
                        return group, flat, i
        raise KeyError(f"not a parameter of this optimizer: tensor of shape {tuple(getattr(p, 'shape', ()))}")

    def __getitem__(self, p) -> ParamStateView:
        return ParamStateView(self._opt, *self._locate(p))

    def __setitem__(self, p, value: Mapping[str, Any]) -> None:
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[p] must be assigned a mapping, got {type(value).__name__}")
        view = self[p]
        for key, item in value.items():
            view[key] = item

    def __delitem__(self, p) -> None:
        raise TypeError("optimizer.state entries cannot be deleted: the states live in flat buffers")

    def __iter__(self) -> Iterator[torch.Tensor]:
        for flats in self._opt._flats:
            for flat in flats:
                if not flat.states:
                    continue
                steps = self._opt._step_counts(flat)
                yield from (p for p, n in zip(flat.params, steps) if n)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state)"
