"""The test matrix: every optimizer as data, one entry each (like torch's ``optim_db`` / optimi's ``OptTest``).

An :class:`Entry` says, for one registry name, what the tests need to know
and must not take from the code under test:

* ``dtypes``: the parameter dtypes the tests run, widest first (DmlAdam:
  float32 and float16 only, DirectML's ADAM_OPTIMIZER has no float64);
* ``variants``: representative hyperparameters (:class:`Variant`), each for
  two param groups, the first being the entry's default; a variant has an
  exact torch.optim twin or not (``twin``);
* ``twin``: the torch.optim construction of docs/design.md §2's equivalences,
  written out by hand (``to_torch``), not read from the registry;
* ``reference``: one step of the float64 NumPy reference
  (``tests/reference/numpy_ref.py``), per parameter;
* ``states``: torch.optim's state names (per hyperparameters: AMSGrad adds
  one); ``intervals``: the valid range of each float hyperparameter (the
  bad-input catalogue's source); ``epsilon``: the epsilon's name, for the
  float16 modes that need a representable one.

:func:`cases` turns the entries into pytest params over the axes
optimizer variant x dtype x backend x device:

* backend: ``eager``; ``compiled`` is marked ``slow`` and skipped, with the
  reason, where inductor is unavailable (``compile_available``); ``fused``
  (torch's fused CPU kernels on the flat buffers, ``dml_optim/backends/fused.py``):
  CPU only, float32/float64, and only the variants whose hyperparameters
  (both param groups) the kernel takes (:meth:`Case.fuses`: not ONNX Adam's
  ``norm_coefficient_post``); :func:`cases` leaves the other combinations out
  (:func:`fused_cases` asks for them), and the twin of a fused case is
  torch's ``fused=True`` optimizer, which it equals bit for bit when every
  parameter spans whole 64-byte units (:data:`FUSED_UNIT_ELEMENTS`);
* device: ``cpu``; ``cuda`` skipped, with the reason, when
  ``torch.cuda.is_available()`` is False, so a machine with a GPU runs the
  whole matrix on it.

Adding an optimizer: one registry entry (``dml_optim/optimizers/registry.py``)
and one :data:`ENTRIES` entry here; ``test_optimizers.py::test_matrix_covers_the_registry``
fails until both exist.

Consumers: the behaviour tests (``test_optimizers.py``: every case against the
torch twin and the float64 reference, eager and compiled, and the precision
modes; ``test_optimizer_behaviour.py``, ``test_state_dict.py``,
``test_backends.py``), the checkpoint, atomic-step, non-finite and loss-scaling
tests (``classes()``: one case per optimizer and device), the bad-input
catalogue (``Entry.intervals``) and the audit (every variant's two
hyperparameter sets).  :func:`case_of` picks one case for a test about one
optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pytest
import torch

from dml_optim.backends.compiled import compile_available
from dml_optim.optimizers import registry
from reference import numpy_ref as ref

F64, F32, F16 = torch.float64, torch.float32, torch.float16
DEVICES = ("cpu", "cuda")
BACKENDS = ("eager", "compiled", "fused")
#: The parameter dtypes the fused backend runs (torch's fused kernels; other dtypes fall back).
FUSED_DTYPES = (torch.float64, torch.float32)
#: torch's CPU fused kernels split each tensor of their lists into 64-byte units, computed with vector
#: FMAs, and a remainder computed with scalar code, which rounds differently (1 ulp in states from the
#: second step on, torch 2.4.1 and 2.13, AVX-512).  The fused backend hands them a flat buffer, torch.optim
#: one tensor per parameter: the two agree bit for bit when every parameter has a multiple of this many
#: elements (whole units in either dtype, with room for 128-byte lines), else to rounding.
FUSED_UNIT_ELEMENTS = 32
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class NoTwin(ValueError):
    """These hyperparameters have no exact torch.optim equivalent (docs/design.md §2)."""


# -- torch twins, written out (docs/design.md §2), and the float64 references -------------------


def _zero_epsilon(h, name="epsilon"):
    if h[name] != 0:
        raise NoTwin(f"{name}={h[name]}: ONNX/DirectML add epsilon before the bias correction, torch after it")
    return 0.0


def _adam_to_torch(h):
    if h.get("norm_coefficient_post", 0.0) != 0:
        raise NoTwin("norm_coefficient_post: torch.optim.Adam has no post-update decay")
    return dict(lr=h["lr"], betas=(h["alpha"], h["beta"]), eps=_zero_epsilon(h), weight_decay=h["norm_coefficient"])


def _dml_adam_to_torch(h):
    return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=_zero_epsilon(h))


def _adamw_to_torch(h):
    return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
                amsgrad=h["amsgrad"], maximize=h["maximize"])


def _adagrad_to_torch(h):
    return dict(lr=h["lr"], lr_decay=h["decay_factor"], eps=h["epsilon"], weight_decay=h["norm_coefficient"],
                initial_accumulator_value=h.get("initial_accumulator_value", 0.0), maximize=h.get("maximize", False))


def _sgd_to_torch(h):
    return {k: h[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")}


def _momentum_to_torch(h):
    nesterov = h["mode"] == "nesterov"
    if nesterov and h["beta"] != 1:
        raise NoTwin("torch.optim.SGD's nesterov needs dampening 0, i.e. beta=1")
    return dict(lr=h["lr"], momentum=h["alpha"], dampening=1.0 - h["beta"], nesterov=nesterov,
                weight_decay=h["norm_coefficient"])


def _adam_ref(h, k, x, g, s):
    """ONNX Adam-1 at T = k + 1 (k completed steps)."""
    (xn,), (v,), (hh,) = ref.onnx_adam(h["lr"], k + 1, [x], [g], [s[0]], [s[1]], alpha=h["alpha"], beta=h["beta"],
                                       epsilon=h["epsilon"], norm_coefficient=h["norm_coefficient"],
                                       norm_coefficient_post=h.get("norm_coefficient_post", 0.0))
    return xn, [v, hh]


def _dml_adam_ref(h, k, x, g, s):
    """DirectML ADAM_OPTIMIZER at T = k + 1."""
    xn, m, v = ref.dml_adam(x, s[0], s[1], g, k + 1, learning_rate=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                            epsilon=h["epsilon"])
    return xn, [m, v]


def _adamw_ref(h, k, x, g, s):
    """torch.optim.AdamW's documented algorithm at t = k + 1."""
    xn, m, v, vmax = ref.torch_adamw(x, g, s[0], s[1], s[2] if h["amsgrad"] else None, k + 1, lr=h["lr"],
                                     beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                                     weight_decay=h["weight_decay"], amsgrad=h["amsgrad"], maximize=h["maximize"])
    return xn, [m, v] + ([vmax] if h["amsgrad"] else [])


def _adagrad_ref(h, k, x, g, s):
    """ONNX Adagrad-1 at T = k (k completed steps); with torch's ``maximize``, torch.optim.Adagrad's
    documented algorithm at t = k + 1 (ONNX has no maximize)."""
    if h.get("maximize", False):
        xn, hh = ref.torch_adagrad(x, g, s[0], k + 1, lr=h["lr"], lr_decay=h["decay_factor"],
                                   weight_decay=h["norm_coefficient"], eps=h["epsilon"], maximize=True)
        return xn, [hh]
    (xn,), (hh,) = ref.onnx_adagrad(h["lr"], k, [x], [g], [s[0]], decay_factor=h["decay_factor"],
                                    epsilon=h["epsilon"], norm_coefficient=h["norm_coefficient"])
    return xn, [hh]


def _sgd_ref(h, k, x, g, s):
    """torch.optim.SGD's documented algorithm at t = k + 1."""
    xn, b = ref.torch_sgd(x, g, s[0] if s else None, k + 1, lr=h["lr"], momentum=h["momentum"],
                          dampening=h["dampening"], weight_decay=h["weight_decay"], nesterov=h["nesterov"],
                          maximize=h["maximize"])
    return xn, ([b] if b is not None else [])


def _no_twin(h):
    raise NoTwin("torch.optim has no Lion")


def _lion_ref(h, k, x, g, s):
    """Lion, Chen et al. 2023, Algorithm 2 (no step count in the update)."""
    xn, m = ref.lion(x, g, s[0], lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"],
                     maximize=h.get("maximize", False))
    return xn, [m]


def _momentum_ref(h, k, x, g, s):
    """ONNX Momentum-1 at T = k."""
    (xn,), (v,) = ref.onnx_momentum(h["lr"], k, [x], [g], [s[0]], alpha=h["alpha"], beta=h["beta"], mode=h["mode"],
                                    norm_coefficient=h["norm_coefficient"])
    return xn, [v]


# -- the entries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """Hyperparameters (our names) for two param groups; ``hyper`` also builds one-group optimizers."""

    id: str
    hyper: Mapping[str, Any]
    second: Mapping[str, Any]


#: (name, low, high, high_open): None is unbounded; every low end is closed
Interval = tuple[str, float, float | None, bool]


@dataclass(frozen=True)
class Entry:
    name: str
    dtypes: tuple[torch.dtype, ...]
    variants: tuple[Variant, ...]
    torch_class: type | None  # None: torch.optim has no twin (Lion); ``to_torch`` raises NoTwin
    to_torch: Callable[[Mapping[str, Any]], dict]
    reference: Callable
    intervals: tuple[Interval, ...]
    states: tuple[str, ...]
    #: the epsilon hyperparameter's name (None: the rule has none)
    epsilon: str | None
    #: tolerance overrides against the torch twin over many steps, per dtype (see tests/tolerances.py)
    torch_tolerance: Mapping[torch.dtype, dict] = field(default_factory=dict)
    #: extra states for some hyperparameters: (predicate, names)
    extra_states: tuple[tuple[Callable[[Mapping[str, Any]], bool], tuple[str, ...]], ...] = ()
    #: hyperparameters under which the rule keeps no state at all (torch.optim.SGD without momentum)
    stateless: Callable[[Mapping[str, Any]], bool] = lambda h: False
    #: the value a fresh state starts at, by hyperparameters (torch.optim.Adagrad's initial_accumulator_value)
    initial: Callable[[Mapping[str, Any]], float] = lambda h: 0.0

    @property
    def cls(self):
        return registry.get(self.name)

    @property
    def default(self) -> Variant:
        return self.variants[0]

    def states_for(self, hyper: Mapping[str, Any]) -> tuple[str, ...]:
        if self.stateless(hyper):
            return ()
        return self.states + tuple(n for pred, names in self.extra_states if pred(hyper) for n in names)

    def twin_kwargs(self, hyper: Mapping[str, Any]) -> dict | None:
        """torch.optim keyword arguments of the exact twin of ``hyper``, or None if there is none."""
        try:
            return self.to_torch(hyper)
        except NoTwin:
            return None


from tolerances import TORCH_ADAM_FLOAT32  # noqa: E402  (the one tolerance table)

_UNIT_OPEN = (0.0, 1.0, True)
ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry(
        "adam", (F64, F32),
        (
            Variant("adam", dict(lr=1e-2, alpha=0.9, beta=0.999, epsilon=0.0, norm_coefficient=0.0),
                    dict(lr=3e-3, alpha=0.8, beta=0.99, epsilon=0.0, norm_coefficient=0.01)),
            # epsilon placement and the post-update decay: no torch.optim twin, float64 reference only
            Variant("adam-norm-coefficients",
                    dict(lr=1e-2, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.01),
                    dict(lr=3e-3, alpha=0.8, beta=0.99, epsilon=1e-3, norm_coefficient=0.05, norm_coefficient_post=0.001)),
        ),
        torch.optim.Adam, _adam_to_torch, _adam_ref,
        (("lr", 0, None, False), ("alpha", *_UNIT_OPEN), ("beta", *_UNIT_OPEN), ("epsilon", 0, None, False),
         ("norm_coefficient", 0, None, False), ("norm_coefficient_post", 0, 1, False)),
        ("exp_avg", "exp_avg_sq"), "epsilon", {F32: TORCH_ADAM_FLOAT32},
    ),
    Entry(
        "dml-adam", (F32, F16),
        (
            Variant("dml-adam", dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=0.0),
                    dict(lr=2e-3, beta1=0.85, beta2=0.98, epsilon=0.0)),
            Variant("dml-adam-epsilon", dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8),
                    dict(lr=2e-3, beta1=0.85, beta2=0.98, epsilon=1e-4)),
        ),
        torch.optim.Adam, _dml_adam_to_torch, _dml_adam_ref,
        (("lr", 0, None, False), ("beta1", *_UNIT_OPEN), ("beta2", *_UNIT_OPEN), ("epsilon", 0, None, False)),
        ("exp_avg", "exp_avg_sq"), "epsilon", {F32: TORCH_ADAM_FLOAT32},
    ),
    Entry(
        "adamw", (F64, F32),
        (
            Variant("adamw", dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False),
                    dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, amsgrad=False, maximize=False)),
            Variant("adamw-amsgrad",
                    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False),
                    dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, amsgrad=True, maximize=False)),
            Variant("adamw-maximize",
                    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=True),
                    dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, amsgrad=False, maximize=True)),
        ),
        torch.optim.AdamW, _adamw_to_torch, _adamw_ref,
        (("lr", 0, None, False), ("beta1", *_UNIT_OPEN), ("beta2", *_UNIT_OPEN), ("eps", 0, None, False),
         ("weight_decay", 0, None, False)),
        ("exp_avg", "exp_avg_sq"), "eps",
        extra_states=((lambda h: h["amsgrad"], ("max_exp_avg_sq",)),),
    ),
    Entry(
        "adagrad", (F64, F32),
        (
            Variant("adagrad", dict(lr=0.1, decay_factor=0.01, epsilon=1e-10, norm_coefficient=0.0),
                    dict(lr=0.05, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.02)),
            # torch's keywords: maximize (with the L2 term, whose sign it does not flip) and the initial sum
            Variant("adagrad-maximize",
                    dict(lr=0.1, decay_factor=0.01, epsilon=1e-10, norm_coefficient=0.02, maximize=True,
                         initial_accumulator_value=0.1),
                    dict(lr=0.05, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0, maximize=True,
                         initial_accumulator_value=0.1)),
        ),
        torch.optim.Adagrad, _adagrad_to_torch, _adagrad_ref,
        (("lr", 0, None, False), ("decay_factor", 0, None, False), ("epsilon", 0, None, False),
         ("norm_coefficient", 0, None, False), ("initial_accumulator_value", 0, None, False)),
        ("sum",), "epsilon",
        initial=lambda h: h.get("initial_accumulator_value", 0.0),
    ),
    Entry(
        "momentum", (F64, F32),
        (
            Variant("momentum-standard", dict(lr=0.05, alpha=0.9, beta=0.8, mode="standard", norm_coefficient=0.0),
                    dict(lr=0.02, alpha=0.5, beta=0.9, mode="standard", norm_coefficient=0.01)),
            Variant("momentum-nesterov", dict(lr=0.05, alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.0),
                    dict(lr=0.02, alpha=0.7, beta=1.0, mode="nesterov", norm_coefficient=0.01)),
        ),
        torch.optim.SGD, _momentum_to_torch, _momentum_ref,
        (("lr", 0, None, False), ("alpha", 0, 1, False), ("beta", 0, 1, False), ("norm_coefficient", 0, None, False)),
        ("momentum_buffer",), None,
    ),
    Entry(
        "sgd", (F64, F32),
        (
            Variant("sgd-momentum",
                    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.0, nesterov=False, maximize=False),
                    dict(lr=0.02, momentum=0.5, dampening=0.0, weight_decay=0.01, nesterov=False, maximize=False)),
            Variant("sgd-nesterov-maximize",
                    dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=True),
                    dict(lr=0.02, momentum=0.7, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=True)),
            # no momentum: no buffer, and dampening is ignored (torch.optim.SGD)
            Variant("sgd-plain",
                    dict(lr=0.05, momentum=0.0, dampening=0.3, weight_decay=0.01, nesterov=False, maximize=False),
                    dict(lr=0.02, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=True)),
        ),
        torch.optim.SGD, _sgd_to_torch, _sgd_ref,
        (("lr", 0, None, False), ("momentum", 0, None, False), ("dampening", None, None, False),
         ("weight_decay", 0, None, False)),
        ("momentum_buffer",), None,
        stateless=lambda h: h["momentum"] == 0,
    ),
    Entry(
        "lion", (F64, F32),
        (
            Variant("lion", dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False),
                    dict(lr=3e-4, beta1=0.8, beta2=0.95, weight_decay=0.1, maximize=False)),
            Variant("lion-decay-maximize", dict(lr=1e-3, beta1=0.95, beta2=0.98, weight_decay=0.3, maximize=True),
                    dict(lr=3e-4, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=True)),
        ),
        None, _no_twin, _lion_ref,
        (("lr", 0, None, False), ("beta1", *_UNIT_OPEN), ("beta2", *_UNIT_OPEN), ("weight_decay", 0, None, False)),
        ("exp_avg",), None,
    ),
)}


def entry(name: str) -> Entry:
    return ENTRIES[name]


def entry_of(cls) -> Entry:
    """The entry of an optimizer class."""
    return ENTRIES[registry.name_of(cls)]


# -- cases: one point of the matrix --------------------------------------------------------


@dataclass(frozen=True)
class Case:
    entry: Entry
    variant: Variant
    dtype: torch.dtype
    backend: str = "eager"
    device: str = "cpu"

    @property
    def id(self) -> str:
        return f"{self.variant.id}-{_DTYPE_NAMES[self.dtype]}-{self.backend}-{self.device}"

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def cls(self):
        return self.entry.cls

    @property
    def hyper(self) -> dict[str, Any]:
        return dict(self.variant.hyper)

    @property
    def second(self) -> dict[str, Any]:
        return dict(self.variant.second)

    @property
    def states(self) -> tuple[str, ...]:
        return self.entry.states_for(self.variant.hyper)

    @property
    def has_twin(self) -> bool:
        return all(self.entry.twin_kwargs(h) is not None for h in (self.variant.hyper, self.variant.second))

    def fused_kernels(self) -> list[str | None]:
        """Per param group, the name of the torch fused kernel our class maps its hyperparameters to
        (``fused_kernel(hyper, 0)``, the class defaults filled in), or None where no kernel computes the rule."""
        defaults = self.cls.spec.defaults()
        out = []
        for hyper in (self.variant.hyper, {**self.variant.hyper, **self.variant.second}):
            kernel = self.cls.fused_kernel({**defaults, **hyper}, 0)
            out.append(None if kernel is None else kernel[0])
        return out

    @property
    def fuses(self) -> bool:
        """The fused backend can run this case: on the CPU, in float32/float64, with a torch fused kernel for
        the hyperparameters of both param groups (which the installed torch may still lack: see ``_marks``)."""
        return (self.device == "cpu" and self.dtype in FUSED_DTYPES
                and all(k is not None for k in self.fused_kernels()))

    @property
    def bit_exact_twin(self) -> bool:
        """The twin is torch's ``fused=True`` optimizer, which a fused case equals bit for bit over
        parameters of whole kernel units (:data:`FUSED_UNIT_ELEMENTS`)."""
        return self.backend == "fused"

    # -- construction ------------------------------------------------------------------

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (any dtype, on the CPU) in this case's dtype, on its device."""
        return t.to(dtype=self.dtype, device=self.device)

    def randn(self, shape, generator: torch.Generator) -> torch.Tensor:
        """A float64 draw on the CPU (the same values whatever the case), cast and moved."""
        return self.tensor(torch.randn(shape, generator=generator, dtype=torch.float64))

    def params(self, shapes: Sequence, seed: int = 0) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(self.randn(s, gen)) for s in shapes]

    def build(self, params, **options):
        """Our optimizer over ``params`` (tensors or group dicts) with the variant's first-group hyperparameters."""
        options.setdefault("backend", self.backend)
        return registry.build(self.name, params, **{**self.variant.hyper, **options})

    def groups(self, first: list, second: list) -> list[dict]:
        """Two param groups: ``first`` with the constructor's hyperparameters, ``second`` with the variant's second set."""
        return [{"params": first}, {"params": second, **self.variant.second}]

    def twin(self, params, **torch_kwargs) -> torch.optim.Optimizer:
        """The exact torch.optim twin (``foreach=False``: the single-tensor reference implementation; for a
        ``fused`` case ``fused=True``: torch's fused kernels, the ones the fused backend calls).

        ``params`` may be group dicts with our hyperparameters (as :meth:`groups` makes them)."""
        if params and isinstance(params[0], dict):
            params = [{"params": g["params"], **self.entry.to_torch({**self.variant.hyper, **g})}
                      for g in params]
        implementation = dict(fused=True) if self.backend == "fused" else dict(foreach=False)
        kwargs = {**implementation, **self.entry.to_torch(self.variant.hyper), **torch_kwargs}
        return self.entry.torch_class(params, **kwargs)

    def reference_twin(self, params) -> "ReferenceTwin":
        """The float64 NumPy reference stepping ``params`` (one group, the variant's first hyperparameters): the
        twin of an optimizer torch.optim has none of (Lion), for tests that only step both."""
        return ReferenceTwin(self, params)

    def twin_or_reference(self, params):
        """:meth:`twin` where torch.optim has one, else :meth:`reference_twin`."""
        return self.twin(params) if self.has_twin else self.reference_twin(params)

    def torch_tolerance(self) -> dict:
        """Tolerance overrides for long runs against the torch twin (tests/tolerances.py)."""
        return dict(self.entry.torch_tolerance.get(self.dtype, {}))

    def reference_step(self, hyper: Mapping[str, Any], completed: int, x: torch.Tensor, g: torch.Tensor,
                       states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One float64 NumPy reference step of one parameter from (our) pre-step values,
        returned as float64 tensors on this case's device."""
        as64 = lambda t: t.detach().to(device="cpu", dtype=torch.float64).numpy()  # noqa: E731
        back = lambda a: torch.from_numpy(np.array(a, dtype=np.float64)).to(self.device)  # noqa: E731
        x, s = self.entry.reference(hyper, completed, as64(x), as64(g), [as64(t) for t in states])
        return back(x), [back(t) for t in s]

    def epsilon_kwargs(self, value: float) -> dict[str, float]:
        """``{epsilon name: value}`` (empty for a rule without epsilon)."""
        return {self.entry.epsilon: value} if self.entry.epsilon else {}


class ReferenceTwin:
    """The float64 NumPy reference (:meth:`Case.reference_step`) as an optimizer: ``step()`` steps every
    parameter with a gradient from its own states and count (states start at the entry's initial value), and
    writes the result back in the parameter's dtype; ``zero_grad()`` as torch's."""

    def __init__(self, case: Case, params):
        self.case, self.params = case, list(params)
        self.hyper = {**case.cls.spec.defaults(), **case.variant.hyper}
        self.counts = [0] * len(self.params)
        self.states: list[list[torch.Tensor] | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.states[i] is None:
                start = self.case.entry.initial(self.hyper)
                self.states[i] = [torch.full(p.shape, start, dtype=torch.float64, device=p.device)
                                  for _ in self.case.entry.states_for(self.hyper)]
            x, self.states[i] = self.case.reference_step(self.hyper, self.counts[i], p, p.grad, self.states[i])
            p.copy_(x.to(p.dtype))
            self.counts[i] += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


_NO_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="cuda axis of the test matrix: torch.cuda.is_available() is False on this machine "
           "(these cases run where a GPU is present)",
)


def _marks(backend: str, device: str, case: Case | None = None) -> list:
    marks = []
    if device == "cuda":
        marks.append(_NO_CUDA)
    if backend == "compiled":
        marks.append(pytest.mark.slow)
        ok, why = compile_available(device)
        marks.append(pytest.mark.skipif(not ok, reason=f"compiled axis: torch.compile is unavailable on {device}: {why}"))
    if backend == "fused" and case is not None:
        missing = sorted({k for k in case.fused_kernels() if not callable(getattr(torch, k, None))})
        marks.append(pytest.mark.skipif(bool(missing), reason=f"fused axis: torch {torch.__version__} has no "
                                                               f"{', '.join('torch.' + k for k in missing)}"))
    return marks


def cases(*, variants: str | Callable[[Variant], bool] = "default", dtypes="all", backends: Sequence[str] = ("eager",),
          devices: Sequence[str] = DEVICES, twin: bool = False, names: Sequence[str] | None = None,
          low_precision: bool = True) -> list:
    """pytest params (one :class:`Case` each) over variant x dtype x backend x device.

    ``variants``: ``"default"`` (each entry's first), ``"all"``, or a predicate.
    ``dtypes``: ``"all"`` (the entry's), ``"widest"`` (its first), or a tuple
    (intersected with the entry's).  ``twin``: only variants with an exact
    torch.optim twin.  ``low_precision=False`` leaves float16/bfloat16 out
    (a comparison with torch.optim there would measure torch's arithmetic).
    ``names``: only these registry names.  ``backends`` may hold ``"fused"``: its points are the ones
    the fused backend runs (:attr:`Case.fuses`: CPU, float32/float64, a kernel for both groups), the others
    are left out (see :func:`fused_cases`).
    """
    out = []
    for e in ENTRIES.values():
        if names is not None and e.name not in names:
            continue
        if variants == "default":
            chosen = [e.default]
        elif variants == "all":
            chosen = list(e.variants)
        else:
            chosen = [v for v in e.variants if variants(v)]
        if dtypes == "all":
            ds = list(e.dtypes)
        elif dtypes == "widest":
            ds = [e.dtypes[0]]
        else:
            ds = [d for d in e.dtypes if d in dtypes]
        if not low_precision:
            ds = [d for d in ds if d not in (torch.float16, torch.bfloat16)]
        for v in chosen:
            for d in ds:
                for b in backends:
                    for dev in devices:
                        c = Case(e, v, d, b, dev)
                        if twin and not c.has_twin:
                            continue
                        if b == "fused" and not c.fuses:
                            continue
                        out.append(pytest.param(c, id=c.id, marks=_marks(b, dev, c)))
    return out


def fused_cases(**kwargs) -> list:
    """pytest params of the fused backend (:func:`cases` with ``backends=("fused",)``): the CPU, float32 and
    float64, every variant whose hyperparameters (both param groups) torch's fused kernels take, unless
    ``kwargs`` narrows them further."""
    kwargs.setdefault("devices", ("cpu",))
    return cases(backends=("fused",), **kwargs)


def classes(devices: Sequence[str] = DEVICES) -> list:
    """One default case per optimizer in its widest dtype, per device (for tests about the class, not the math)."""
    return cases(dtypes="widest", devices=devices)


def case_of(name: str, *, dtype: torch.dtype | None = None, device: str = "cpu", backend: str = "eager",
         variant: str | None = None) -> Case:
    """One :class:`Case` (for a test about one optimizer): ``name``'s default variant in its widest dtype."""
    e = ENTRIES[name]
    v = e.default if variant is None else next(v for v in e.variants if v.id == variant)
    return Case(e, v, dtype or e.dtypes[0], backend, device)
