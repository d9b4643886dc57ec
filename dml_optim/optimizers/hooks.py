"""``step()``'s wrapper: torch.optim's step hooks, and the profiler's range only while a profiler runs.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``): the global and the
instance's step pre- and post-hooks around the call, all inside ``record_function("Optimizer.step#<class>.step")``.
That range costs about 15 us a step with no profiler listening (the 2-core VM, torch 2.13: a tenth of the
host time of an eager step of one tensor, what DirectML's path pays every step).  :func:`hook_step` wraps
``FlatOptimizer.step`` once, marked ``hooked`` so that torch does not wrap it again: while a profiler (or
``emit_nvtx`` / ``emit_itt``) runs, and while dynamo traces the step, the call goes through torch's own wrapper, range and hooks as torch.optim
has them; otherwise the same hooks, in the same order, with the same argument rewriting, without the range.
A subclass that overrides ``step`` gets torch's wrapper on its own ``step`` (torch wraps it at construction); its
``super().step()`` then runs no hooks a second time.  A torch without the hook tables this reads (none known) keeps torch's wrapper for every call.

May import: torch, dml_optim.backends.modes.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Callable

import torch
from torch.optim import optimizer as _torch_optimizer

from dml_optim.backends.modes import is_compiling

__all__ = ["hook_step"]

_PROFILING = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
_GLOBAL_PRE = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)


def hook_step(func: Callable) -> Callable:
    """``func`` (an optimizer's ``step``) with torch.optim's step hooks; see the module docstring."""
    profiled = torch.optim.Optimizer.profile_hook_step(func)
    if _PROFILING is None or _GLOBAL_PRE is None or _GLOBAL_POST is None:
        profiled.hooked = True
        return profiled

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if type(self).step is not step:  # (a subclass's own step, which torch wrapped, called this: its hooks ran)
            return func(self, *args, **kwargs)
        if is_compiling() or _PROFILING():
            return profiled(self, *args, **kwargs)
        pre, post = self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks
        if not (pre or post or _GLOBAL_PRE or _GLOBAL_POST):  # (the common case: no hook at all)
            out = func(self, *args, **kwargs)
            self._optimizer_step_code()
            return out
        args = (self, *args)
        for hook in chain(_GLOBAL_PRE.values(), pre.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
        out = func(*args, **kwargs)
        self._optimizer_step_code()
        for hook in chain(post.values(), _GLOBAL_POST.values()):
            hook(self, args, kwargs)
        return out

    step.hooked = True
    return step
