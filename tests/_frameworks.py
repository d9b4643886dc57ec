"""Shared by the framework integration tests (accelerate, Transformers' Trainer, Lightning, FSDP2, AMP).

Each of our optimizers is paired with the ``torch.optim`` optimizer that computes the same
update (docs/design.md, §2, "Equivalences used as test oracles"):

* ``Momentum(alpha)`` is ``SGD(momentum=alpha)``: compared bit for bit with the torch
  implementation our default backend equals where the optimizer steps (:func:`torch_twin`): on
  the CPU, for float32/float64 parameters, torch's fused kernel (``SGD(fused=True)``), which
  ``backend="auto"`` runs there (dml_optim/backends/fused.py); elsewhere (float16/bfloat16, CUDA) torch's
  default implementation, whose two ops our eager chain runs;
* ``Adam(epsilon=0)`` and ``DmlAdam(epsilon=0)`` are ``Adam(eps=0)``; the bias correction is
  computed in another order, so float32 results differ by a few ulps (``TORCH_ADAM_FLOAT32``);
* ``AdamW`` is ``AdamW`` (the same formula rewritten with one division fewer: 1 ulp).

The Adam-family twins stay torch's default implementation (compared to the tolerance): an
implementation of the formula independent of the fused kernel our CPU backend calls.

The frameworks are optional for a developer (the ``test`` extra installs them, CI has them):
``need(name)`` imports one or skips the module with the reason.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch
from tolerances import TOL, TORCH_ADAM_FLOAT32
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import dml_optim

EXTRA_HINT = "install the test extra: pip install -e '.[test]'"


def need(module: str):
    """Import ``module`` or skip the calling test module, naming what is missing and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # a reasoned skip: CI installs the extra, a developer may not have it
        pytest.skip(f"{module} is not installed ({exc}); {EXTRA_HINT}", allow_module_level=True)


#: The parameters' dtypes for which dml_optim's default backend runs torch's fused CPU kernels
#: (dml_optim/backends/fused.py; float16/bfloat16 run the eager chain).
FUSED_DTYPES = (torch.float32, torch.float64)


@functools.cache
def torch_twin(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` (a torch.optim class) built as the implementation dml_optim's default backend equals bit
    for bit where the optimizer steps: ``cls(..., fused=True)`` when every parameter is on the CPU in
    float32 or float64 (``backend="auto"`` runs torch's fused kernel there), else ``cls(...)``, torch's
    default (float16/bfloat16 parameters, CUDA: our eager or compiled step).  Parameters that are tensor
    subclasses (FSDP2's DTensor) get torch's default too: torch.optim cannot run a fused kernel on them
    (torch 2.13 registers no sharding strategy for ``aten._fused_sgd_``), while ours runs it on the local
    shards, so no torch implementation equals ours there bit for bit (tests/test_fsdp.py).

    Decided when the optimizer is built, from the parameters' device and dtype then, or from
    ``dtype=`` (the dtype they will step in, for a model cast after its optimizer is built).  One
    built on the CPU and then moved to CUDA stays fused (torch's CUDA kernel, not our CUDA step): a
    test that does that compares to the pair's tolerance.

    A fused torch optimizer declares ``_step_supports_amp_scaling``: GradScaler would hand it
    ``grad_scale``/``found_inf`` to unscale inside its kernel and call its step even on an overflow,
    and Lightning refuses to clip its gradients under mixed precision.  Ours leaves float32
    gradients to GradScaler's own ``unscale_`` and is stepped only when nothing overflowed; the
    twin is put on that same path (the flag is False, as for torch's other implementations), so
    its kernel steps the gradients GradScaler unscaled, as ours does."""

    class Twin(cls):
        def __init__(self, params, *args, dtype: torch.dtype | None = None, **kwargs):
            groups = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
                      if isinstance(g, dict) else g for g in params]
            tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
            fused = bool(tensors) and all(p.device.type == "cpu" and (dtype or p.dtype) in FUSED_DTYPES
                                          and not is_traceable_wrapper_subclass(p) for p in tensors)
            super().__init__(groups, *args, **kwargs, **({"fused": True} if fused else {}))
            if fused:
                self._step_supports_amp_scaling = False

    Twin.__name__, Twin.__qualname__ = cls.__name__, cls.__qualname__  # torch's names, for the frameworks' messages
    return Twin


@dataclass(frozen=True)
class Pair:
    """One of ours and its torch.optim twin, both built as ``make(params, lr)``."""

    id: str
    ours: Callable[..., torch.optim.Optimizer]
    theirs: Callable[..., torch.optim.Optimizer]
    exact: bool = False

    def tolerance(self, dtype=torch.float32) -> dict:
        """The pair's tolerance for ``dtype`` (where it is not compared bit for bit)."""
        return TORCH_ADAM_FLOAT32 if dtype == torch.float32 else TOL[dtype]

    def stepping_in(self, dtype) -> "Pair":
        """This pair with its twin chosen for parameters that will step in ``dtype`` (a model cast after
        its optimizers are built); for pairs whose twin is a :func:`torch_twin` class (it takes ``dtype=``)."""
        return replace(self, theirs=functools.partial(self.theirs, dtype=dtype))

    def assert_same(self, actual, expected, dtype=torch.float32, what="", tol=None):
        """``actual`` (ours) equals ``expected`` (torch's): bit for bit when the pair is exact and no
        ``tol`` is given, else to ``tol`` (default: the pair's tolerance for ``dtype``)."""
        actual, expected = list(actual), list(expected)
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            a, e = a.detach().cpu(), e.detach().cpu()
            assert a.dtype == e.dtype, f"{self.id} {what} tensor {i}: {a.dtype} vs {e.dtype}"
            if self.exact and tol is None:
                assert torch.equal(a, e), f"{self.id} {what} tensor {i}: max |diff| {(a - e).abs().max().item()}"
            else:
                torch.testing.assert_close(a, e, **(self.tolerance(dtype) if tol is None else tol),
                                           msg=lambda m, i=i: f"{self.id} {what} tensor {i}: {m}")


PAIRS = [
    Pair("momentum", lambda p, lr: dml_optim.Momentum(p, lr=lr, alpha=0.9),
         lambda p, lr, **where: torch_twin(torch.optim.SGD)(p, lr=lr, momentum=0.9, **where), exact=True),
    Pair("adam", lambda p, lr: dml_optim.Adam(p, lr=lr, epsilon=0.0),
         lambda p, lr: torch.optim.Adam(p, lr=lr, eps=0.0)),
    Pair("dml-adam", lambda p, lr: dml_optim.DmlAdam(p, lr=lr, epsilon=0.0),
         lambda p, lr: torch.optim.Adam(p, lr=lr, eps=0.0)),
    Pair("adamw", lambda p, lr: dml_optim.AdamW(p, lr=lr, weight_decay=0.1),
         lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.1)),
]
PAIR_IDS = [p.id for p in PAIRS]
BY_ID = {p.id: p for p in PAIRS}


def reset_accelerate():
    """accelerate keeps process-wide singletons; every Accelerator (and every Trainer) starts afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    """Use as ``pytestmark = pytest.mark.usefixtures("fresh_accelerate")`` (imported): accelerate's
    singletons reset before and after each test of the module."""
    reset_accelerate()
    yield
    reset_accelerate()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def moved(before, after) -> bool:
    return any(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, after))


def amp_future_warnings(caught) -> list[str]:
    """The FutureWarnings among ``caught`` that come from torch's AMP or from us (GradScaler's
    deprecated ``step(grad_scaler=...)`` protocol warns from torch/amp/grad_scaler.py); the
    frameworks' own deprecation notices about their internals are not ours to judge."""
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, FutureWarning)
            and ("scaler" in str(w.message).lower() or "dml_optim" in w.filename
                 or "amp" in w.filename.replace("\\", "/").split("/"))]


def torch_add_param_group(topt: torch.optim.Optimizer, group: dict) -> None:
    """``topt.add_param_group(group)``, with torch <= 2.4's Adagrad gap filled: it initialises its state
    only in ``__init__``, so its own ``step()`` raises ``KeyError('sum')`` for a parameter added later;
    the state is made as ``__init__`` (and torch >= 2.5's ``add_param_group``) makes it."""
    topt.add_param_group(group)
    if isinstance(topt, torch.optim.Adagrad):
        added = topt.param_groups[-1]
        for q in added["params"]:
            if q not in topt.state:
                topt.state[q] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(q, added["initial_accumulator_value"], memory_format=torch.preserve_format),
                }
