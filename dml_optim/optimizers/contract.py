"""The rest of torch.optim's ``Optimizer`` contract, for a flat optimizer.

:class:`ContractMixin` (a part of :class:`~dml_optim.optimizers.base.FlatOptimizer`):

* named parameters (``model.named_parameters()``, torch >= 2.6's rules, on
  any torch) and parameters listed twice in a group (warned about, kept once);
* ``state_dict()`` / ``load_state_dict()`` with torch's four hook kinds run
  where torch runs them (:mod:`~dml_optim.optimizers.state_dict` does the work);
* copying and pickling (``copy.deepcopy``, ``torch.save``): every attribute
  but the hooks, and each parameter a view of its copied flat buffer again.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable

import torch

from dml_optim.core.flat import describe_param

__all__ = ["ContractMixin", "ParamList"]


class ParamList(list):
    """A param group's ``params``: a list that notes its own changes in place (``append``, ``pop``, ``params[i] =
    p``, ...).  torch.optim reads the list at every step; the flat buffers were packed from it once, so a change
    would be ignored: :meth:`ContractMixin._check_params` refuses the next step instead."""

    __slots__ = ("changed",)

    def __init__(self, items=()):
        super().__init__(items)
        self.changed = False

    def __reduce_ex__(self, protocol):  # (a copy is built whole, not appended to: it starts unchanged)
        return ParamList, (list(self),)


def _noting(name: str):
    method = getattr(list, name)

    def change(self, *args, **kwargs):
        self.changed = True
        return method(self, *args, **kwargs)

    change.__name__ = change.__qualname__ = name
    return change


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__",
              "__iadd__", "__imul__"):
    setattr(ParamList, _name, _noting(_name))


class ContractMixin:
    """torch.optim's contract beyond ``step`` (see the module docstring)."""

    def _keep_params(self, group: dict[str, Any], params: list) -> None:
        """Set ``group["params"]`` to a :class:`ParamList` of ``params`` and remember them (add_param_group)."""
        group["params"] = ParamList(params)
        seen = self.__dict__.setdefault("_params_seen", [])
        del seen[len(self.param_groups):]  # (a group whose adding failed after this left its entry: replaced)
        seen.append(tuple(params))

    def _check_params(self) -> None:
        """Refuse a step, or a state dict, after ``param_groups`` or a group's ``params`` changed other than by
        ``add_param_group`` (O(1) a group when nothing did: the lists note their changes); a list changed
        back to the same parameters in the same order, or replaced by an equal one, is taken as it is."""
        groups, seen = self.param_groups, self.__dict__.get("_params_seen", ())
        if len(groups) != len(self._layout):
            raise RuntimeError(f"dml_optim: param_groups has {len(groups)} groups, {len(self._layout)} were added "
                               "by add_param_group(); add groups with add_param_group(), which packs their parameters")
        for gi, (group, known) in enumerate(zip(groups, seen)):
            params = group.get("params")
            if type(params) is ParamList and not params.changed:
                continue
            if not isinstance(params, (list, tuple)):
                change = f"it is a {type(params).__name__} now"
            elif len(params) != len(known):
                change = f"it held {len(known)} parameters when packed, {len(params)} now"
            else:
                same = list(map(operator.is_, params, known))
                change = None if all(same) else f"['params'][{same.index(False)}] is another tensor now"
            if change is not None:
                raise RuntimeError(
                    f"dml_optim: param_groups[{gi}]['params'] was changed after it was packed ({change}): its flat "
                    "buffers hold the parameters it was packed with. Add parameters with add_param_group(), or build "
                    "a new optimizer over the new parameters and load_state_dict() the state of those that stay")
            group["params"] = ParamList(params)

    def _named(self, group: dict[str, Any], params: list, gi: int) -> list:
        """Split ``(name, tensor)`` pairs (``model.named_parameters()``) into ``params`` and
        ``group["param_names"]``, with torch.optim's rules (torch >= 2.6; accepted on any torch here):
        all parameters of a group named or none, and all groups alike."""
        where = f"params: param_groups[{gi}]"
        if any(isinstance(p, tuple) for p in params):
            bad = next((i for i, p in enumerate(params) if not (isinstance(p, tuple) and len(p) == 2)), None)
            if bad is not None:
                raise ValueError(f"{where}: all optimizer params should be with/without names. Some param names are "
                                 f"missing (['params'][{bad}] is a {type(params[bad]).__name__}, others are "
                                 "(name, tensor) pairs)")
            names = [p[0] for p in params]
            if not all(isinstance(n, str) for n in names):
                raise TypeError(f"{where}: parameter names must be strings, got {next(n for n in names if not isinstance(n, str))!r}")
            group["param_names"] = names
            params = [p[1] for p in params]
        elif "param_names" in group:
            names = group["param_names"]
            if not isinstance(names, (list, tuple)) or len(names) != len(params) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{where}: param_names must be a list of {len(params)} strings, got {names!r}")
            group["param_names"] = list(names)
        for other in self.param_groups:
            if ("param_names" in group) != ("param_names" in other):
                kind = "with names" if "param_names" in group else "without names"
                raise ValueError(f"{where}: all optimizer param groups should be with/without names. cannot add "
                                 f"param group {kind} to the optimizer")
        return params

    def _deduplicated(self, group: dict[str, Any], params: list, gi: int) -> list:
        """``params`` without repeats, with a warning, as torch.optim warns (a flat buffer holds each
        parameter once; torch keeps both entries and steps the parameter twice per step); a parameter
        of another group is a ``ValueError``, as in torch.optim."""
        first: dict[int, int] = {}
        keep = []
        for i, p in enumerate(params):
            if id(p) in first:
                warnings.warn(f"params: param_groups[{gi}] lists the same parameter twice (['params'][{first[id(p)]}] "
                              f"and ['params'][{i}]): optimizer contains a parameter group with duplicate parameters; "
                              "dml_optim keeps the first and drops the repeat", UserWarning, stacklevel=4)
                continue
            first[id(p)] = i
            keep.append(i)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"params: some parameters appear in more than one parameter group "
                                 f"({describe_param(p, i, gi)})")
        if len(keep) < len(params) and "param_names" in group:
            group["param_names"] = [group["param_names"][i] for i in keep]
        return [params[i] for i in keep]

    # -- state dict ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (``state`` by parameter index, ``param_groups``),
        plus ``dml_optim: {"format_version": 1, "optimizer": <class name>}``.

        Contains only tensors and plain Python values, so
        ``torch.load(..., weights_only=True)`` loads it.  State tensors are
        views of the flat buffers (torch.save stores each buffer once); for
        distributed (DTensor) parameters they are DTensors with the
        parameter's sharding.
        """
        from dml_optim.optimizers.state_dict import save

        for hook in self._hooks("_optimizer_state_dict_pre_hooks"):
            hook(self)
        state_dict = save(self)
        for hook in self._hooks("_optimizer_state_dict_post_hooks"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of the torch.optim equivalent.

        Everything is checked before anything is written.  State tensors are
        cast to this optimizer's state dtype and device (a checkpoint saved on
        CUDA in float32 loads into a DirectML float16 optimizer and back).
        """
        from dml_optim.optimizers.state_dict import load

        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch.optim: a pre-hook may edit it
        for hook in self._hooks("_optimizer_load_state_dict_pre_hooks"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.forget_steady()
        load(self, state_dict)
        for hook in self._hooks("_optimizer_load_state_dict_post_hooks"):
            hook(self)

    def _hooks(self, name: str) -> list[Callable]:
        """torch.optim's registered hooks of one kind, in their order (``register_*_hook``, torch >= 2.1)."""
        return list(getattr(self, name, {}).values())

    # -- copying and pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything but torch.optim's hooks (which torch.optim does not copy either).

        torch.optim pickles only ``defaults``, ``state`` and ``param_groups``;
        ours keeps every attribute (the flat buffers, step counts, ``atomic``,
        ``checks``, ``pack_via``, ``repeat``, ...), so ``copy.deepcopy`` and
        ``torch.save``/``torch.load(weights_only=False)`` give a working optimizer.
        A copy copies every flat buffer (parameters, gradients, states).
        """
        return {k: v for k, v in self.__dict__.items()
                if not (k.startswith("_optimizer_") and k.endswith("_hooks")) and k != "_owner"}  # (a copy: its own)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # torch.optim: empty hooks, the step wrapper
        self.forget_steady()  # (the next step plans from scratch)
        self.__dict__.setdefault("repeat", True)  # (pickled before the option existed)
        if "_layout" in state:
            self._rebind_copy()

    def _rebind_copy(self) -> None:
        """After a copy: make each parameter a view of its (copied) flat buffer again.

        ``copy.deepcopy`` of an ``nn.Parameter`` clones its values into a new
        storage (``Parameter.__deepcopy__``), so the copied parameters are not
        views of the copied buffer; their values are the truth and are copied
        in.  Pickled parameters come back as views already (``torch.save``
        keeps shared storages), and nothing is copied; on a device without
        storage (DirectML) each tensor is copied on its own, and so is each
        parameter's values.
        """
        with torch.no_grad():
            for layout in self._layout:
                for flat in layout.buffers:
                    if flat.staged:
                        continue
                    home = flat.data.untyped_storage().data_ptr() if not flat.opaque else None
                    base = flat.data.storage_offset()
                    for i, (p, view) in enumerate(zip(flat.params, flat.views(flat.data))):
                        if (home is not None and p.untyped_storage().data_ptr() == home
                                and p.storage_offset() == base + flat.offsets[i]
                                and p.is_contiguous() and p.shape == view.shape):
                            continue
                        if p.shape == view.shape and p.dtype == view.dtype and p.device == view.device:
                            view.copy_(p.detach())
                            p.data = view
                    flat.rebind_pointers()



