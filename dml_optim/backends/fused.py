"""The ``fused`` backend: torch's own fused CPU kernels, called on the flat buffers.

torch has hand-vectorized CPU kernels for its Adam, AdamW, Adagrad and SGD
(``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_adagrad_``,
``_fused_sgd_``, torch >= 2.4): one parallel pass over memory per tensor, a
few microseconds of overhead per call.  Each of our rules *is* one of those
computations under a mapping of its hyperparameters, which the optimizer
class declares beside its coefficients (``fused_kernel(hyper, count)``: the
kernel's name and its keyword arguments after ``count`` completed steps, or
None where no kernel computes the rule; docs/design.md §2):

* ``AdamW``: ``_fused_adamw_``, torch's own keywords; ``Adagrad``
  (T = completed steps, torch's ``step - 1``): ``_fused_adagrad_`` with
  ``lr_decay = decay_factor``, ``weight_decay = norm_coefficient``;
* ``SGD`` and ONNX ``Momentum``: ``_fused_sgd_`` with ``dampening = 1 - beta``,
  and 0 at the first step (ONNX's ``beta_adj = 1``, which torch's first step,
  a copy of the gradient into a zero buffer, equals);
* ONNX ``Adam`` and DirectML's ``ADAM_OPTIMIZER``: ``_fused_adam_`` with
  ``eps = epsilon / sqrt(1 - beta**T)``.  torch adds its epsilon after the
  bias correction (``sqrt(V) / sqrt(1 - beta**T) + eps``); that epsilon puts
  ours before it: ``(sqrt(V) + epsilon) / sqrt(1 - beta**T)``.

The update math is still written once (:mod:`dml_optim.core.functional`, what
every other backend runs); this backend is the equivalence of each rule with
torch's kernel, and the tests hold its results to the same float64 references
and torch twins as the others.  Rounding differs from the eager chain by
units in the last place (one pass in the compute dtype, no intermediate
stores), as the compiled kernel's does.

A step calls a kernel once per distinct set of keyword arguments: once for
AdamW, Adagrad and SGD's later steps whatever the step counts (each tensor of
the lists carries its own count), once per distinct count for the Adams
(their ``eps`` depends on it), at most twice for Momentum.  The tensor lists
are the whole flat buffer (one class of parameters), one range per run of
parameters at one count (``None`` gradients, unfreezing: no re-pack, no
masked update), or, when the gradients are fresh tensors of their own (after
``zero_grad(set_to_none=True)``), the parameters themselves with those
gradients, read where they are: no copy into the flat gradient buffer, which
torch.optim does not make either (:func:`reads_in_place`).

Long by design: the mapping of every rule onto torch's kernels, the reading of gradients where they are
(or their one-op copy in), and the kernel cache the steady step repeats from belong to one backend.

Where it runs: the CPU (torch's CUDA kernels exist for some rules, but the
compiled backend beats them there), parameters in float32 or float64 with
states and arithmetic in the same dtype (no master weights, Kahan summation or
quantized states: those are the compiled and eager backends' precision
modes), host step counts below 2**24 (torch's kernels read the count as a
float32), steps that are not gated (``nonfinite="skip"``, loss scaling and
``capturable`` keep their counts on the device).  ``backend="auto"`` picks it
for every such buffer on the CPU; ``backend="fused"`` asks for it and warns,
once, where it cannot run.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dml_optim.backends.base import FusedPlan, KernelCall, Owner, Route, StepRequest, runtime
from dml_optim.core.bindings import _DATA_PTR, _IS_CONTIGUOUS
from dml_optim.core.dtypes import check_range, check_step_limit, compute_dtype, dtype_limit, state_dtype
from dml_optim.core.grads import _FAST_ATTRIBUTES
from dml_optim.core.rule import Rule

__all__ = ["present_indices", "FusedCache", "FusedFallbackWarning", "FusedBackend", "BACKEND", "KERNELS", "MAX_COUNT", "LIST_MIN_ELEMENTS",
           "unsupported", "kernel_scalars", "reads_in_place", "copies_in", "copy_in", "remember_read", "kernel_calls", "warn_fallback"]


class FusedFallbackWarning(RuntimeWarning):
    """``backend="fused"`` cannot run torch's fused kernel for a buffer; ``auto``'s choice runs instead."""


#: torch's fused kernels: how many state lists each takes (missing ones are empty: AdamW without AMSGrad
#: has no ``max_exp_avg_sqs``, SGD without momentum no buffer) and whether step-count tensors follow.
KERNELS: dict[str, tuple[int, bool]] = {
    "_fused_adam_": (3, True),
    "_fused_adamw_": (3, True),
    "_fused_adagrad_": (1, True),
    "_fused_sgd_": (1, False),
}
#: Step numbers (completed steps + 1) are handed to torch's kernels in float32 tensors: exact below 2**24.
MAX_COUNT = (1 << 24) - 2
#: Fresh gradients (tensors of their own) are read in place, parameter by parameter, when the parameters
#: with a gradient average this many elements; smaller ones are copied into the flat buffer first (one
#: foreach copy: :func:`copies_in`).  A kernel call costs about 2 us per tensor, about what copying 4k
#: float32 elements costs: measured on 2 cores, 1 thread, the ``loops`` bench's GPT (30 tensors, 0.46M
#: parameters, 15k elements on average) under ``zero_grad(set_to_none=True)`` and ``LambdaLR``, torch
#: fused's time over ours was 0.77x with 16k here (every gradient copied) and 1.08x with 4k (read in place).
LIST_MIN_ELEMENTS = 1 << 12
_DTYPES = (torch.float32, torch.float64)
_VERSION = operator.attrgetter("_version")
_IS_NOT_NONE = functools.partial(operator.is_not, None)


def kernel_scalars(op: str, kwargs: dict[str, Any], steps) -> float:
    """The largest magnitude among the scalars torch's kernel ``op`` computes in float64 and rounds to the
    parameters' dtype, over step numbers ``steps`` (count + 1: a number, or a float64 tensor): a value beyond that
    dtype's range would be written as inf, where the rule itself may be finite (AdamW: the kernel's
    ``lr / (1 - beta1**t)`` overflows float32 before the rule's ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``
    does), so such counts take the other backends' path."""
    values = [abs(v) for v in kwargs.values() if isinstance(v, float)]
    if op in ("_fused_adam_", "_fused_adamw_"):
        log_beta1 = math.log(kwargs["beta1"]) if kwargs["beta1"] > 0 else -math.inf
        if isinstance(steps, torch.Tensor):
            values.append((kwargs["lr"] / torch.expm1(steps * log_beta1).neg()).abs().max().item())
        else:
            values.append(abs(kwargs["lr"] / -math.expm1(steps * log_beta1)))
        values.append(abs(kwargs["lr"] * kwargs["weight_decay"]))
    if op == "_fused_sgd_":
        values.append(abs(1 - kwargs["dampening"]))
    return max(values)


def _available(op: str) -> bool:
    return callable(getattr(torch, op, None))


def unsupported(rule: Rule, group: dict[str, Any], flat) -> str | None:
    """Why ``flat`` cannot run torch's fused kernel under ``group``'s settings, or None when it can.

    Static: what the settings and the buffer allow (a step's counts are checked by :func:`plan`)."""
    if flat.device.type != "cpu":
        return f"torch's fused kernels run on the CPU here, the buffer is on {flat.device}"
    if flat.dtype not in _DTYPES:
        return f"{flat.dtype} parameters (torch's kernel rounds them differently from the rule's ops; float32 and float64 only)"
    if flat.bits is not None or group["master_weights"] or group["kahan"]:
        return "quantized states, master weights and Kahan summation are the compiled and eager backends' precision modes"
    if state_dtype(group, flat.dtype) != flat.dtype or compute_dtype(group, flat.dtype) != flat.dtype:
        return "state_dtype or compute_dtype differs from the parameters' dtype"
    if group["capturable"]:
        return "capturable=True keeps the step counts on the device"
    if group["nonfinite"] == "skip":
        return "nonfinite='skip' gates every step on the device (its counts live there)"
    if rule.fused is None:
        return f"torch has no fused kernel of {rule.name}'s rule"
    kernel = rule.fused_kernel(group, 0)
    if kernel is None:
        return f"{rule.name}'s rule with these hyperparameters is not one of torch's fused kernels"
    if not _available(kernel[0]):
        return f"torch {torch.__version__} has no torch.{kernel[0]}"
    return None


def reads_in_place(flat, grads: list, active: list[bool] | None) -> bool:
    """Whether a fused step reads ``grads`` (each parameter's ``.grad``, or None) where they are instead of
    gathering them into the flat gradient buffer: every one contiguous, the parameters with a gradient
    large enough on average (:data:`LIST_MIN_ELEMENTS`) for a call per tensor to cost less than a copy, and
    none of them an accumulation buffer: a tensor the last step read in place and something has written
    since (its version counter moved: backward accumulating into a gradient that stays, a
    ``zero_grad(set_to_none=False)`` of the model's) is gathered once, and its parameter holds a view of
    the flat buffer from then on, so the following steps need no per-parameter work.  Fresh tensors (after
    ``zero_grad(set_to_none=True)``) and the same read-only tensors handed over again are read in place."""
    if flat.staged:
        return False
    index = present_indices(grads, active)
    if not index or sum(map(flat.sizes.__getitem__, index)) < LIST_MIN_ELEMENTS * len(index):
        return False
    present = grads if len(index) == len(grads) else list(map(grads.__getitem__, index))
    last = runtime(flat).read
    if last:  # (an id reused by a fresh tensor reads as written-into at worst: gathered once, harmless)
        now = list(map(_VERSION, present))
        if list(map(last.get, map(id, present), now)) != now:  # (a tensor not read last step: its own version)
            return False
    with _FAST_ATTRIBUTES():
        return all(map(_IS_CONTIGUOUS, present))


def present_indices(grads: list, active: list[bool] | None) -> list[int] | range:
    """The indices of the gradients present (and active): every one without a Python pass when none is None."""
    if active is None and all(map(_IS_NOT_NONE, grads)):
        return range(len(grads))
    return [i for i, g in enumerate(grads) if g is not None and (active is None or active[i])]


def copies_in(flat, grads: list, active: list[bool] | None) -> bool:
    """Whether a fused step copies ``grads`` (each parameter's ``.grad``, or None; every present one a tensor of
    its own, fresh after ``zero_grad(set_to_none=True)``) into the flat gradient buffer with one op
    (:func:`copy_in`) and leaves ``p.grad`` the caller's, as torch.optim does: the gradients too small to be
    read in place (:func:`reads_in_place`), none of them written into since the last step read them (an
    accumulation buffer is gathered and adopted, its parameter then holding its view), none inside the
    buffer's own gradient storage, in an unpadded layout, and not the first gradients the buffer meets (those
    are gathered and adopted, ``p.grad`` becoming its view: a loop that keeps its gradients then steps with
    no copy at all).  The slots of parameters without a gradient are not read (the plan steps the runs with
    one)."""
    if (flat.staged or flat.align != 1 or flat.grad is None or not hasattr(torch, "_foreach_copy_")
            or flat.device.type not in ("cpu", "cuda")):
        return False  # (the first gradients a buffer meets are gathered and adopted: they may be ones that stay)
    index = present_indices(grads, active)
    if not index:
        return False
    present = grads if len(index) == len(grads) else list(map(grads.__getitem__, index))
    last = runtime(flat).read
    if last:
        now = list(map(_VERSION, present))
        if list(map(last.get, map(id, present), now)) != now:
            return False
    storage = flat.grad.untyped_storage()
    lo = storage.data_ptr()
    with _FAST_ATTRIBUTES():
        ptrs = sorted(map(_DATA_PTR, present))
    first = bisect.bisect_left(ptrs, lo)  # (the first gradient at or after the buffer's start: inside it?)
    return first == len(ptrs) or ptrs[first] >= lo + storage.nbytes()


def copy_in(flat, grads: list) -> None:
    """Copy the present ``grads`` into their slots of the flat gradient buffer (one foreach op)."""
    flat.release_held()  # (a view of it kept elsewhere: copied into a new one)
    flat.ensure_grad()
    views = _cache(flat).grad_views(flat)
    index = present_indices(grads, None)
    if len(index) == len(grads):
        torch._foreach_copy_(views, grads)
    else:
        pick = operator.itemgetter(*index) if len(index) > 1 else (lambda seq, i=index[0]: (seq[i],))
        torch._foreach_copy_(list(pick(views)), list(pick(grads)))


def remember_read(flat, grads: list | None) -> None:
    """After a step: the gradients it read in place (``grads``, None: none), their ids and versions, for
    :func:`reads_in_place`."""
    rt = runtime(flat)
    if grads is None:
        rt.read = None
        return
    present = [g for g in grads if g is not None]
    rt.read = dict(zip(map(id, present), map(_VERSION, present)))


class FusedCache:
    """Per buffer: the step numbers torch's kernels read (float32 0-d tensors, made 256 counts at a time and
    only read), the kernels' keywords per count, per-parameter views of the states and the argument lists of a
    whole-buffer call, kept while the layout and the state tensors stay the same; the range-checked blocks of
    counts."""

    __slots__ = ("offsets", "numbers", "kernels", "states", "whole_call", "checked", "grads")

    def __init__(self, flat):
        self.offsets = flat.offsets
        self.numbers: dict[int, tuple[torch.Tensor, ...]] = {}  # blocks of step-number tensors (:meth:`steps`)
        self.kernels: tuple = (None, {})  # (settings token, {class of counts: (kernel, keywords, key)}): :meth:`kernel`
        self.states: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.whole_call: tuple | None = None  # the call of a step of the whole buffer (:meth:`whole`)
        self.checked: tuple = (None, set())  # (settings token, blocks of counts whose scalars passed the range check)
        self.grads: tuple | None = None  # (the flat gradient buffer, its per-parameter views): :meth:`grad_views`

    def steps(self, counts: list[int]) -> list[torch.Tensor]:
        """The step numbers ``count + 1`` of ``counts`` as torch's kernels read them: float32 0-d tensors, views of
        blocks of 256 made at once and kept (the kernels only read them), so a step writes no step tensor."""
        lo, hi = min(counts) >> 8, max(counts) >> 8
        if hi - lo > 1:
            return [self._block(n >> 8)[n & 255] for n in counts]
        views = self._block(lo) if hi == lo else self._block(lo) + self._block(hi)  # (counts a step apart: 1 or 2)
        return list(map(views.__getitem__, map((lo << 8).__rsub__, counts)))

    def _block(self, block: int) -> tuple[torch.Tensor, ...]:
        views = self.numbers.get(block)
        if views is None:
            if len(self.numbers) >= 16:
                self.numbers.clear()
            first = block << 8
            with _disable_current_modes():  # (host bookkeeping, not the step's work: no op counter sees it)
                views = self.numbers[block] = torch.arange(first + 1, first + 257, dtype=torch.float32,
                                                           device="cpu").unbind(0)
        return views

    def kernel(self, rule: Rule, group: dict[str, Any], settings, count: int) -> tuple[str, dict[str, Any], tuple]:
        """``rule.fused_kernel(group, count)`` and a key equal for equal calls, kept while the group's validated
        ``settings`` (the buffer's settings token) stay the same: the Adams' keywords depend on the count, and
        most of a step's counts were met before, or computed ahead by the range check of their block of counts
        (``EngineMixin._counts_fit``), so a steady step finds its own."""
        if self.kernels[0] is not settings or len(self.kernels[1]) >= 4096:
            self.kernels = (settings, {})
        like = _alike(rule, count)
        found = self.kernels[1].get(like)
        if found is None:
            op, kwargs = rule.fused_kernel(group, count)
            found = self.kernels[1][like] = (op, kwargs, (op, *kwargs.items()))
        return found

    def whole(self, rule: Rule, group: dict[str, Any], flat, count: int) -> KernelCall:
        """The kernel call over the whole buffer after ``count`` completed steps (the steady step): the keywords
        of :meth:`kernel`, and the argument lists kept while the structural settings, the kernel and the
        buffer's tensors stay the same (identities: a few pointer comparisons a step), the step number put in
        place (a view of :meth:`steps`' blocks)."""
        rt = runtime(flat)
        op, kwargs, _ = self.kernel(rule, group, rt.settings, count)
        settings = rt.structure
        kept = self.whole_call  # (settings, op, state names, data, grad, states, argument lists, whether steps follow)
        if (kept is None or kept[0] is not settings or kept[1] != op or kept[3] is not flat.data
                or kept[4] is not flat.grad or not all(map(operator.is_, kept[5], map(flat.states.get, kept[2])))):
            names = rule.group_state_names(group)
            states = tuple(flat.states[n] for n in names)
            n_states, has_steps = KERNELS[op]
            args = ([[flat.data], [flat.grad]] + [[t] for t in states] + [[] for _ in range(n_states - len(names))]
                    + ([[]] if has_steps else []))
            kept = self.whole_call = (settings, op, names, flat.data, flat.grad, states, args, has_steps)
        args = kept[6]
        if kept[7]:  # (SGD's kernel reads no step number)
            args[-1] = [self._block(count >> 8)[count & 255]]
        return KernelCall(getattr(torch, op), args, kwargs)  # (looked up at each call, as every call of this module does)

    def grad_views(self, flat) -> list[torch.Tensor]:
        """Per-parameter views of the flat gradient buffer (parameter shapes), kept while it stays."""
        kept = self.grads
        if kept is None or kept[0] is not flat.grad:
            kept = self.grads = (flat.grad, flat.views(flat.grad))
        return kept[1]

    def state_views(self, flat, name: str) -> list[torch.Tensor]:
        tensor = flat.states[name]
        cached = self.states.get(name)
        if cached is None or cached[0] is not tensor:
            cached = self.states[name] = (tensor, flat.views(tensor))
        return cached[1]


def _alike(rule: Rule, count: int) -> int:
    """The class of ``count`` among counts whose kernel keywords are equal (``rule.fused_counts``): every count
    (``"none"``), the first step apart (``"first"``), or each count its own (``"each"``)."""
    vary = rule.fused_counts
    return count if vary == "each" else 0 if vary == "none" else min(count, 1)


def _cache(flat) -> FusedCache:
    rt = runtime(flat)
    cache = rt.fused
    if cache is None or cache.offsets is not flat.offsets:
        cache = rt.fused = FusedCache(flat)
    return cache


def kernel_calls(rule: Rule, group: dict[str, Any], flat, grads: list | None, members: list,
                 counts: list[int | None]) -> list | None:
    """The kernel calls of one step of ``flat``, or None when a count rules them out.

    ``grads``: per parameter, the gradient to read in place (None: no gradient), or None when the
    gradients are in the flat buffer.  ``members``: what steps, with ``counts``, the count of each: the
    parameters with a gradient (``grads`` given: :meth:`dml_optim.core.steps.StepCounter.active_params`) or the
    runs ``(first, stop)`` of them at one count (:meth:`~dml_optim.core.steps.StepCounter.active_runs`).
    Nothing is written here: the result is a :class:`~dml_optim.backends.base.KernelCall` per call; the
    step numbers are tensors made once per 256 counts (:meth:`FusedCache.steps`), so running it writes
    nothing but the kernels' outputs.
    """
    cache = _cache(flat)
    if not counts or None in counts or max(counts) > MAX_COUNT:
        return None
    if grads is None and len(members) == 1 and members[0][1] - members[0][0] == len(flat.params):  # the steady step
        return [cache.whole(rule, group, flat, counts[0])]
    names = rule.group_state_names(group)
    settings = runtime(flat).settings
    if counts.count(counts[0]) == len(counts):  # one count (a single class): one call, one step tensor
        return _calls(flat, grads, names, cache, [(cache.kernel(rule, group, settings, counts[0]), members,
                                                   cache.steps(counts[:1]) * len(members))])
    # the step tensor of each distinct count, and the call its count belongs to
    distinct = list(dict.fromkeys(counts))
    steps = dict(zip(distinct, cache.steps(distinct)))
    if _alike(rule, min(distinct)) == _alike(rule, max(distinct)):  # (the classes grow with the count) one call
        return _calls(flat, grads, names, cache, [(cache.kernel(rule, group, settings, counts[0]), members,
                                                   list(map(steps.__getitem__, counts)))])
    kernels = {n: cache.kernel(rule, group, settings, n) for n in distinct}
    calls: dict[tuple, tuple[tuple, list, list]] = {}  # per distinct call (equal keywords): (call, members, steps)
    for member, n in zip(members, counts):
        kernel = kernels[n]
        entry = calls.get(kernel[2])
        if entry is None:
            entry = calls[kernel[2]] = (kernel, [], [])
        entry[1].append(member)
        entry[2].append(steps[n])
    return _calls(flat, grads, names, cache, list(calls.values()))


def _calls(flat, grads: list | None, names: tuple[str, ...], cache: FusedCache, calls: list) -> list:
    """:func:`plan`'s calls from ``(:meth:`FusedCache.kernel`'s entry, members, their step tensors)`` per call."""
    out = []
    states = [cache.state_views(flat, n) for n in names] if grads is not None else [flat.states[n] for n in names]
    for (op, kwargs, _), chosen, step_list in calls:
        if grads is not None and len(chosen) == len(flat.params):  # every parameter, the gradients read in place
            operands = [flat.params, grads, *states]  # (the kernels only read lists)
        elif grads is not None:  # parameter by parameter: the parameters, the gradients read in place
            if len(chosen) == 1:
                i = chosen[0]
                operands = [[flat.params[i]], [grads[i]], *[[t[i]] for t in states]]
            else:
                pick = operator.itemgetter(*chosen)
                operands = [list(pick(flat.params)), list(pick(grads)), *[list(pick(t)) for t in states]]
        else:  # run by run: ranges of the flat buffers
            bounds = [flat.segment(first, stop) for first, stop in chosen]
            operands = [[t[a:b] for a, b in bounds] for t in [flat.data, flat.grad, *states]]
        n_states, has_steps = KERNELS[op]
        args = operands + [[] for _ in range(n_states - len(names))] + ([step_list] if has_steps else [])
        out.append(KernelCall(getattr(torch, op), args, kwargs))
    return out


def warn_fallback(owner: Owner, reason: str) -> None:
    """``backend="fused"`` cannot run a buffer of ``owner``'s optimizer: warn once per optimizer
    (:attr:`Owner.fused_fallback`)."""
    if owner.fused_fallback is not None:
        return
    owner.fused_fallback = reason
    warnings.warn(f"dml_optim: {owner.name} cannot use the fused backend: {reason}; running what "
                  "backend='auto' chooses instead", FusedFallbackWarning, stacklevel=5)



#: How many counts a range check covers at once (:meth:`FusedBackend._checked`).
_AHEAD = 256


class FusedBackend:
    """torch's fused CPU kernels over the flat buffers (see the module docstring)."""

    name = "fused"

    def supports(self, rule: Rule, group, flat) -> str | None:
        return unsupported(rule, group, flat)

    def plan(self, request: StepRequest, route: Route = Route(), last=None) -> FusedPlan | None:
        """The kernel calls of this step (:func:`kernel_calls`), after the same step-limit and range checks as
        the other backends (the rule's scalars, and torch's kernel's), or None when a count rules the kernel
        out (the rule's backend runs the step)."""
        owner, group, flat, grads = request.owner, request.group, request.flat, request.grads
        rule = owner.rule
        if request.copied:  # (copied into the flat buffer: the kernel reads it there)
            grads = None
        members, counts = flat.counter.active_params() if grads is not None else flat.counter.active_runs()
        calls = kernel_calls(rule, group, flat, grads, members, counts)
        if calls is None or not self._checked(rule, group, flat, counts):
            return None
        return FusedPlan(request, calls=calls)

    def run(self, plan: FusedPlan) -> None:
        for fn, args, kwargs in plan.calls:
            fn(*args, **kwargs)

    @staticmethod
    def _checked(rule: Rule, group, flat, counts: list[int]) -> bool:
        """Counts ``counts`` are within the step limit with scalars the compute dtype holds (raises) and torch's
        kernel computes finite scalars for them (False: the rule runs as written).  Under settings met before,
        whole blocks of :data:`_AHEAD` counts are checked at once and remembered; under settings new this step
        (a scheduler's new ``lr``) this step's counts alone, with host floats: a few microseconds."""
        rt = runtime(flat)
        cache = rt.fused
        checked = cache.checked  # (settings, {n // _AHEAD: the counts of that block passed under them} or None)
        if checked[0] is not rt.settings:
            cache.checked = (rt.settings, None)  # (met once: this step's counts alone)
            return all(_count_fits(rule, group, flat, n, cache) for n in set(counts))
        if checked[1] is None:
            checked = cache.checked = (rt.settings, set())
        blocks = checked[1]
        if (counts[0] // _AHEAD in blocks if len(counts) == 1  # (the constants were checked with the settings)
                else set(map(_AHEAD.__rfloordiv__, counts)) <= blocks):
            return True
        for n in sorted(set(counts)):
            if n // _AHEAD not in blocks:
                if _counts_in_range(rule, group, flat, n - n % _AHEAD, _AHEAD):  # (a block at once: 1 check in 256)
                    if len(blocks) >= 64:
                        blocks.clear()
                    blocks.add(n // _AHEAD)
                    continue
                if not _count_fits(rule, group, flat, n, cache):  # (one of the block's counts is out of range)
                    return False
        return True


def _count_fits(rule, group, flat, n: int, cache: FusedCache) -> bool:
    """Count ``n`` alone: the step limit and the rule's scalars (raises), torch's kernel's scalars (False)."""
    check_step_limit(rule, n)
    check_range(group, flat, rule.coefficients(group, n + rule.step_offset))
    op, kwargs, _ = cache.kernel(rule, group, runtime(flat).settings, n)
    return kernel_scalars(op, kwargs, n + 1.0) <= dtype_limit(compute_dtype(group, flat.dtype, flat.bits)) * (1 - 1e-9)


def _counts_in_range(rule, group, flat, first: int, n: int) -> bool:
    """Counts ``first .. first + n - 1`` are within the step limit and give per-step scalars the compute
    dtype holds: the rule's (its coefficients computed over a float64 tensor of the counts, a few ops for
    all) and those torch's fused kernel computes (:func:`kernel_scalars`)."""
    if first + n > rule.max_step:
        return False
    limit = dtype_limit(compute_dtype(group, flat.dtype, flat.bits))
    limit *= 1 - 1e-9  # (a margin for the tensor arithmetic's rounding; NaN fails every comparison)
    with _disable_current_modes():  # (host arithmetic on CPU tensors, not the step's work: no recorder sees it)
        counts = torch.arange(first, first + n, dtype=torch.float64, device="cpu")  # (not a default device set)
        worst = [v.abs().max().item() if isinstance(v, torch.Tensor) else abs(v)
                 for v in rule.coefficients(group, counts + rule.step_offset).values()]
        # the kernel's keywords through the buffer's cache (FusedCache.kernel): the Adams' differ per count, and the
        # steps that follow find the ones of their counts computed here
        kernel = _cache(flat).kernel
        settings = runtime(flat).settings
        if rule.fused_counts == "each":  # (its keywords differ per count: each with its own step number)
            for like in range(first, first + n):
                op, kwargs, _ = kernel(rule, group, settings, like)
                worst.append(kernel_scalars(op, kwargs, like + 1.0))
        else:
            for like in dict.fromkeys((first, first + n - 1)):
                op, kwargs, _ = kernel(rule, group, settings, like)
                worst.append(kernel_scalars(op, kwargs, counts + 1))
    return all(w <= limit for w in worst)


#: The fused backend.
BACKEND = FusedBackend()
