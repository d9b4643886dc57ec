"""The gradient streams of the precision harness, and the workloads they run on.

A :class:`Stream` is a sequence of float32 gradient vectors over a set of
parameters; a configuration's gradient buffer rounds them to its storage
dtype, exactly as autograd would:

* ``recorded``: the gradients of an FP32 training run of the built-in MLP
  (:mod:`dml_optim.job.toy`) with the same optimizer, recorded per step and
  replayed into every configuration (``mlp`` workload only);
* ``synthetic``: per element a fixed center ``c ~ U(-7.75, 1.75)`` and a
  fixed sign; at step ``t``, ``log10|g| = c + 0.25 * xi`` with ``xi ~ U(-1, 1)``,
  so magnitudes span 1e-8 ... 1e2 (log-uniform), and the sign flips with
  probability 0.2 per step;
* ``gaussian``: ``g ~ N(0, 1e-3**2)``, i.i.d. per step (typical late-training
  magnitudes; the second stream of an inventory workload, which has no model
  to record from).

Initial parameters are rounded to bfloat16, so they are exactly representable
in every configuration: the error at step 0 is 0 and every difference comes
from the updates.  :func:`workload_params` gives the initial parameters of a
workload (the built-in MLP or a model inventory), :func:`default_steps` how
many steps a workload of that size runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dml_optim.precision.configs import CONFIGS
from dml_optim.precision.optimizers import make_optimizer

__all__ = ["STREAMS", "Stream", "recorded_stream", "synthetic_stream", "gaussian_stream", "workload_params",
           "default_steps"]

#: Gradient streams: ``recorded`` (mlp workload only), ``synthetic``, ``gaussian``.
STREAMS = ("recorded", "synthetic", "gaussian")


@dataclass
class Stream:
    """One gradient stream over a set of parameters (everything flat, float32).

    Attributes:
        name: ``recorded``, ``synthetic``, ``gaussian`` or a caller's name.
        init: initial parameters, flat (values representable in every config).
        shapes: the parameter shapes ``init`` splits into, in order.
        steps: number of gradients.
        grad: ``grad(t)`` for ``t`` in ``1..steps``: a flat float32 gradient.
        loss: ``loss(flat float32 params) -> float`` on the training data, or None.
        description: one line for the report.
    """

    name: str
    init: torch.Tensor
    shapes: list[tuple[int, ...]]
    steps: int
    grad: Callable[[int], torch.Tensor]
    loss: Callable[[torch.Tensor], float] | None = None
    description: str = ""

    def params(self, dtype: torch.dtype) -> list[torch.nn.Parameter]:
        """Fresh parameters with the initial values, in ``dtype``."""
        out, a = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(torch.nn.Parameter(self.init[a : a + n].reshape(shape).to(dtype).clone()))
            a += n
        return out


def _round_init(values: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (then exactly representable in float16/bfloat16/float32 too,
    for magnitudes in float16's normal range), as float32."""
    return values.to(torch.bfloat16).float()


def recorded_stream(optimizer: str, steps: int, seed: int, hyperparameters: dict[str, Any] | None = None,
                    batch_size: int = 256) -> Stream:
    """Gradients of an FP32 training run of the built-in MLP (mini-batches of ``batch_size``).

    The run uses ``optimizer`` in the ``fp32`` configuration; gradient ``t`` is
    the one it stepped with at step ``t``.  ``loss`` is the model's
    cross-entropy on the whole training set.
    """
    from dml_optim.job import toy

    x, y, _, _ = toy.make_dataset(seed)
    model = toy.make_model(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_round_init(p))
    shapes = [tuple(p.shape) for p in model.parameters()]
    init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    opt = make_optimizer(optimizer, list(model.parameters()), CONFIGS["fp32"], hyperparameters)
    gen = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(x.shape[0], generator=gen)
    grads, at = [], 0
    for _ in range(steps):
        if at + batch_size > len(order):
            order, at = torch.randperm(x.shape[0], generator=gen), 0
        idx = order[at : at + batch_size]
        at += batch_size
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
    eval_model = toy.make_model(seed)

    @torch.no_grad()
    def loss(flat: torch.Tensor) -> float:
        a = 0
        for p in eval_model.parameters():
            p.copy_(flat[a : a + p.numel()].view_as(p))
            a += p.numel()
        return float(torch.nn.functional.cross_entropy(eval_model(x), y))

    return Stream("recorded", init, shapes, steps, lambda t: grads[t - 1], loss,
                  f"gradients of an FP32 {optimizer} training run of the built-in MLP (batch {batch_size})")


def _step_generator(seed: int, stream: int, t: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + stream * 7919 + t) % (2**63))


def synthetic_stream(init: torch.Tensor, shapes, steps: int, seed: int, low: float = 1e-8, high: float = 1e2) -> Stream:
    """Magnitudes log-uniform over ``[low, high]`` per element (see the module docstring)."""
    if not 0 < low < high:
        raise ValueError(f"synthetic_stream: need 0 < low < high, got low={low!r}, high={high!r}")
    lo, hi = math.log10(low), math.log10(high)
    jitter = min(0.25, (hi - lo) / 4)
    gen = _step_generator(seed, 1, 0)
    n = init.numel()
    center = torch.empty(n).uniform_(lo + jitter, hi - jitter, generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int8).mul_(2).sub_(1)

    def grad(t: int) -> torch.Tensor:
        g = _step_generator(seed, 1, t)
        mag = torch.empty(n).uniform_(-jitter, jitter, generator=g).add_(center)
        mag = torch.pow(10.0, mag)
        flip = torch.rand(n, generator=g) < 0.2
        return mag.mul_(torch.where(flip, -sign, sign))

    return Stream("synthetic", init, list(shapes), steps, grad, None,
                  f"log-uniform magnitudes {low:g} ... {high:g} per element, fixed sign flipped with probability 0.2")


def gaussian_stream(init: torch.Tensor, shapes, steps: int, seed: int, std: float = 1e-3) -> Stream:
    """``g ~ N(0, std**2)``, i.i.d. per element and step."""
    n = init.numel()
    return Stream("gaussian", init, list(shapes), steps,
                  lambda t: torch.randn(n, generator=_step_generator(seed, 2, t)).mul_(std), None,
                  f"i.i.d. N(0, {std:g}^2) gradients")


def workload_params(workload: str, seed: int) -> tuple[torch.Tensor, list[tuple[int, ...]], str]:
    """``(init, shapes, name)`` for ``"mlp"`` or a model name or inventory path (:func:`dml_optim.inventory.resolve_model`)."""
    if workload == "mlp":
        from dml_optim.job import toy

        model = toy.make_model(seed)
        shapes = [tuple(p.shape) for p in model.parameters()]
        init = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return _round_init(init), shapes, "mlp"
    from dml_optim.inventory import make_params, resolve_model

    try:
        inv = resolve_model(workload)
    except ValueError as exc:
        raise ValueError(f"workload: not 'mlp' and {exc}") from None
    params = make_params(inv, generator=torch.Generator().manual_seed(int(seed)), scale=0.05)
    init = torch.cat([p.detach().reshape(-1) for p in params])
    return _round_init(init), [shape for _, shape in inv.parameters], inv.name


def default_steps(numel: int) -> int:
    """Steps per stream for a workload of ``numel`` parameters: 200 up to 1M
    (the built-in MLP has 22k), 20 up to 10M, else 3.

    A run holds every configuration and the float64 reference in memory at
    once, about 260 bytes per parameter (measured on resnet50; gpt2: about
    32 GB), and takes seconds per step per 10M parameters on a 2-core CPU.
    """
    return 200 if numel <= 1_000_000 else 20 if numel <= 10_000_000 else 3

