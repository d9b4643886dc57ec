"""The optimizer step inside backward (a prototype on the optimizer's public API).

:func:`step_in_backward` makes a dml_optim optimizer step each *run* of
parameters as soon as autograd has produced all of the run's gradients, during
``loss.backward()``, and drop those gradients right after: a training loop is
then ``loss = f(batch); loss.backward(); optimizer.zero_grad()``, with no
``optimizer.step()`` (calling it is harmless: no gradient is left, so it does
nothing), and autograd's gradients of the whole model never exist at once
(the technique of torch's tutorial "How to save memory by fusing the optimizer
step into the backward pass", torchtune's optimizer-in-backward, LOMO).

**Runs.** The parameters of each flat buffer, in the buffer's order, are cut
greedily into runs of about ``run_bytes`` bytes of gradient: a run closes
once it holds half of ``run_bytes`` and the next parameter would take it
past ``run_bytes`` (so a bias joins the weight after it instead of stepping
alone; a parameter larger than ``run_bytes`` is a run of its own), and a run
whose parameters average fewer elements than the fused backend reads in place
(``LIST_MIN_ELEMENTS``) joins its neighbour in the same buffer.  The
default, ``None``, is the larger of the largest parameter's gradient and
1 MiB.  Gradient memory is then bounded by about two runs (the one being
completed and the next one's first gradients) plus the gradients autograd
produces out of the buffer's order.  Each
parameter gets a post-accumulate-grad hook (torch >= 2.1): it takes the
parameter's gradient (``p.grad`` back to None, the tensor kept by the run);
when the run has all of its gradients, they are handed back and
``optimizer.step()`` runs with only them present, which steps exactly those
parameters (a step skips parameters without a gradient), then they are
dropped.  A run some of whose parameters got no gradient in this backward
(an unused branch) steps at the end of backward (an autograd engine callback)
with those it has, as a plain step would.  Frozen parameters (no
``requires_grad``) get no hook; call :meth:`StepInBackward.refresh` after
freezing or unfreezing, or after adding a param group.

**Same results as a plain step**, bit for bit per parameter: every parameter
with a gradient steps once per backward with its own step count, after its
gradient is complete (autograd runs a parameter's accumulation after every use
of it in the graph, so no later part of this backward reads its value), with the
group's hyperparameters of that moment (schedulers step between iterations,
as before).  ``state_dict``, low-bit state and frozen parameters work as they do.

**Refused at setup** (``ValueError`` naming what to change), because they need
every gradient of the model before the first parameter steps:

* global-norm clipping (``max_norm=``): the norm is of all gradients
  together; clip per parameter (``torch.nn.utils.clip_grad_value_`` in a hook
  of your own) or step after backward;
* gradient accumulation (``accumulation_steps > 1``): each backward steps;
* a loss scaler (``scaler=``: ``torch.amp.GradScaler``,
  :class:`dml_optim.DynamicLossScaler`) and ``nonfinite="skip"``: whether to
  skip a step is decided on all gradients; use bf16 autocast, or step after backward;
* DDP and FSDP (``model=`` wrapped by them, or DTensor parameters): their
  reduction runs in buckets during backward, and the step would read an
  unreduced gradient.

Under ``torch.nn.utils.clip_grad_norm_`` called after backward anyway, there is
no gradient left to clip: pass ``max_norm`` to be told at setup.

**Backends: the fused one only, in this prototype** (refused at setup
otherwise).  It steps through ``optimizer.step()``, the public API, with the
other runs' gradients absent.  The fused backend (torch's kernels: the CPU's
default for float32 and float64 parameters with plain states) keeps the
buffer's order whatever gradients are absent and reads the present ones where
they are (runs of at least 16k elements per parameter on average), so no flat
gradient buffer is allocated and gradient memory is bounded by the runs.  The
eager and compiled backends re-pack a buffer whose parameters with a gradient
are in pieces at one step count, which is every run's case: a re-pack moves
parameters that the rest of backward still reads (writing into the same
storage through the full-size scratch gives wrong gradients; into a new one,
a copy of the model per run), and their steps gather gradients into the
model-sized flat gradient buffer.  Both need the planner to step one range of
a buffer in place with its gradients read where they are (the second phase of
this work); a guard raises if a step inside backward ever moves a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["step_in_backward", "StepInBackward", "DEFAULT_MIN_RUN_BYTES"]

#: The smallest default run: small parameters (biases, norms) are grouped up to this many bytes of gradient.
DEFAULT_MIN_RUN_BYTES = 1 << 20


@dataclass
class _Run:
    params: list[torch.nn.Parameter]
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position in params -> gradient

    @property
    def complete(self) -> bool:
        return len(self.pending) == len(self.params)


def _refuse(optimizer, *, max_norm, accumulation_steps, scaler, model) -> None:
    if not hasattr(optimizer, "flat_buffers") or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward needs a dml_optim optimizer, got {type(optimizer).__name__}")
    if max_norm is not None:
        raise ValueError(
            f"max_norm={max_norm!r}: global-norm clipping needs the norm of every gradient before the first "
            "parameter steps, and the step inside backward steps each run as its gradients arrive. Clip per "
            "parameter (clip_grad_value_) or call optimizer.step() after backward instead of step_in_backward")
    if accumulation_steps != 1:
        raise ValueError(
            f"accumulation_steps={accumulation_steps!r}: with the step inside backward every backward steps; "
            "accumulate by a larger batch, or call optimizer.step() every N backward passes instead")
    if scaler is not None:
        raise ValueError(
            f"scaler={type(scaler).__name__}: a loss scaler skips the whole step when any gradient overflowed, "
            "which is known only after the last gradient; train in bfloat16 without a scaler, or call "
            "optimizer.step() after backward")
    for group in optimizer.param_groups:
        if group.get("nonfinite") == "skip":
            raise ValueError(
                'nonfinite="skip" skips the whole step when any gradient is not finite, which is known only after '
                'the last gradient; use nonfinite="propagate" or "raise", or call optimizer.step() after backward')
    if model is not None:
        wrapper = type(model).__name__
        if wrapper in ("DistributedDataParallel", "FullyShardedDataParallel") or type(model).__module__.startswith(
                "torch.distributed.fsdp"):
            raise ValueError(
                f"model is wrapped by {wrapper}: its gradient reduction runs in buckets during backward and a step "
                "inside backward would read unreduced gradients; call optimizer.step() after backward")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            DTensor = None
    if DTensor is not None:
        for group in optimizer.param_groups:
            if any(isinstance(p, DTensor) for p in group["params"]):
                raise ValueError(
                    "the optimizer holds DTensor (FSDP2) parameters: their gradients are reduce-scattered during "
                    "backward; call optimizer.step() after backward")


class StepInBackward:
    """The hooks :func:`step_in_backward` installed; :meth:`remove` takes them away."""

    def __init__(self, optimizer, run_bytes: int | None = None):
        self.optimizer = optimizer
        self.run_bytes_option = run_bytes
        self.run_bytes = 0
        self.runs: list[_Run] = []
        self._where: dict[int, tuple[_Run, int]] = {}
        self._handles: list[Any] = []
        self._queued = False
        self._all: list[torch.nn.Parameter] = []
        self.steps = 0  # optimizer.step() calls made inside backward (introspection, tests)
        self.refresh()

    # -- setup ------------------------------------------------------------------------------------------------

    def _check_backends(self) -> None:
        for n, info in enumerate(self.optimizer.flat_buffers()):
            if info.backend != "fused":
                raise ValueError(
                    f"flat buffer {n} (group {info.group}, {str(info.dtype).replace('torch.', '')} on "
                    f"{info.device.type}) runs the {info.backend!r} backend: its step may re-pack the buffer "
                    "(moving parameters that backward still reads) and gathers gradients into the model-sized "
                    "flat gradient buffer. This prototype steps inside backward only where every buffer runs "
                    "torch's fused kernel (the CPU's default for float32 and float64 parameters with plain "
                    "states); elsewhere call optimizer.step() after backward")

    def _ordered_params(self) -> list[list[torch.nn.Parameter]]:
        """Each flat buffer's trainable parameters in buffer order, then those of no buffer (one list each)."""
        out, seen = [], set()
        for info in self.optimizer.flat_buffers():
            params = self.optimizer.param_groups[info.group]["params"]
            ps = [params[i] for i in info.param_indices]
            seen.update(id(p) for p in ps)
            out.append([p for p in ps if p.requires_grad])
        for group in self.optimizer.param_groups:
            rest = [p for p in group["params"] if id(p) not in seen and p.requires_grad]
            if rest:
                out.append(rest)
        return out

    def refresh(self) -> None:
        """Cut the runs and hook the parameters again (after freezing, unfreezing, a new param group)."""
        self.remove()
        self._check_backends()
        buffers = self._ordered_params()
        sizes = [p.numel() * p.element_size() for ps in buffers for p in ps]
        self.run_bytes = (self.run_bytes_option if self.run_bytes_option is not None
                          else max([DEFAULT_MIN_RUN_BYTES, *sizes]))
        self.runs = []
        for ps in buffers:
            run, used = None, 0
            for p in ps:
                size = p.numel() * p.element_size()
                # a run closes once it holds half its bytes and the next parameter would overflow it: a small
                # parameter (a bias) joins the large one after it instead of stepping alone
                if run is None or used + size > self.run_bytes and 2 * used >= self.run_bytes:
                    run, used = _Run([]), 0
                    self.runs.append(run)
                run.params.append(p)
                used += size
        self._merge_small_runs()
        for run in self.runs:
            for pos, p in enumerate(run.params):
                self._where[id(p)] = (run, pos)
        self._all = [p for run in self.runs for p in run.params]
        for p in self._all:
            self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))

    def _merge_small_runs(self) -> None:
        """A run whose parameters average fewer elements than the fused backend reads in place (a bias alone at
        the end of a buffer) joins the run before it: gathered, it would allocate the whole flat gradient
        buffer.  (Runs of one buffer only: the first run of a buffer joins the next.)"""
        try:
            from dml_optim.backends.fused import LIST_MIN_ELEMENTS as least
        except ImportError:  # the threshold moved: the value of its first version
            least = 1 << 14
        buffer_of = {id(p): n for n, ps in enumerate(self._ordered_params()) for p in ps}
        merged: list[_Run] = []
        for run in self.runs:
            small = sum(p.numel() for p in run.params) < least * len(run.params)
            prev = merged[-1] if merged else None
            if prev is not None and buffer_of[id(prev.params[0])] == buffer_of[id(run.params[0])] and (
                    small or sum(p.numel() for p in prev.params) < least * len(prev.params)):
                prev.params.extend(run.params)
            else:
                merged.append(run)
        self.runs = merged

    def remove(self) -> None:
        """Remove the hooks: the optimizer steps only when ``step()`` is called again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._where = {}
        for run in self.runs:
            run.pending.clear()

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- during backward --------------------------------------------------------------------------------------

    def _arrived(self, p: torch.nn.Parameter) -> None:
        where = self._where.get(id(p))
        if where is None or p.grad is None:
            return
        run, pos = where
        run.pending[pos] = p.grad
        p.grad = None
        if not self._queued:  # the runs left incomplete (unused parameters) step when backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._queued = True
        if run.complete:
            self._step(run)

    def _step(self, run: _Run) -> None:
        for pos, g in run.pending.items():
            run.params[pos].grad = g
        run.pending.clear()
        before = [p.data_ptr() for p in self._all]
        try:
            self.optimizer.step()
            self.steps += 1
        finally:
            for p in run.params:
                p.grad = None
        if [p.data_ptr() for p in self._all] != before:
            raise RuntimeError(
                "the optimizer re-packed its flat buffer inside backward (a parameter's data moved): the rest of "
                "this backward would read moved parameters. Call optimizer.step() after backward, or use a "
                "backend that keeps the layout (backend='fused')")

    def _flush(self) -> None:
        self._queued = False
        for run in self.runs:
            if run.pending:
                self._step(run)


def step_in_backward(optimizer, *, run_bytes: int | None = None, max_norm: float | None = None,
                     accumulation_steps: int = 1, scaler: Any = None, model: torch.nn.Module | None = None
                     ) -> StepInBackward:
    """Step ``optimizer`` (a dml_optim optimizer) inside every ``loss.backward()``, one run of parameters at a
    time, and drop each gradient once its run stepped; return the handle (``remove()`` undoes it).

    ``run_bytes``: the largest run, in bytes of gradient (default: the largest parameter's, at least 1 MiB).
    ``max_norm``, ``accumulation_steps``, ``scaler`` and ``model`` (DDP/FSDP) are there to be refused with
    the reason: see the module's docstring.  Raises ``TypeError`` for an optimizer that is not dml_optim's.
    """
    _refuse(optimizer, max_norm=max_norm, accumulation_steps=accumulation_steps, scaler=scaler, model=model)
    if run_bytes is not None and (isinstance(run_bytes, bool) or not isinstance(run_bytes, int) or run_bytes < 0):
        raise ValueError(f"run_bytes must be None or an int >= 0, got {run_bytes!r}")
    return StepInBackward(optimizer, run_bytes)
