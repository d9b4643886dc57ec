"""The optimizers a benchmark row compares, built through the registry, and what they hold.

For an optimizer name of :mod:`dml_optim.optimizers.registry` (``adam``,
``adamw``, ``adagrad``, ``momentum``), six candidates, each on its own copy
of the same parameters:

* ``dml_optim eager``, ``dml_optim compiled`` and ``dml_optim fused``:
  ``registry.build(name, params, backend=...)``; ``fused`` is torch's own
  fused CPU kernel called on the flat buffers (:mod:`dml_optim.backends.fused`), what
  ``backend="auto"`` runs on the CPU for float32 and float64 buffers with
  plain states (n/a, with the reason, elsewhere: a fallback would time
  another backend);
* ``torch for-loop`` (``foreach=False``), ``torch foreach`` (``foreach=True``)
  and ``torch fused`` (``fused=True``): ``registry.torch_equivalent(name,
  params, exact=False, ...)``, the nearest torch.optim twin (Adam's epsilon
  is placed differently, which does not matter for speed);
* ``dml_optim auto`` (:data:`AUTO`): ``backend="auto"``, the default, for
  the rows where what it runs is measured rather than predicted from the
  buffer's size (frozen, None-pattern, construction).

What ``backend="auto"`` runs for a workload: :func:`auto_backend` (the
prediction, ``fused``, ``eager`` or ``compiled``, for a speed row's
``auto_backend``) and :func:`ran` (what an optimizer's buffers ran, from
:func:`dml_optim.backends.choose.resolved_backends`).

Hyperparameters are the registry's defaults (learning rate:
``registry.lr_for``), on both sides.  dml_optim candidates get their own
copy of the gradients (packed into their flat gradient buffer); torch.optim
candidates share one read-only copy.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable, Iterator

import torch

from dml_optim.benchmark.timing import wall_seconds
from dml_optim.core.quant import tensors_of

__all__ = ["OPTIMIZERS", "CANDIDATES", "TORCH_CANDIDATES", "AUTO", "BYTES_PER_ELEMENT", "Candidate", "build_optimizer", "settle", "settle_steps",
           "start", "unavailable", "auto_backend", "ran", "no_compile_fallback"]

#: The optimizers the benchmark measures (registry names).
OPTIMIZERS = ("adam", "adamw", "adagrad", "momentum")
CANDIDATES = ("dml_optim eager", "dml_optim compiled", "dml_optim fused", "torch for-loop", "torch foreach",
              "torch fused")
TORCH_CANDIDATES = tuple(c for c in CANDIDATES if c.startswith("torch "))
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

    def settle_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """Put a dml_optim candidate where a training loop's steps find it after a first step:
        ``zero_grad()`` (dml_optim's default keeps each ``p.grad`` a view of the flat gradient buffer) and
        ``grads`` written into those views, as backward writes them, so the timed steps read the
        gradients there, as torch.optim's read the tensors ``p.grad`` holds.  (Left as the caller's
        tensors, large ones would be read in place at every step: the path of a loop that calls
        ``zero_grad(set_to_none=True)``, which the None-pattern row measures.)  torch.optim: nothing."""
        if not self.ours:
            return
        self.opt.zero_grad()
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if g is not None and p.grad is not None:
                    p.grad.copy_(g)

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
    """Why candidate ``name`` cannot run on ``device`` (None: it can).  What else rules out ``dml_optim
    fused`` (the dtype, ...) makes its first step fail with the library's reason (:func:`no_compile_fallback`)."""
    if name == "dml_optim compiled":
        from dml_optim.backends.compiled import compile_available

        ok, why = compile_available(device.type)
        return None if ok else why
    if name == "dml_optim fused" and device.type != "cpu":
        return f"torch's fused kernels run on the CPU here, the device is {device.type}"
    return None


def auto_backend(optimizer: str, device: torch.device, dtype: torch.dtype, numel: int, **options) -> str:
    """What ``backend="auto"`` runs for a buffer of ``numel`` elements of ``optimizer`` (the registry's
    hyperparameters, ``options``) in ``dtype`` on ``device``, in a long run: ``"fused"`` where torch's fused
    kernel can run it (:func:`dml_optim.backends.choose.resolved_backends` of such an optimizer over one element:
    whether it does depends on the device, dtype and settings, not the size), else ``"eager"`` or
    ``"compiled"`` by size (:func:`dml_optim.backends.choose.resolve`; a buffer that compiles after running
    eagerly for a while counts as compiled)."""
    from dml_optim.backends.choose import resolve
    from dml_optim.optimizers.registry import build

    probe = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
    backends = {b for group in build(optimizer, [probe], **options).resolved_backends() for b in group}
    if backends == {"fused"}:
        return "fused"
    return resolve("auto", device, numel, eager_s=math.inf)


def ran(opt: torch.optim.Optimizer) -> str | None:
    """What ``opt``'s flat buffers run with now (``opt.resolved_backends()``): ``"fused"``,
    ``"eager"``, ``"compiled"``, or several joined by ``+`` (``"eager+compiled"``); None without buffers."""
    return "+".join(dict.fromkeys(b for group in opt.resolved_backends() for b in group)) or None


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
    and take its first step (timed), then settle its gradients (:meth:`Candidate.settle_gradients`).  A compile
    fallback raises instead of passing for ``compiled``."""
    with no_compile_fallback():
        cand = Candidate(name, build_optimizer(name, optimizer, params, **options), params)
        cand.attach(grads)
        cand.first_step_s = wall_seconds(cand.step, device, probe=params[-1])
        cand.settle_gradients(grads)
    return cand


def settle(cand: Candidate) -> None:
    """Step a ``dml_optim auto`` candidate until ``auto`` has decided for good (:func:`settle_steps`)."""
    if cand.name == AUTO:
        settle_steps(cand.opt, cand.step)


def settle_steps(opt: torch.optim.Optimizer, step: Callable[[], object]) -> None:
    """Call ``step`` until no buffer of ``opt`` will still switch backends under ``auto`` (one that compiles
    after running eagerly for a while, :data:`dml_optim.backends.choose.AUTO_COMPILE_AFTER_EAGER_S`, has done
    so): a row measures the steady state of a training run, not its first seconds."""
    from dml_optim.backends.choose import AUTO_COMPILE_AFTER_EAGER_S

    deadline = time.perf_counter() + 3 * max(AUTO_COMPILE_AFTER_EAGER_S.values()) + 30
    with no_compile_fallback():
        while opt.tiering_pending() and time.perf_counter() < deadline:
            step()


@contextlib.contextmanager
def no_compile_fallback() -> Iterator[None]:
    """Inside: a backend fallback raises, so a candidate that was to run compiled or fused is n/a with the
    reason instead of silently measuring another backend: a compile fallback
    (:class:`dml_optim.backends.compiled.CompileFallbackWarning`), and ``backend="fused"`` refusing a buffer
    (:class:`dml_optim.backends.fused.FusedFallbackWarning`: a dtype or setting torch's kernels do not take)."""
    from dml_optim.backends.compiled import CompileFallbackWarning
    from dml_optim.backends.fused import FusedFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        warnings.simplefilter("error", FusedFallbackWarning)
        yield
