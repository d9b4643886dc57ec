"""What the caller is in the middle of: a dynamo trace, a dispatch mode (an op recorder, a FLOP counter).

While dynamo traces the caller, or a ``TorchDispatchMode`` other than the op counter that counts compiled
kernels is active, every backend runs the eager rule (so the mode sees real ops, and dynamo traces the
op chain): :func:`eager_only_now`.
"""

from __future__ import annotations

from torch.utils import _python_dispatch

from dml_optim.core.tracing import is_compiling

__all__ = ["is_compiling", "dispatch_mode_active", "counting_kernels", "eager_only_now"]


def dispatch_mode_active() -> bool:
    """A ``TorchDispatchMode`` (op recorder, FLOP counter, FakeTensorMode, ...) is active.

    Then the eager rule runs, so the mode sees real ops; a compiled call under
    a mode would make dynamo skip the frame for good.  (``_get_current_dispatch_mode()`` is not None exactly
    when the mode stack, infrastructure modes included, is not empty: asked directly, one C call.)
    """
    return _python_dispatch._len_torch_dispatch_stack() > 0


def counting_kernels():
    """The active op recorder that counts compiled kernels (``OpRecorder(compiled=True)``), or None."""
    if _python_dispatch._get_current_dispatch_mode() is None:
        return None
    from dml_optim.core.opcount import active_recorder

    recorder = active_recorder()
    return recorder if recorder is not None and recorder.compiled else None



def eager_only_now() -> bool:
    """Only the eager rule may run now: dynamo traces the caller, or a dispatch mode other than the op
    counter that counts compiled kernels is active."""
    return is_compiling() or (dispatch_mode_active() and counting_kernels() is None)
