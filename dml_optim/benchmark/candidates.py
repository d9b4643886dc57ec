"""The optimizers a benchmark row compares, built through the registry, and what they hold.

For an optimizer name of :mod:`dml_optim.optimizers.registry` (``adam``,
``adamw``, ``adagrad``, ``momentum``), five candidates, each on its own copy
of the same parameters:

* ``dml_optim eager`` and ``dml_optim compiled``:
  ``registry.build(name, params, backend=...)``;
* ``torch for-loop`` (``foreach=False``), ``torch foreach`` (``foreach=True``)
  and ``torch fused`` (``fused=True``): ``registry.torch_equivalent(name,
  params, exact=False, ...)``, the nearest torch.optim twin (Adam's epsilon
  is placed differently, which does not matter for speed);
* ``dml_optim auto`` (:data:`AUTO`): ``backend="auto"``, the default, for
  the rows where what it runs is measured rather than predicted from the
  buffer's size (frozen, None-pattern, construction).

Hyperparameters are the registry's defaults (learning rate:
``registry.lr_for``), on both sides.  dml_optim candidates get their own
copy of the gradients (packed into their flat gradient buffer); torch.optim
candidates share one read-only copy.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Iterator

import torch

from dml_optim.benchmark.timing import wall_seconds
from dml_optim.quant import tensors_of

__all__ = ["OPTIMIZERS", "CANDIDATES", "TORCH_CANDIDATES", "AUTO", "BYTES_PER_ELEMENT", "Candidate", "build_optimizer", "settle", "settle_steps",
           "start", "unavailable", "no_compile_fallback"]

#: The optimizers the benchmark measures (registry names).
OPTIMIZERS = ("adam", "adamw", "adagrad", "momentum")
CANDIDATES = ("dml_optim eager", "dml_optim compiled", "torch for-loop", "torch foreach", "torch fused")
TORCH_CANDIDATES = CANDIDATES[2:]
#: The candidate name of dml_optim with its default backend (``backend="auto"``), where a row measures it so.
AUTO = "dml_optim auto"
_TORCH_FLAGS = {"torch for-loop": dict(foreach=False), "torch foreach": dict(foreach=True),
                "torch fused": dict(foreach=None, fused=True)}

#: Minimum traffic of one step, in elements read + written per parameter: Adam and AdamW read x, g, m, v
#: and write x, m, v (float32: 28 bytes); Adagrad and Momentum read x, g and one state and write x and the state.
BYTES_PER_ELEMENT = {"adam": 7, "adamw": 7, "adagrad": 5, "momentum": 5}


class Candidate:
    """One optimizer over its own parameters; ``step`` is what is timed (``opt.step`` unless replaced)."""

    def __init__(self, name: str, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]):
        self.name = name
        self.opt = opt
        self.params = params
        self.step: Callable[[], object] = opt.step
        self.first_step_s: float | None = None

    @property
    def ours(self) -> bool:
        return self.name.startswith("dml_optim")

    def attach(self, grads: list[torch.Tensor | None]) -> None:
        """Give the parameters gradients (None: leave as is); dml_optim gets its own copies."""
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g.clone() if self.ours else g

    def optimizer_bytes(self) -> int:
        """Memory the optimizer holds beyond parameters and gradients: states, scratch, master copy
        and compensation for dml_optim (whose flat buffers replace the parameters' and gradients'
        storage); the state tensors for torch.optim."""
        if self.ours:
            total = 0
            for info in self.opt.flat_buffers():
                tensors = [t for s in info.states.values() for t in tensors_of(s)] + list(info.scratch)
                tensors += [t for t in (info.master, info.kahan) if t is not None]
                total += sum(t.numel() * t.element_size() for t in tensors)
            return total
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))


def unavailable(name: str, device: torch.device) -> str | None:
    """Why candidate ``name`` cannot run on ``device`` (None: it can)."""
    if name == "dml_optim compiled":
        from dml_optim.compiled import compile_available

        ok, why = compile_available(device.type)
        return None if ok else why
    return None


def build_optimizer(name: str, optimizer: str, params: list[torch.nn.Parameter], **options) -> torch.optim.Optimizer:
    """Candidate ``name``'s optimizer of ``optimizer`` over ``params``, no step taken.

    ``name`` is one of :data:`CANDIDATES` or ``"dml_optim auto"`` (the
    default backend, what a user gets).  ``options``: dml_optim options
    (``capturable``, ``checks``, ...); for torch.optim only ``capturable``,
    set on its param groups (a torch.optim group option).
    """
    from dml_optim.optimizers.registry import build, torch_equivalent

    if name not in CANDIDATES and name != AUTO:
        raise ValueError(f"candidate must be one of {', '.join((*CANDIDATES, AUTO))}, got {name!r}")
    if name.startswith("dml_optim"):
        return build(optimizer, params, backend=name.split()[-1], **options)
    extra = set(options) - {"capturable"}
    if extra:
        raise ValueError(f"options {sorted(extra)} apply to dml_optim only, got them for {name!r}")
    opt = torch_equivalent(optimizer, params, exact=False, **_TORCH_FLAGS[name])
    for group in opt.param_groups:
        group.update(options)
    return opt


def start(name: str, optimizer: str, params: list[torch.nn.Parameter], grads: list[torch.Tensor | None],
          device: torch.device, **options) -> Candidate:
    """Build candidate ``name`` of ``optimizer`` over ``params`` (:func:`build_optimizer`), give it ``grads``
    and take its first step (timed).  A compile fallback raises instead of passing for ``compiled``."""
    with no_compile_fallback():
        cand = Candidate(name, build_optimizer(name, optimizer, params, **options), params)
        cand.attach(grads)
        cand.first_step_s = wall_seconds(cand.step, device, probe=params[-1])
    return cand


def settle(cand: Candidate) -> None:
    """Step a ``dml_optim auto`` candidate until ``auto`` has decided for good (:func:`settle_steps`)."""
    if cand.name == AUTO:
        settle_steps(cand.opt, cand.step)


def settle_steps(opt: torch.optim.Optimizer, step: Callable[[], object]) -> None:
    """Call ``step`` until no buffer of ``opt`` will still switch backends under ``auto`` (one that compiles
    after running eagerly for a while, :data:`dml_optim.backends.AUTO_COMPILE_AFTER_EAGER_S`, has done
    so): a row measures the steady state of a training run, not its first seconds."""
    from dml_optim.backends import AUTO_COMPILE_AFTER_EAGER_S, tiering_pending

    deadline = time.perf_counter() + 3 * max(AUTO_COMPILE_AFTER_EAGER_S.values()) + 30
    with no_compile_fallback():
        while tiering_pending(opt) and time.perf_counter() < deadline:
            step()


@contextlib.contextmanager
def no_compile_fallback() -> Iterator[None]:
    """Inside: a compile fallback (:class:`dml_optim.compiled.CompileFallbackWarning`) raises, so a candidate
    that was to run compiled is n/a with the reason instead of silently measuring the eager backend."""
    from dml_optim.compiled import CompileFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        yield
