"""The one interface every backend implements, and the named types a step passes between them.

A step of a flat optimizer asks, for each flat buffer with a gradient, one :class:`StepRequest`: the
optimizer's :class:`Owner` (its rule, as data, and the fallbacks it was told of: never the optimizer), its param group, the buffer, the device's gate (``finite``: a 0-d bool, or None for an
ungated step) and the gradients to read where they are (torch's fused kernels only; None: the flat
gradient buffer).  A backend (:class:`Backend`) answers three questions:

* ``supports(rule, group, flat) -> None | reason``: whether it can run the buffer under these settings at
  all (static: decided once per settings token, :mod:`~dml_optim.backends.choose`);
* ``plan(request, route, last) -> Plan | None``: what this step will do, computed without writing anything
  (host scalars, range checks, kernel calls), routed as :class:`Route` says (the one signature of every
  backend: choose's routing of this step, each backend reading what concerns it); ``last`` is the buffer's previous plan when the step
  repeats (nothing structural changed since: the same bindings, classes and settings token), for the
  backend to reuse what it can; None: this step cannot run here (a count beyond the kernel's range),
  the rule's backend takes it;
* ``run(plan)``: only kernels.

:mod:`~dml_optim.backends.choose` decides which backend runs a buffer, once per (buffer, structural
settings): the one place, with the one cache (:class:`BufferRuntime`, per buffer).  Plans are named
types: :class:`EagerPlan` (the rule as an op chain: DirectML's path; its chunk size and scratch pool are
fields), :class:`CompiledPlan` (one ``torch.compile``'d kernel per class, keyed by
:class:`~dml_optim.core.update.KernelKey`), :class:`FusedPlan` (torch's fused CPU kernels:
:class:`KernelCall` s).

Entry point for a step of part of a buffer (a range, when its gradients are complete: the step inside
backward): a :class:`StepRequest` whose buffer's active step classes are that range and whose ``window``
holds the range's gradients (:meth:`dml_optim.core.flat.FlatBuffer.fill_window`; no flat gradient
buffer), planned and run through the same functions (:func:`dml_optim.backends.choose.plan_step`,
:func:`~dml_optim.backends.choose.run_plan`); every backend reads a range's gradients through
:func:`grad_range`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from dml_optim.core.rule import Rule
from dml_optim.core.steps import StepClass
from dml_optim.core.update import KernelKey

__all__ = ["Route", "EagerCache", "eager_cache", "CompiledCache", "HyperSlot", "Backend", "Owner", "StepRequest", "ClassUpdate", "MaskedUpdate", "KernelCall", "SteadyCall", "Plan", "EagerPlan",
           "CompiledPlan", "FusedPlan", "Decision", "BufferRuntime", "runtime", "grad_range"]


@dataclass(eq=False)
class Owner:
    """What the backends know of one optimizer, and all they know: its update as data (:class:`~dml_optim.core.rule.Rule`)
    and the backend fallbacks it was told of, each warned about once.  The optimizer keeps one, and hands it
    over in every request; a backend never calls into the optimizer."""

    rule: Rule
    compile_fallback: str | None = None  # why its rule runs eager instead of compiled (warned once)
    fused_fallback: str | None = None  # why backend="fused" could not run a buffer (warned once)

    @property
    def name(self) -> str:
        return self.rule.name


class StepRequest(NamedTuple):
    """One buffer's share of one step."""

    owner: Owner
    group: dict
    flat: Any  # dml_optim.core.flat.FlatBuffer
    finite: torch.Tensor | None = None  # the device's gate (nonfinite="skip", loss scaling), None: ungated
    grads: list | None = None  # per parameter, the gradient read where it is (fused), None: the flat buffer
    copied: bool = False  # ``grads`` were copied into the flat buffer this step (fused: read there, remembered)
    window: tuple[torch.Tensor, int] | None = None  # (gradients of a range, its first element): the range steps alone
    # a factor of the gradients, applied in the compute dtype before the rule (the step inside backward's loss
    # scaling: a float16 window is unscaled in float32, where its small values do not underflow); eager only
    grad_scale: torch.Tensor | None = None


def grad_range(flat, window: tuple[torch.Tensor, int] | None, start: int, end: int) -> torch.Tensor:
    """The gradients of elements ``[start, end)`` of ``flat``: a slice of ``window`` (a request's: a range
    stepping alone, :attr:`StepRequest.window`) or, without one, of the flat gradient buffer."""
    if window is None:
        return flat.grad[start:end]
    tensor, first = window
    if start < first or end - first > tensor.numel():
        raise RuntimeError(f"dml_optim: elements [{start}, {end}) are outside the gradient window "
                           f"[{first}, {first + tensor.numel()})")
    return tensor[start - first:end - first]


class ClassUpdate(NamedTuple):
    """The rule over one class of parameters at one step count (:class:`~dml_optim.core.steps.StepClass`)."""

    step_class: StepClass
    scalars: dict | None  # host scalars (the count known on the host, ungated), None: computed on the device


class MaskedUpdate(NamedTuple):
    """One update of a whole buffer whose parameters are at several counts
    (:func:`dml_optim.core.update.masked_scalars`)."""

    fixed: dict
    names: list
    table: torch.Tensor


class KernelCall(NamedTuple):
    """One call of a kernel: ``fn(*args, **kwargs)``."""

    fn: Callable
    args: list
    kwargs: dict


@dataclass
class Plan:
    """What one step of one buffer will do; ``backend`` names what runs it."""

    backend: ClassVar[str] = ""
    request: StepRequest = field(repr=False)

    @property
    def gated(self) -> bool:
        return self.request.finite is not None


@dataclass
class EagerPlan(Plan):
    """The eager rule (an op chain) over each active class, or one masked update of the whole buffer.

    ``chunk``: elements per call when operands are converted (0: whole ranges); ``scratch``: the kept
    scratch pool the rule and the conversions write into (the buffer's, allocated once and reused);
    ``timed``: the step's wall time counts toward ``backend="auto"``'s compile tiering."""

    backend: ClassVar[str] = "eager"
    updates: tuple = ()
    masked: MaskedUpdate | None = None
    chunk: int = 0
    scratch: tuple = ()
    timed: bool = False
    converts: bool = False  # operands are converted to the compute dtype (the rule then runs chunk by chunk)
    compiled_buffer: bool = False  # the buffer's rule compiles (its memory policy: no scratch)
    steady: SteadyCall | None = None  # a repeat's one-class step: the rule's call with its tensors bound


class SteadyCall(NamedTuple):
    """A repeat's call of the rule over a whole buffer with its tensors bound once (``eager.steady_call``):
    ``apply(*operands, scratch=scratch, **scalars)``; ``bound``: the buffer's tensors it was bound to
    (parameters, gradient, master copy, states: compared by identity), ``names``: the states' names."""

    apply: Callable[..., None]
    operands: tuple
    scratch: list
    bound: tuple
    names: tuple[str, ...]


@dataclass
class CompiledPlan(EagerPlan):
    """One compiled kernel per active class (``key``), or one masked kernel; a call the kernel declines
    (a fallback) runs the eager rule of :class:`EagerPlan` instead."""

    backend: ClassVar[str] = "compiled"
    key: KernelKey | None = None  # None: only the masked update compiles
    masked_kernel: bool = False  # the masked update runs as one compiled kernel


@dataclass
class FusedPlan(Plan):
    """torch's fused kernels: the calls (one per distinct set of keywords)."""

    backend: ClassVar[str] = "fused"
    calls: tuple = ()


class Route(NamedTuple):
    """How :mod:`~dml_optim.backends.choose` routes one step of one buffer: what every backend's ``plan`` receives
    beside the request (one signature for all: ``plan(request, route, last)``; a backend reads what concerns it)."""

    compiled: bool = False  # the buffer's rule compiles: an eager plan keeps no scratch for it
    key: Any = None  # the compiled kernel to run (the compiled backend's KernelKey); None: the eager rule
    masked: bool = False  # a masked update (parameters at several counts) runs the compiled masked kernel
    timed: bool = False  # the step's wall time counts toward backend="auto"'s tiering (eager)


@runtime_checkable
class Backend(Protocol):
    """What each backend module provides (:mod:`~dml_optim.backends.eager`, ``compiled``, ``fused``)."""

    name: str

    def supports(self, rule: Rule, group: dict, flat) -> str | None:
        """None when this backend can run ``flat`` under ``group``'s settings, else why not."""

    def plan(self, request: StepRequest, route: Route, last: Plan | None = None) -> Plan | None:
        """This step's plan (nothing written), routed as ``route`` says, or None when this step cannot run here.
        ``last``: the buffer's previous plan, when the step repeats it."""

    def run(self, plan: Plan) -> None:
        """Run ``plan``: kernels only."""


class Decision(NamedTuple):
    """Which backend runs a buffer under one set of structural settings (:mod:`~dml_optim.backends.choose`).

    ``plain``: what an ungated step runs (``"fused"``, ``"compiled"`` or ``"eager"``); ``rule``: what runs
    the rule when torch's kernel cannot (a gated step, a count beyond its range): ``"compiled"`` or
    ``"eager"``; ``masked``: a masked update (parameters at several counts) runs compiled; ``why_not_fused``:
    the reason, or None.  (The compiled kernel's key depends on the states allocated: kept beside it,
    ``BufferRuntime.key``.)"""

    plain: str
    rule: str
    masked: bool
    why_not_fused: str | None


@dataclass
class BufferRuntime:
    """A buffer's backend state (``flat.runtime``; a copy of the buffer starts without one): the decision and
    its token, how many decisions were made, the settings the buffer last stepped under, the tiering clock,
    each backend's cache (a typed object the backend owns: :class:`~dml_optim.backends.eager.EagerCache`,
    :class:`~dml_optim.backends.compiled.CompiledCache`, the fused backend's ``FusedCache``), and whether the last
    step repeated its plan."""

    settings: Any = None  # the group's validated settings at the last bind (a token: compared by identity)
    structure: Any = None  # the structural part of them (a token: equal while only scalars such as lr change)
    decision: Decision | None = None
    token: tuple | None = None  # what the decision was made for
    key: tuple | None = None  # (what it was made for, the compiled kernel key)
    decisions: int = 0  # how many decisions were made for this buffer
    eager_s: float = 0.0  # wall time of its eager steps on the CPU under backend="auto" (the tiering clock)
    fused: Any = None  # the fused backend's cache (dml_optim.backends.fused.FusedCache)
    eager: Any = None  # the eager backend's cache (dml_optim.backends.eager.EagerCache), the compiled backend's plans too
    compiled: Any = None  # the compiled backend's cache (dml_optim.backends.compiled.CompiledCache)
    repeated: bool = False  # the last step repeated its plan (no layout work, no new decision)
    read: dict | None = field(default=None)  # the gradients the last step read in place: {id: version}
    window: torch.Tensor | None = None  # the gradients of the range stepping inside backward (grown to the largest)


# -- each backend's cache of a buffer (held by its BufferRuntime; the backend alone reads and writes it) --------


class EagerCache:
    """The eager backend's cache of one buffer (``BufferRuntime.eager``; the compiled backend plans through it too):
    the padding positions per range of the layout they were made for, and the host scalars per count under the
    settings token, dtype and bits they were made for, with the compute dtype they are checked against and the
    rule's constants."""

    __slots__ = ("layout", "pads", "settings", "dtype", "bits", "scalars", "compute", "constants")

    def __init__(self) -> None:
        self.layout: Any = None  # the offsets the padding positions are of
        self.pads: dict[tuple[int, int], torch.Tensor | None] = {}  # (a, b) -> padding positions, relative to a
        self.settings: Any = None  # the settings token the scalars are for (None: made for no token, not kept)
        self.dtype: torch.dtype | None = None
        self.bits: int | None = None
        self.scalars: dict[int, dict] = {}  # count -> host scalars, range-checked
        self.compute: torch.dtype | None = None
        self.constants: dict | None = None


def eager_cache(flat) -> EagerCache:
    """The :class:`EagerCache` of ``flat`` (made the first time)."""
    rt = runtime(flat)
    cache = rt.eager
    if cache is None:
        cache = rt.eager = EagerCache()
    return cache


class HyperSlot:
    """One hyperparameter of a compiled kernel: its value and the 0-d tensor the kernel reads (filled when the value
    changes: a scheduler's new ``lr`` costs one fill)."""

    __slots__ = ("value", "tensor")

    def __init__(self, value: float, tensor: torch.Tensor) -> None:
        self.value, self.tensor = value, tensor


class CompiledCache:
    """The compiled backend's cache of one buffer (``BufferRuntime.compiled``): its kernels' hyperparameter
    tensors by name."""

    __slots__ = ("hyper",)

    def __init__(self) -> None:
        self.hyper: dict[str, HyperSlot] = {}


def runtime(flat) -> BufferRuntime:
    """The :class:`BufferRuntime` of ``flat`` (made the first time; held by the buffer, which a copy does not
    copy: a copied buffer's backends decide and plan anew)."""
    rt = flat.runtime
    if rt is None:
        rt = flat.runtime = BufferRuntime()
    return rt
