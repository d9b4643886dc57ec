"""The optimizer step inside backward.

:func:`step_in_backward` makes a dml_optim optimizer step each *run* of
parameters as soon as autograd has produced all of the run's gradients, during
``loss.backward()``, and drop those gradients right after: a training loop is
then ``loss = f(batch); loss.backward(); optimizer.zero_grad()``, with no
``optimizer.step()`` (calling it is harmless: no gradient is left, so it does
nothing), and autograd's gradients of the whole model never exist at once
(the technique of torch's tutorial "How to save memory by fusing the optimizer
step into the backward pass", torchtune's optimizer-in-backward, LOMO).

Long by design: one handle whose hooks, runs, loss scaling and clipping share the state of one backward (the
runs' pending gradients, the found-inf sum, the norms and this backward's factors); split, that state would be
read across modules.

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

**Clipping** (``max_norm=``, ``clip_by="previous_norm"``): global-norm clipping by the *previous*
backward's norm, one step stale, because the current backward's norm is known only after its last gradient,
when every run but the last has stepped.  While backward runs, each run's gradients' 2-norm (unscaled; a
float16 gradient's in float32) is taken on the device before the run steps; at the end of backward the runs'
norms make the total norm (torch's norm of per-tensor norms: :attr:`StepInBackward.total_norm`, a 0-d device
tensor, as ``torch.nn.utils.clip_grad_norm_`` returns it), and the next backward's gradients are multiplied by
``min(1, max_norm / (total_norm + 1e-6))``, torch's coefficient: folded into the scaler's ``1 / S`` (one
factor, applied inside the rule in float32) or, without a scaler, multiplied into each run's gradients before
it steps.  The first backward after setup only measures: no norm is known to clip it by, and it steps nothing
(as a loss scaler's overflowed step; the scheduler steps as usual), because an unclipped first step of Adam
puts its large first gradient into the second moment, which holds every later step back (measured in
docs/design.md).  A run that skipped an inf or NaN gradient (loss scaling) keeps its previous norm in the
total: an overflow neither poisons the next coefficient nor drops the run from it (a run that overflows in the
first backward adds nothing to the first norm); without a scaler an inf or NaN gradient reaches the norm as it
does in torch (``nonfinite="propagate"``).  Runs that got no gradient in a backward are left out of its norm,
as torch leaves out parameters without one.  No host sync; every op (``linalg_vector_norm``, ``stack``,
``where``, ``lt``, ``add``, ``reciprocal``, ``mul``, ``clamp``) is native on DirectML.

**Refused at setup** (``ValueError`` naming what to change), because they need every gradient of the model
before the first parameter steps, or a step of the whole model at once:

* global-norm clipping by the current backward's norm (``max_norm=`` without ``clip_by="previous_norm"``):
  the norm is of all gradients together; clip by the previous backward's norm (above), per parameter
  (``torch.nn.utils.clip_grad_value_`` in a hook of your own), or step after backward;
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
no gradient left to clip: pass ``max_norm`` to the step inside backward instead.  Freezing or
unfreezing parameters, re-binding them (``model.to()``) or adding a param group
needs :meth:`StepInBackward.refresh`; a backward that finds one of these changed
raises, naming it, instead of stepping the wrong parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dml_optim.core.functional import check_hyperparameter
from dml_optim.core.packing import address, storage_less

__all__ = ["step_in_backward", "StepInBackward", "DEFAULT_MIN_RUN_BYTES", "CLIP_BY", "NORM_PIECE_ELEMENTS"]

#: The smallest default run: small parameters (biases, norms) are grouped up to this many bytes of gradient.
DEFAULT_MIN_RUN_BYTES = 1 << 20
#: A run whose parameters average fewer elements than this joins its neighbour (a step of its own costs a whole
#: step's dispatches; torch's fused kernel reads gradients this large where they are, in one call per list).
SMALL_RUN_ELEMENTS = 1 << 12
#: What ``clip_by`` accepts: the norm the gradients of a backward are clipped by (the previous backward's).
CLIP_BY = ("previous_norm",)
#: A float16 or bfloat16 gradient's norm is taken in float32 in pieces of at most this many elements (the
#: conversion's copy is at most 4 MiB, whatever the parameter; a float32 gradient's norm is one op).
NORM_PIECE_ELEMENTS = 1 << 20


@dataclass
class _Run:
    params: list[torch.nn.Parameter]
    buffer: int = 0  # the flat buffer (flat_buffers()' order)
    positions: list[int] = field(default_factory=list)  # each parameter's position in the buffer
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position in params -> gradient
    # clipping: the 2-norm of the run's unscaled gradients at the last backward it stepped in (0-d float32 on
    # the device; a skipped step keeps the one before), and whether it stepped in this backward
    norm: torch.Tensor | None = None
    fresh: bool = False

    @property
    def complete(self) -> bool:
        return len(self.pending) == len(self.params)


def _refuse(optimizer, *, max_norm, clip_by, accumulation_steps, scaler, model) -> None:
    if not hasattr(optimizer, "step_run") or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward needs a dml_optim optimizer, got {type(optimizer).__name__}")
    if clip_by is not None and clip_by not in CLIP_BY:
        raise ValueError(f"clip_by must be None or one of {CLIP_BY}, got {clip_by!r}")
    if max_norm is not None and clip_by is None:
        raise ValueError(
            f"max_norm={max_norm!r}: global-norm clipping by this backward's norm needs the norm of every gradient "
            "before the first parameter steps, and the step inside backward steps each run as its gradients "
            'arrive. Pass clip_by="previous_norm" to clip each backward\'s gradients by the previous backward\'s '
            "total norm (one step stale; the first backward only measures it), clip per parameter "
            "(clip_grad_value_), or call optimizer.step() after backward instead of step_in_backward")
    if clip_by is not None and max_norm is None:
        raise ValueError(f"clip_by={clip_by!r} clips by the previous backward's norm: it needs max_norm")
    if max_norm is not None:
        check_hyperparameter("max_norm", max_norm, low=0.0)
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
    """The hooks :func:`step_in_backward` installed; :meth:`remove` takes them away.

    With ``max_norm`` (clipping by the previous backward's norm), :attr:`total_norm` is the total 2-norm of the
    last backward's gradients, unscaled and before clipping (a 0-d float32 tensor on the device, what
    ``torch.nn.utils.clip_grad_norm_`` returns: log it after ``backward()``; reading it is a host sync), the norm
    the next backward is clipped by; None before the first backward.
    """

    def __init__(self, optimizer, run_bytes: int | None = None, scaler: Any = None, max_norm: float | None = None):
        self.optimizer = optimizer
        self.scaler = scaler
        self._found: torch.Tensor | None = None  # runs of this backward skipped (loss scaling), on the device
        #: clipping by the previous backward's norm (None: no clipping, no norm taken)
        self.max_norm = None if max_norm is None else check_hyperparameter("max_norm", max_norm, low=0.0)
        #: the total 2-norm of the last backward's gradients (unscaled, before clipping; a skipped run's previous
        #: norm): a 0-d float32 tensor on the device, as torch.nn.utils.clip_grad_norm_ returns; None before the
        #: first backward, and without max_norm.  The next backward is clipped by it.  Reading it is a host sync.
        self.total_norm: torch.Tensor | None = None
        self._coef: torch.Tensor | None = None  # min(1, max_norm / (total_norm + 1e-6)): this backward's clip
        self._factors: dict = {}  # this backward's gradient factors (the coefficient by dtype, or with 1 / S)
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

    @property
    def installed(self) -> bool:
        """Whether the hooks are in place (False after :meth:`remove`)."""
        return bool(self._handles)

    def position_of(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """Where ``param`` steps: ``(buffer, position)``, the arguments of ``optimizer.step_run(buffer, {position:
        grad})`` (``KeyError`` for a parameter this handle does not step)."""
        run, j = self._where[id(param)]
        return run.buffer, run.positions[j]

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
                self._factors = {}
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
            for run in self.runs:  # (the clip coefficient stays the last complete backward's)
                run.pending.clear()
                run.fresh = False
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
        # (the norm of the gradients as they arrived: before they are clipped or the rule reads them)
        norm = self._run_norm(list(grads.values())) if self.max_norm is not None else None
        finite = None
        if norm is not None and self._coef is None:  # (the first backward: no norm to clip by yet, no step)
            finite = norm < math.inf  # (the norm's own check: false for an inf or a NaN, for the total and the scaler)
            if self.scaler is not None:
                skipped = finite.logical_not().float()
                self._found = skipped if self._found is None else self._found.add_(skipped.to(self._found.device))
            run.norm = torch.where(finite, norm, torch.zeros((), dtype=norm.dtype, device=norm.device))
            run.fresh = True
            return
        if self.scaler is None:
            if self._coef is not None:  # (clip_grad_norm_'s multiply, in the gradients' dtype, as the flat clip does)
                for g in grads.values():
                    g.mul_(self._factor(g.dtype, g.device))
            self.optimizer.step_run(run.buffer, grads)
        else:  # (gated on the device: the run's flag added up, read by the scaler's update)
            finite = self.optimizer.step_run(run.buffer, grads, inv_scale=self._factor(None, None))
            skipped = finite.logical_not().float()
            self._found = skipped if self._found is None else self._found.add_(skipped.to(self._found.device))
        if norm is not None:  # (a skipped run keeps its norm of before: an inf or NaN never reaches the total)
            if finite is not None:
                previous = run.norm if run.norm is not None else torch.zeros((), dtype=norm.dtype, device=norm.device)
                norm = torch.where(finite.to(norm.device), norm, previous.to(norm.device))
            run.norm, run.fresh = norm, True
        self.steps += 1

    def _run_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of a run's gradients, unscaled: torch's norm of per-tensor norms, a float16 or bfloat16
        gradient's in float32 (converted in pieces of :data:`NORM_PIECE_ELEMENTS`: the norm of a scaled float16
        gradient overflows float16); 0-d, on the first gradient's device."""
        device = grads[0].device
        norms = []
        for g in grads:
            if g.dtype not in (torch.float16, torch.bfloat16):  # (float32, float64: in their own dtype, as torch)
                norms.append(torch.linalg.vector_norm(g, 2))
            elif g.numel() <= NORM_PIECE_ELEMENTS:
                norms.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
            else:
                flat = g.reshape(-1)
                norms += [torch.linalg.vector_norm(flat[a:a + NORM_PIECE_ELEMENTS], 2, dtype=torch.float32)
                          for a in range(0, flat.numel(), NORM_PIECE_ELEMENTS)]
        norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)
        if self.scaler is not None:  # (the loss's scale taken out: the norm of the gradients the rule steps with)
            norm = norm * self.scaler.inverse_scale().to(device)
        return norm

    def _factor(self, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
        """This backward's factor of the gradients, made once per backward: with a scaler (``dtype`` None) its
        ``1 / S`` times the clip coefficient, applied inside the rule in float32; without one, the coefficient in
        the gradients' dtype."""
        key = (dtype, device)
        factor = self._factors.get(key)
        if factor is None:
            if dtype is None:
                inverse = self.scaler.inverse_scale()
                factor = inverse if self._coef is None else inverse * self._coef.to(inverse.device)
            else:
                factor = self._coef.to(device, dtype)
            self._factors[key] = factor
        return factor

    def _clip_next(self) -> None:
        """At the end of a backward: the total norm of its runs (each run's last norm; runs that got no gradient
        left out, as torch leaves out parameters without one) and the coefficient of the next backward."""
        fresh = [run for run in self.runs if run.fresh]
        for run in self.runs:
            if not run.fresh:
                run.norm = None  # (no gradient in this backward: not in the total, nothing to keep for a skip)
            run.fresh = False
        if not fresh:
            return
        device = fresh[0].norm.device
        total = torch.linalg.vector_norm(torch.stack([run.norm.to(device) for run in fresh]), 2)
        self.total_norm = total
        self._coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)  # (torch's: reciprocal, mul, add, clamp)

    def _flush(self) -> None:
        self._queued = False
        for run in self.runs:
            if run.pending:
                self._step(run)
        if self.max_norm is not None:
            self._clip_next()
        self._factors = {}
        if self.scaler is not None and self._found is not None:
            self.scaler.record_step(self.optimizer, self._found)
            self._found = None
        # a scheduler stepping after this backward is stepping after an optimizer step: torch's LRScheduler reads
        # this flag, set by the step() it wraps, to warn when scheduler.step() comes first
        self.optimizer._opt_called = True


def step_in_backward(optimizer, *, run_bytes: int | None = None, max_norm: float | None = None,
                     clip_by: str | None = None, accumulation_steps: int = 1, scaler: Any = None,
                     model: torch.nn.Module | None = None) -> StepInBackward:
    """Step ``optimizer`` (a dml_optim optimizer) inside every ``loss.backward()``, one run of parameters at a
    time, and drop each gradient once its run stepped; return the handle (``remove()`` undoes it).

    ``run_bytes``: the largest run, in bytes of gradient (default: the largest parameter's, at least 1 MiB).
    ``scaler``: a :class:`dml_optim.DynamicLossScaler` whose scaled loss the backward passes propagate (float16
    training): each run is unscaled, checked and gated on the device (see the module's docstring); the loop is
    ``scaler.scale(loss).backward(); scaler.update()``.  ``max_norm`` with ``clip_by="previous_norm"``: each
    backward's gradients are clipped to a total 2-norm of ``max_norm`` by the *previous* backward's total norm
    (one step stale; the first backward only measures, stepping nothing; ``handle.total_norm`` is the last
    backward's norm, a 0-d device tensor); ``max_norm`` alone (torch's clipping by the current norm), ``accumulation_steps``, another
    scaler (``torch.amp.GradScaler``) and ``model`` (DDP/FSDP) are there to be refused with the reason.  Raises
    ``TypeError`` for an optimizer that is not dml_optim's.
    """
    _refuse(optimizer, max_norm=max_norm, clip_by=clip_by, accumulation_steps=accumulation_steps, scaler=scaler,
            model=model)
    if run_bytes is not None and (isinstance(run_bytes, bool) or not isinstance(run_bytes, int) or run_bytes < 0):
        raise ValueError(f"run_bytes must be None or an int >= 0, got {run_bytes!r}")
    return StepInBackward(optimizer, run_bytes, scaler, max_norm)
