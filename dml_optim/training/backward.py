"""The optimizer step inside backward.

:func:`step_in_backward` makes a dml_optim optimizer step each *run* of
parameters as soon as autograd has produced all of the run's gradients, during
``loss.backward()``, and drop those gradients right after: a training loop is
then ``loss = f(batch); loss.backward(); optimizer.zero_grad()``, with no
``optimizer.step()`` (calling it is harmless: no gradient is left, so it does
nothing), and autograd's gradients of the whole model never exist at once
(the technique of torch's tutorial "How to save memory by fusing the optimizer
step into the backward pass", torchtune's optimizer-in-backward, LOMO).

**Runs.** The trainable parameters of each flat buffer, in the buffer's order,
are cut greedily into runs of about ``run_bytes`` bytes of gradient: a run
closes once it holds half of ``run_bytes`` and the next parameter would take it
past ``run_bytes`` (so a bias joins the weight after it instead of stepping
alone; a parameter larger than ``run_bytes`` is a run of its own), and a run
whose parameters average fewer elements than :data:`SMALL_RUN_ELEMENTS` joins
its neighbour in the same buffer (a step of its own would cost a whole step's
dispatches).  The default, ``None``, is the larger of the largest parameter's
gradient and 1 MiB.  Each parameter gets a post-accumulate-grad hook (torch >=
2.1): it takes the parameter's gradient (``p.grad`` back to None, the tensor
kept by the run); when the run has all of its gradients, the optimizer steps
exactly those parameters (:meth:`~dml_optim.optimizers.engine.EngineMixin.step_run`)
and the gradients are dropped.  A run some of whose parameters got no gradient
in this backward (an unused branch) steps at the end of backward (an autograd
engine callback) with those it has, as a plain step would.

**Memory.** Gradient memory is bounded by about two runs (the one being
completed and the next one's first gradients) plus the gradients autograd
produces out of the buffer's order, and one *window* per buffer of the largest
run's size: torch's fused kernel (the CPU's default for float32 and float64
parameters with plain states) reads a run's gradients where autograd left them;
every other backend (eager: DirectML's path; compiled; low-bit states; float16
and bfloat16 parameters with Kahan summation or stochastic rounding) reads them
from the window, filled with one ``cat``.  No flat gradient buffer of the
model's size is made, and nothing is re-packed: a run steps in place, its own
step counts advancing alone.

**Same results as a plain step**, bit for bit per parameter: every parameter
with a gradient steps once per backward with its own step count, after its
gradient is complete (autograd runs a parameter's accumulation after every use
of it in the graph, so no later part of this backward reads its value), with the
group's hyperparameters of that moment (schedulers step between iterations,
as before).  ``state_dict``, low-bit state and frozen parameters work as they
do.  With ``rounding="stochastic"`` too: its numbers are keyed on the seed,
each element's step count and index, not on the order the runs step in.

**Loss scaling** (``scaler=``: a :class:`dml_optim.DynamicLossScaler`), for
float16 parameters, whose gradients underflow below about 6e-8: the loss is
scaled as usual (``scaler.scale(loss).backward()``, then ``scaler.update()``),
and each run is checked and stepped on its own as its gradients arrive: one
reduction over the run's gradient window decides, on the device, whether they
are all finite; the run's step is gated on that flag (a run with an inf or NaN
gradient changes nothing: its parameters, states and step counts stay as they
were), and its gradients are unscaled inside the rule, in float32 (no
underflow).  The runs that were finite step; the scaler is told how many runs
of this backward skipped and backs the scale off for the next backward when
any did.  Nothing is read back to the host during backward (the scale's update
is the scaler's, at most once a step).  What a skipped run means: its
parameters missed one step, as every parameter does under a plain step's
skip, and their step counts (bias correction) stay one behind the rest from
then on; the scheduler steps as usual (one iteration, whatever skipped).  The
choice, against a second backward pass (LOMO's: one pass to find an overflow,
a second to step), is measured in docs/design.md.

**Refused at setup** (``ValueError`` naming what to change), because they need
every gradient of the model before the first parameter steps, or a step of the
whole model at once:

* global-norm clipping (``max_norm=``): the norm is of all gradients
  together; clip per parameter (``torch.nn.utils.clip_grad_value_`` in a hook
  of your own) or step after backward;
* gradient accumulation (``accumulation_steps > 1``): each backward steps;
* ``torch.amp.GradScaler`` (its unscaling and skip are decided on every
  gradient, in host code; use :class:`dml_optim.DynamicLossScaler`, whose scale
  lives on the device), ``nonfinite="skip"`` and ``nonfinite="raise"``: whether
  to skip or refuse a step is decided on all gradients; use the scaler, or step
  after backward;
* ``atomic=True`` (a failed step rolls back whole) and ``capturable=True`` (a
  step captured in a CUDA graph): both are about the whole step;
* DDP and FSDP (``model=`` wrapped by them, or DTensor parameters): their
  reduction runs in buckets during backward, and the step would read an
  unreduced gradient.

Under ``torch.nn.utils.clip_grad_norm_`` called after backward anyway, there is
no gradient left to clip: pass ``max_norm`` to be told at setup.  Freezing or
unfreezing parameters, re-binding them (``model.to()``) or adding a param group
needs :meth:`StepInBackward.refresh`; a backward that finds one of these changed
raises, naming it, instead of stepping the wrong parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dml_optim.core.packing import address, storage_less

__all__ = ["step_in_backward", "StepInBackward", "DEFAULT_MIN_RUN_BYTES"]

#: The smallest default run: small parameters (biases, norms) are grouped up to this many bytes of gradient.
DEFAULT_MIN_RUN_BYTES = 1 << 20
#: A run whose parameters average fewer elements than this joins its neighbour (a step of its own costs a whole
#: step's dispatches; torch's fused kernel reads gradients this large where they are, in one call per list).
SMALL_RUN_ELEMENTS = 1 << 12


@dataclass
class _Run:
    params: list[torch.nn.Parameter]
    buffer: int = 0  # the flat buffer (flat_buffers()' order)
    positions: list[int] = field(default_factory=list)  # each parameter's position in the buffer
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position in params -> gradient

    @property
    def complete(self) -> bool:
        return len(self.pending) == len(self.params)


def _refuse(optimizer, *, max_norm, accumulation_steps, scaler, model) -> None:
    if not hasattr(optimizer, "step_run") or not isinstance(optimizer, torch.optim.Optimizer):
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
    if scaler is not None and not (callable(getattr(scaler, "inverse_scale", None))
                                   and callable(getattr(scaler, "record_step", None))):
        raise ValueError(
            f"scaler={type(scaler).__name__}: it skips the whole step when any gradient overflowed, decided in host "
            "code after the last gradient; pass a dml_optim.DynamicLossScaler (each run is then checked and "
            "stepped on the device as its gradients arrive), or call optimizer.step() after backward")
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("nonfinite") in ("skip", "raise"):
            raise ValueError(
                f'param_groups[{gi}]: nonfinite="{group["nonfinite"]}" decides on every gradient of the model '
                'whether the step happens, which is known only after the last gradient; use '
                'nonfinite="propagate" (with scaler=dml_optim.DynamicLossScaler() each run with an inf or NaN '
                'gradient is skipped), or call optimizer.step() after backward')
        if group.get("capturable"):
            raise ValueError(
                f"param_groups[{gi}]: capturable=True is for a whole step captured in a CUDA graph; the step inside "
                "backward steps run by run during backward: build the optimizer with capturable=False, or call "
                "optimizer.step() after backward")
    if getattr(optimizer, "atomic", False):
        raise ValueError(
            "atomic=True rolls a failed step back whole, and the step inside backward steps run by run (a failure "
            "would leave the runs before it stepped): build the optimizer with atomic=False, or call "
            "optimizer.step() after backward")
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

    def __init__(self, optimizer, run_bytes: int | None = None, scaler: Any = None):
        self.optimizer = optimizer
        self.scaler = scaler
        self._found: torch.Tensor | None = None  # runs of this backward skipped (loss scaling), on the device
        self.run_bytes_option = run_bytes
        self.run_bytes = 0
        self.runs: list[_Run] = []
        self._where: dict[int, tuple[_Run, int]] = {}
        self._handles: list[Any] = []
        self._queued = False
        self._all: list[torch.nn.Parameter] = []
        self._trainable: list[bool] = []  # every parameter's requires_grad at setup (a backward checks it again)
        self._ptrs: list[int] = []  # every hooked parameter's data pointer at setup
        self.steps = 0  # runs stepped inside backward (introspection, tests)
        self.refresh()

    # -- setup ------------------------------------------------------------------------------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _buffers(self) -> list[list[tuple[int, torch.nn.Parameter]]]:
        """Each flat buffer's trainable parameters, in buffer order, with their positions in it."""
        out = []
        for info in self.optimizer.flat_buffers():
            params = self.optimizer.param_groups[info.group]["params"]
            out.append([(pos, params[i]) for pos, i in enumerate(info.param_indices) if params[i].requires_grad])
        return out

    def _outside(self, buffers) -> list[torch.nn.Parameter]:
        seen = {id(p) for ps in buffers for _, p in ps}
        return [p for p in self._params() if p.requires_grad and id(p) not in seen]

    def refresh(self) -> None:
        """Cut the runs and hook the parameters again (after freezing, unfreezing, re-binding parameters, a new
        param group).  Parameters trainable now that were frozen when the optimizer was built are packed first
        (a step with no gradient: it writes nothing); raises if some parameter holds a gradient then."""
        self.remove()
        buffers = self._buffers()
        if self._outside(buffers) or self._moved(buffers):
            if any(p.grad is not None for p in self._params()):
                raise RuntimeError(
                    "step_in_backward: some parameters are trainable but not packed yet (frozen when the optimizer "
                    "was built) or were re-bound, and some parameters hold a gradient: call optimizer.zero_grad("
                    "set_to_none=True) first, then refresh()")
            self.optimizer.step()  # (no gradient: nothing steps; the layout packs and adopts them)
            buffers = self._buffers()
            outside = self._outside(buffers)
            if outside:
                raise ValueError(f"step_in_backward: {len(outside)} trainable parameters are in no flat buffer of "
                                 "the optimizer; call optimizer.step() after backward")
        sizes = [p.numel() * p.element_size() for ps in buffers for _, p in ps]
        self.run_bytes = (self.run_bytes_option if self.run_bytes_option is not None
                          else max([DEFAULT_MIN_RUN_BYTES, *sizes]))
        self.runs = []
        for k, ps in enumerate(buffers):
            run, used = None, 0
            for pos, p in ps:
                size = p.numel() * p.element_size()
                # a run closes once it holds half its bytes and the next parameter would overflow it: a small
                # parameter (a bias) joins the large one after it instead of stepping alone
                if run is None or used + size > self.run_bytes and 2 * used >= self.run_bytes:
                    run, used = _Run([], k), 0
                    self.runs.append(run)
                run.params.append(p)
                run.positions.append(pos)
                used += size
        self._merge_small_runs()
        for run in self.runs:
            for j, p in enumerate(run.params):
                self._where[id(p)] = (run, j)
        self._all = [p for run in self.runs for p in run.params]
        self._trainable = [p.requires_grad for p in self._params()]
        self._ptrs = self._places()
        self.optimizer.set_in_backward(self)
        for p in self._all:
            self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))

    def _places(self) -> list:
        """Where each hooked parameter lies (:func:`~dml_optim.core.packing.address`; on a device without storage,
        with its dtype and device: an offset alone does not tell ``model.half()``'s new tensor from the old)."""
        return [(address(p, True), p.dtype, p.device) if storage_less(p) else address(p, False) for p in self._all]

    def _moved(self, buffers) -> bool:
        """Some trainable parameter no longer lives in its flat buffer (re-bound: ``model.to()``, ``p.data = t``)."""
        for info, ps in zip(self.optimizer.flat_buffers(), buffers):
            opaque = storage_less(info.data)
            lo = address(info.data, opaque)
            hi = lo + info.data.numel() * (1 if opaque else info.data.element_size())
            if any(not lo <= address(p, opaque) < hi or storage_less(p) != opaque
                   or (p.dtype, p.device) != (info.dtype, info.device) for _, p in ps):
                return True
        return False

    def _merge_small_runs(self) -> None:
        """A run whose parameters average fewer than :data:`SMALL_RUN_ELEMENTS` elements (a bias alone at the
        end of a buffer) joins the run before it (the first run of a buffer joins the next)."""
        merged: list[_Run] = []
        for run in self.runs:
            small = sum(p.numel() for p in run.params) < SMALL_RUN_ELEMENTS * len(run.params)
            prev = merged[-1] if merged else None
            if prev is not None and prev.buffer == run.buffer and (
                    small or sum(p.numel() for p in prev.params) < SMALL_RUN_ELEMENTS * len(prev.params)):
                prev.params.extend(run.params)
                prev.positions.extend(run.positions)
            else:
                merged.append(run)
        self.runs = merged

    def remove(self) -> None:
        """Remove the hooks: the optimizer steps only when ``step()`` is called again."""
        for h in self._handles:
            h.remove()
        if self._handles or self.runs:
            self.optimizer.set_in_backward(None)
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
        try:
            if not self._queued:  # the first gradient of this backward: what the runs were cut for still holds?
                self._check_setup()
                # the runs left incomplete (unused parameters) step when backward ends
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
                self._queued = True
            run, j = where
            run.pending[j] = p.grad
            p.grad = None
            if run.complete:
                self._step(run)
        except BaseException:  # (this backward is over: the next one starts afresh, its own checks and callback)
            self._queued = False
            self._found = None
            for run in self.runs:
                run.pending.clear()
            raise

    def _check_setup(self) -> None:
        if [p.requires_grad for p in self._params()] != self._trainable:
            raise RuntimeError("step_in_backward: parameters were frozen or unfrozen, or a param group was added, "
                               "since the runs were cut: call refresh() on the handle step_in_backward returned")
        if self._places() != self._ptrs:
            raise RuntimeError("step_in_backward: parameters were re-bound (model.to(), p.data = t) since the runs "
                               "were cut: call refresh() on the handle step_in_backward returned (between backward "
                               "passes)")

    def _step(self, run: _Run) -> None:
        grads = {run.positions[j]: g for j, g in run.pending.items()}
        run.pending.clear()
        if self.scaler is None:
            self.optimizer.step_run(run.buffer, grads)
        else:  # (gated on the device: the run's flag added up, read by the scaler's update)
            finite = self.optimizer.step_run(run.buffer, grads, inv_scale=self.scaler.inverse_scale())
            skipped = finite.logical_not().float()
            self._found = skipped if self._found is None else self._found.add_(skipped.to(self._found.device))
        self.steps += 1

    def _flush(self) -> None:
        self._queued = False
        for run in self.runs:
            if run.pending:
                self._step(run)
        if self.scaler is not None and self._found is not None:
            self.scaler.record_step(self.optimizer, self._found)
            self._found = None
        # a scheduler stepping after this backward is stepping after an optimizer step: torch's LRScheduler reads
        # this flag, set by the step() it wraps, to warn when scheduler.step() comes first
        self.optimizer._opt_called = True


def step_in_backward(optimizer, *, run_bytes: int | None = None, max_norm: float | None = None,
                     accumulation_steps: int = 1, scaler: Any = None, model: torch.nn.Module | None = None
                     ) -> StepInBackward:
    """Step ``optimizer`` (a dml_optim optimizer) inside every ``loss.backward()``, one run of parameters at a
    time, and drop each gradient once its run stepped; return the handle (``remove()`` undoes it).

    ``run_bytes``: the largest run, in bytes of gradient (default: the largest parameter's, at least 1 MiB).
    ``scaler``: a :class:`dml_optim.DynamicLossScaler` whose scaled loss the backward passes propagate (float16
    training): each run is unscaled, checked and gated on the device (see the module's docstring); the loop is
    ``scaler.scale(loss).backward(); scaler.update()``.  ``max_norm``, ``accumulation_steps``, another scaler
    (``torch.amp.GradScaler``) and ``model`` (DDP/FSDP) are there to be refused with the reason.  Raises
    ``TypeError`` for an optimizer that is not dml_optim's.
    """
    _refuse(optimizer, max_norm=max_norm, accumulation_steps=accumulation_steps, scaler=scaler, model=model)
    if run_bytes is not None and (isinstance(run_bytes, bool) or not isinstance(run_bytes, int) or run_bytes < 0):
        raise ValueError(f"run_bytes must be None or an int >= 0, got {run_bytes!r}")
    return StepInBackward(optimizer, run_bytes, scaler)
