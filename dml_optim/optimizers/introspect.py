"""A public look inside a flat optimizer: :class:`BufferInfo`, one per flat buffer (``opt.flat_buffers()``).

What tests, benchmarks and curious users need to see without touching private attributes: each
buffer's tensors (views, not copies), its step counts and classes, the backend it runs, how many
times that backend was decided, whether its last step repeated the one before, and its eager time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dml_optim.backends.choose import resolved_backend, runtime

__all__ = ["BufferInfo", "buffer_infos"]


@dataclass(frozen=True)
class BufferInfo:
    """A read-only description of one flat buffer (:meth:`FlatOptimizer.flat_buffers`).

    The tensors are the optimizer's own flat tensors (views, not copies):
    reading them is free, writing them changes the optimizer.  ``step_counts``
    (completed steps per packed parameter, in buffer order, which is
    ``param_indices``' order) reads the device counters when the counts live
    there (a host sync).

    What the backends decided (:mod:`dml_optim.backends`): ``backend``, what the
    buffer runs now (:func:`~dml_optim.backends.choose.resolved_backend`);
    ``decisions``, how many times its backend was decided (once per change of
    the group's structural settings: a scheduler's new ``lr`` is not one);
    ``repeated``, whether its last step repeated the step before (no layout
    work, the plan made again by the same backend); ``eager_seconds``, the
    time its eager steps took so far under ``backend="auto"`` (the clock of
    compiling later, :data:`~dml_optim.backends.choose.AUTO_COMPILE_AFTER_EAGER_S`);
    ``window``, the gradients of the last run the step inside backward stepped
    (:func:`dml_optim.step_in_backward`: sized to the buffer's largest run, one
    element more; None without it, or where torch's fused kernel reads them in place); ``bound``, the
    tensors the eager backend's repeated call of the rule is bound to, in the rule's order (the parameters or
    their master copy, the gradient, the states), when the last step bound one (a one-class, ungated,
    unconverted eager step over the whole buffer), else None.
    """

    group: int
    device: torch.device
    dtype: torch.dtype
    param_indices: tuple[int, ...]
    numel: int
    data: torch.Tensor
    grad: torch.Tensor | None
    states: dict[str, torch.Tensor]
    master: torch.Tensor | None
    kahan: torch.Tensor | None
    scratch: tuple[torch.Tensor, ...]
    step_counts: tuple[int, ...]
    step_classes: int
    backend: str
    decisions: int = 0
    repeated: bool = False
    eager_seconds: float = 0.0
    window: torch.Tensor | None = None
    bound: tuple[torch.Tensor, ...] | None = None


def buffer_infos(opt) -> list[BufferInfo]:
    """One :class:`BufferInfo` per flat buffer of ``opt``, in group order."""
    out = []
    steady = {id(s.flat): s.plan for s in opt.steady_plans()}
    for gi, (group, flats) in enumerate(opt.buffers_by_group()):
        for flat in flats:
            rt = runtime(flat)
            backend = resolved_backend(opt.owner, group, flat)
            out.append(BufferInfo(
                group=gi, device=flat.device, dtype=flat.dtype, param_indices=tuple(flat.indices),
                numel=flat.numel, data=flat.data, grad=flat.grad, states=dict(flat.states), master=flat.master,
                kahan=flat.kahan, scratch=tuple(flat.scratch), step_counts=tuple(flat.counter.counts()),
                step_classes=len(flat.counter.classes), backend=backend, decisions=rt.decisions,
                repeated=rt.repeated, eager_seconds=rt.eager_s, window=rt.window,
                bound=_bound(steady.get(id(flat))),
            ))
    return out


def _bound(plan) -> tuple[torch.Tensor, ...] | None:
    call = getattr(plan, "steady", None)  # (an eager plan's bound call, a SteadyCall)
    return None if call is None else tuple(call.operands)
