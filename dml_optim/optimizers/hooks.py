"""``step()``'s wrapper: torch.optim's step hooks inside the profiler range ``Optimizer.step#<class>.step``, cheaply.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``): the global and the
instance's step pre- and post-hooks around the call, all inside ``record_function("Optimizer.step#<class>.step")``.
That context manager costs about 15 us a call alone on the 2-core VM (two dispatcher op calls and a Python
object, profiler or not), and 25-40 us of an eager step of one tensor (about 110 us), what DirectML's path pays
every step.
:func:`hook_step` wraps ``FlatOptimizer.step`` once, marked ``hooked`` so that torch does not wrap it again,
and does what torch's wrapper does (the same hooks, read from torch's tables at each call, in the same order,
with the same argument rewriting and error, ``_optimizer_step_code`` for the profiler's Python tracer) inside
the same range entered through the RecordFunction API directly (``_record_function_with_args_enter``: about
2 us alone, 12-24 us of that step: a range makes the ops inside it dearer), so profilers, ``emit_nvtx``/``emit_itt``
and execution-trace observers see it as they see torch's.  (Leaving the range out while no profiler runs saved
the rest, but an execution-trace or on-demand observer, which no Python flag shows, would lose it.)
While dynamo traces the step, torch's own wrapper runs (dynamo knows it).  A class whose ``step`` torch wrapped
(a subclass that overrides ``step``; torch wraps it at construction) has run the hooks when its
``super().step()`` reaches this wrapper, which then runs none again; a ``step`` decorated with
``functools.wraps`` (which copies ``hooked``) is not torch's wrapper, and this one runs the hooks.  A torch
without the API this reads (none known) keeps torch's wrapper for every call.

May import: torch, dml_optim.backends.modes.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Callable

import torch
from torch.optim import optimizer as _torch_optimizer

from dml_optim.backends.choose import is_compiling

__all__ = ["hook_step"]

_AUTOGRAD = getattr(torch._C, "_autograd", None)
_ENTER = getattr(_AUTOGRAD, "_record_function_with_args_enter", None)
_EXIT = getattr(_AUTOGRAD, "_record_function_with_args_exit", None)
_TABLES = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
#: The code every wrapper of torch's ``profile_hook_step`` runs (each wrapper is a new function of it).
_TORCH_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def _torch_wrapped(f, ours) -> bool:
    """Whether torch's step wrapper lies on the ``__wrapped__`` chain from a class's ``step`` ``f`` to ``ours``."""
    for _ in range(64):  # (a chain that never reaches ours ends at a function without __wrapped__)
        if f is None or f is ours:
            return False
        if getattr(f, "__code__", None) is _TORCH_WRAPPER:
            return True
        f = getattr(f, "__wrapped__", None)
    return False


def hook_step(func: Callable) -> Callable:
    """``func`` (an optimizer's ``step``) with torch.optim's step hooks and profiler range; see the module docstring."""
    profiled = torch.optim.Optimizer.profile_hook_step(func)
    if _ENTER is None or _EXIT is None or not all(hasattr(_torch_optimizer, name) for name in _TABLES):
        profiled.hooked = True
        return profiled

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        outer = type(self).step
        if outer is not step and _torch_wrapped(outer, step):  # (the subclass's wrapper ran the hooks)
            return func(self, *args, **kwargs)
        if is_compiling():
            return profiled(self, *args, **kwargs)
        handle = _ENTER(f"Optimizer.step#{type(self).__name__}.step")
        try:
            args = (self, *args)
            for hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(),
                              self._optimizer_step_pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(
                            f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            for hook in chain(self._optimizer_step_post_hooks.values(),
                              _torch_optimizer._global_optimizer_post_hooks.values()):
                hook(self, args, kwargs)
            return out
        finally:
            _EXIT(handle)

    step.hooked = True
    return step
