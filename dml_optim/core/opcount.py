"""Counting the ops a piece of code dispatches: the one definition the audit and the benchmarks share.

:class:`OpRecorder` is a ``TorchDispatchMode`` that records every aten op that
reaches the dispatcher below autograd.  Each event is classified:

* **op**: an aten op that does work (a kernel launch; on DirectML, a command
  recorded and submitted).  This is what "ops per step" means everywhere in
  dml-optim (audit, bench, README);
* **view**: an aten op whose outputs alias its inputs without writing
  (``view``, ``slice``, ``as_strided``, ``detach``, ...): metadata only, no
  kernel; counted separately;
* ops outside the ``aten`` namespace (``profiler::_record_function_*``, which
  ``torch.optim.Optimizer`` wraps around every step) are ignored.

A call of a compiled kernel (:mod:`dml_optim.backends.compiled`) is one op: with
``compiled=True`` the recorder lets the compiled backend run its kernel (outside
the recorder) and records it as ``dml_optim::compiled_kernel``; otherwise the
compiled backend runs its eager rule so that every op is seen (what the audit
wants: the op chain DirectML would run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

__all__ = ["OpEvent", "OpRecorder", "count_ops", "is_view", "COMPILED_KERNEL", "active_recorder"]

#: The name a compiled kernel call is recorded under.
COMPILED_KERNEL = "dml_optim::compiled_kernel"


def is_view(func) -> bool:
    """True for an op whose every output aliases an input without writing it (metadata only)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class OpEvent:
    """One recorded op: its name, the op overload (None for a compiled kernel), and whether it is a view."""

    name: str
    func: Any
    view: bool
    args: tuple = ()
    kwargs: dict | None = None
    out: Any = None


class OpRecorder(TorchDispatchMode):
    """Records the aten ops dispatched inside ``with recorder:``.

    ``compiled``: count each compiled-kernel call as one op (and let it run);
    otherwise the compiled backend runs eagerly under the recorder.
    Subclasses extend :meth:`on_op` (the audit tracks allocations and
    operands there).
    """

    def __init__(self, *, compiled: bool = False):
        super().__init__()
        self.compiled = compiled
        self.events: list[OpEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "aten":
            self.on_op(func, args, kwargs, out)
        return out

    def on_op(self, func, args, kwargs, out) -> None:
        """Record one aten op (override to inspect arguments and outputs)."""
        self.events.append(OpEvent(func.name(), func, is_view(func)))

    def run_compiled(self, fn: Callable[[], None], name: str = COMPILED_KERNEL) -> None:
        """Run a compiled kernel outside the recorder and record it as one op."""
        with _disable_current_modes():
            fn()
        self.events.append(OpEvent(name, None, False))

    # -- reading -----------------------------------------------------------------

    @property
    def ops(self) -> int:
        """Ops that do work (views excluded)."""
        return sum(1 for e in self.events if not e.view)

    @property
    def views(self) -> int:
        return sum(1 for e in self.events if e.view)

    def counts(self, views: bool = False) -> Counter:
        """Op name → calls (views only if ``views``)."""
        return Counter(e.name for e in self.events if e.view == views)


def active_recorder() -> OpRecorder | None:
    """The innermost active :class:`OpRecorder`, if it is the current dispatch mode."""
    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, OpRecorder) else None


def count_ops(step: Callable[[], Any], *, compiled: bool = True) -> int:
    """The ops (views excluded) one call of ``step`` dispatches; a compiled kernel call is one."""
    recorder = OpRecorder(compiled=compiled)
    with recorder:
        step()
    return recorder.ops

