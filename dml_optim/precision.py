"""FP16/FP32 precision configurations and the comparison harness behind ``dml-optim compare``.

A *configuration* is a choice of parameter (storage) dtype, state dtype,
compute dtype and master weights (:data:`CONFIGS`).  :func:`compare` feeds one
identical gradient stream through every configuration of one optimizer and
through a float64 reference (the same update rule with float64 parameters),
in lockstep, and measures how each configuration drifts from the reference.

Streams (each a sequence of float32 gradient vectors; a configuration's
gradient buffer rounds them to its storage dtype, exactly as autograd would):

* ``recorded``: the gradients of an FP32 training run of the built-in MLP
  (:mod:`dml_optim.toy`) with the same optimizer, recorded per step and
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
from the updates.

Metrics (per configuration and stream; ``x`` the configuration's parameters,
``r`` the reference's, at the final step unless stated):

* ``rel_error`` (the plotted curve, every step): ``||x - r||_2 / ||r||_2``
  over all parameters, in float64; NaN once any parameter is NaN.
* ``max_rel_error``, ``median_rel_error``: of the element-wise
  ``|x_i - r_i| / max(|r_i|, 2**-24)`` (the floor, FP16's smallest subnormal,
  keeps a reference value that is almost 0 from dominating; the same floor
  for every configuration); a NaN element counts as ``inf``.
* ``max_ulp``: the largest distance, in units in the last place of the
  storage dtype, between ``x_i`` and ``r_i`` rounded to that dtype (bit
  patterns read as sign-magnitude integers, so ``+0`` and ``-0`` are 0 apart
  and adjacent values 1); NaN elements are left out.
* ``nan_count``, ``inf_count``: non-finite parameters; ``first_nonfinite_step``:
  the first step (1-based) after which any parameter was NaN or inf.
* ``lost_update_fraction``: over all steps and elements where the reference
  moved (``r_t != r_{t-1}``), the fraction where the parameter did not
  (``x_t == x_{t-1}``): updates smaller than half an ULP, rounded away.
* ``flushed_second_moment_fraction``: among the second-moment entries
  (Adam's ``exp_avg_sq``, Adagrad's ``sum``; none for Momentum) that are
  nonzero in the reference, the fraction that are 0 in the configuration.
* ``grad_underflow_fraction``: gradient entries that are nonzero in the
  stream but 0 once stored in the configuration's dtype (all steps).
* ``final_loss``: the built-in model's cross-entropy on its training data with
  the configuration's parameters (evaluated in float32; recorded stream only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dml_optim.optimizers import Adagrad, Adam, DmlAdam, FlatOptimizer, Momentum

__all__ = [
    "Config", "CONFIGS", "OPTIMIZERS", "STREAMS", "METRICS", "Stream", "Result", "Report",
    "compare", "run_stream", "make_optimizer", "reference_optimizer", "default_steps",
    "recorded_stream", "synthetic_stream", "gaussian_stream", "workload_params",
    "relative_error", "ulp_distance", "lost_updates", "flushed_entries",
    "smallest_subnormal", "REL_ERROR_FLOOR",
]

#: Floor of the denominator of the element-wise relative error (FP16's smallest subnormal).
REL_ERROR_FLOOR = 2.0**-24
_CHUNK = 1 << 22  # elements per chunk when measuring (bounds temporary memory)


@dataclass(frozen=True)
class Config:
    """A precision configuration: how parameters, states and arithmetic are stored."""

    name: str
    param_dtype: torch.dtype
    state_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    master_weights: bool = False
    description: str = ""

    def options(self) -> dict[str, Any]:
        """The optimizer keyword arguments of this configuration."""
        return dict(state_dtype=self.state_dtype, compute_dtype=self.compute_dtype, master_weights=self.master_weights)


#: The configurations ``dml-optim compare`` runs, in order.
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("fp32", torch.float32, description="FP32 parameters, states and arithmetic"),
        Config("fp16", torch.float16, description="FP16 parameters, states and arithmetic (DirectML's native FP16 path)"),
        Config("fp16-fp32compute", torch.float16, compute_dtype=torch.float32,
               description="FP16 parameters and states, FP32 arithmetic in bounded chunks"),
        Config("fp16-master", torch.float16, master_weights=True,
               description="FP16 parameters, FP32 master weights, FP32 states and arithmetic"),
        Config("bf16", torch.bfloat16, description="bfloat16 parameters, states and arithmetic (CPU/CUDA only)"),
    )
}

#: Optimizer names of ``dml-optim compare``: class and hyperparameters that differ from its defaults.
OPTIMIZERS: dict[str, tuple[type[FlatOptimizer], dict[str, Any]]] = {
    "adam": (Adam, {}),
    "dml-adam": (DmlAdam, {}),
    "adagrad": (Adagrad, {}),
    "momentum": (Momentum, {"lr": 0.01}),
}

#: Gradient streams: ``recorded`` (mlp workload only), ``synthetic``, ``gaussian``.
STREAMS = ("recorded", "synthetic", "gaussian")

#: Every metric a result carries (None where it does not apply).
METRICS = (
    "max_rel_error", "median_rel_error", "final_rel_error", "max_ulp", "nan_count", "inf_count",
    "first_nonfinite_step", "lost_update_fraction", "flushed_second_moment_fraction",
    "grad_underflow_fraction", "final_loss",
)

# the state holding the second moment, and the coefficient c of "c * g * g" added to it
_SECOND_MOMENT = {"adam": ("exp_avg_sq", "beta"), "dml-adam": ("exp_avg_sq", "beta2"), "adagrad": ("sum", None), "momentum": (None, None)}


def _check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def make_optimizer(name: str, params, config: Config, hyperparameters: dict[str, Any] | None = None) -> FlatOptimizer:
    """``OPTIMIZERS[name]`` over ``params`` with ``config``'s precision options.

    Always the ``eager`` backend: the op chain DirectML runs, each op's
    result rounded to the compute dtype (a fused, compiled kernel would keep
    FP16 intermediates in FP32 registers and hide what FP16 arithmetic costs).

    Raises the optimizer's own error for an unsupported combination (e.g.
    ``TypeError`` for ``DmlAdam`` with bfloat16).
    """
    _check_optimizer(name)
    cls, defaults = OPTIMIZERS[name]
    return cls(params, **{**defaults, **(hyperparameters or {})}, **config.options(), backend="eager")


def reference_optimizer(name: str, params, hyperparameters: dict[str, Any] | None = None) -> FlatOptimizer:
    """The float64 reference: the same rule with float64 parameters and states.

    ``DmlAdam`` refuses float64 (DirectML has none), so its reference is
    :class:`~dml_optim.Adam` with ``alpha=beta1, beta=beta2``: the same rule
    for ``T >= 1`` (DESIGN §2), both from :func:`dml_optim.functional.adam_`.
    """
    _check_optimizer(name)
    if name != "dml-adam":
        return make_optimizer(name, params, Config("reference", torch.float64), hyperparameters)
    hyper = _hyperparameters(name, hyperparameters)
    return Adam(params, lr=hyper["lr"], alpha=hyper["beta1"], beta=hyper["beta2"], epsilon=hyper["epsilon"], backend="eager")


def _hyperparameters(name: str, hyperparameters: dict[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters a run actually uses (class defaults, ours, the caller's)."""
    probe = make_optimizer(name, [torch.nn.Parameter(torch.zeros(1))], CONFIGS["fp32"], hyperparameters)
    return {k: probe.defaults[k] for k in type(probe).spec.names}


# ---------------------------------------------------------------------------------
# metrics: pure functions with known answers (see tests/test_precision.py)
# ---------------------------------------------------------------------------------


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive subnormal of ``dtype`` (2**-24 for float16)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def relative_error(x: torch.Tensor, ref: torch.Tensor, floor: float = REL_ERROR_FLOOR) -> torch.Tensor:
    """Element-wise ``|x - ref| / max(|ref|, floor)`` in float64; NaN becomes ``inf``."""
    r = ref.double()
    err = (x.double() - r).abs_().div_(r.abs().clamp_min_(floor))
    return err.nan_to_num_(nan=math.inf, posinf=math.inf)


_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Sign-magnitude bit patterns as integers ordered like the floats (+0 = -0 = 0)."""
    b = bits.long()
    mag = b & ((1 << (width - 1)) - 1)
    return torch.where(b < 0, -mag, mag)


def ulp_distance(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """ULPs of ``x.dtype`` between ``x`` and ``ref`` rounded to ``x.dtype`` (int64).

    The bit patterns are read as sign-magnitude integers, so adjacent floats
    are 1 apart, ``+0`` and ``-0`` are 0 apart and a distance across zero
    adds both sides.  Entries where either value is NaN are ``-1``.
    (float16, bfloat16, float32; float64 works for distances below 2**63.)
    """
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"ulp_distance: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    width = torch.finfo(x.dtype).bits
    r = ref.to(x.dtype)
    dist = (_ordered(x.view(_INT_VIEW[x.dtype]), width) - _ordered(r.view(_INT_VIEW[x.dtype]), width)).abs_()
    return dist.masked_fill_(x.isnan() | r.isnan(), -1)


def lost_updates(x_prev: torch.Tensor, x: torch.Tensor, ref_prev: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """``(lost, moved)``: elements where the reference moved, and where, among
    those, ``x`` did not change (its update was rounded away)."""
    moved = ref != ref_prev
    lost = moved & (x == x_prev)
    return int(lost.sum()), int(moved.sum())


def flushed_entries(state: torch.Tensor, ref_state: torch.Tensor) -> tuple[int, int]:
    """``(flushed, nonzero)``: entries nonzero in the reference, and among them those that are 0 in ``state``."""
    nonzero = ref_state != 0
    return int((nonzero & (state == 0)).sum()), int(nonzero.sum())


def _slices(n: int):
    for a in range(0, n, _CHUNK):
        yield slice(a, min(a + _CHUNK, n))


# ---------------------------------------------------------------------------------
# gradient streams
# ---------------------------------------------------------------------------------


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
    from dml_optim import toy

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
        from dml_optim import toy

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
    once, about 150 bytes per parameter (gpt2: about 19 GB), and takes
    seconds per step per 10M parameters on a 2-core CPU.
    """
    return 200 if numel <= 1_000_000 else 20 if numel <= 10_000_000 else 3


# ---------------------------------------------------------------------------------
# running configurations in lockstep
# ---------------------------------------------------------------------------------


@dataclass
class Result:
    """One configuration on one stream: its metrics and its per-step error curve."""

    config: str
    stream: str
    metrics: dict[str, Any]
    curve: list[float]


class _Run:
    def __init__(self, config: Config, opt: FlatOptimizer):
        opt.attach_grads()  # every p.grad becomes a view of the flat gradient buffer
        if len(opt.flat_buffers()) != 1:
            raise RuntimeError("precision: expected one flat buffer per optimizer")
        self.config, self.opt = config, opt
        self.prev = self.flat.data.clone()
        self.curve: list[float] = []
        self.lost = self.moved = self.underflow = 0
        self.first_nonfinite: int | None = None


    @property
    def flat(self):
        """The optimizer's one flat buffer, as it is now (states appear at the first step)."""
        return self.opt.flat_buffers()[0]


def _sq_norm(x: torch.Tensor, r: torch.Tensor | None = None) -> float:
    total = 0.0
    for s in _slices(x.numel()):
        d = x[s].double() if r is None else x[s].double() - r[s]
        total += float(torch.dot(d, d))
    return total


def run_stream(optimizer: str, stream: Stream, configs: Sequence[Config], *,
               hyperparameters: dict[str, Any] | None = None, progress: Callable[[int], None] | None = None,
               ) -> tuple[list[Result], list[dict[str, str]], float | None]:
    """Feed ``stream`` through each configuration and the float64 reference.

    Returns ``(results, skipped, reference_loss)``; a configuration the optimizer refuses
    (its constructor raises TypeError/ValueError) is skipped with the reason.
    ``progress``: called as ``progress(t)`` after step ``t``, or None.
    """
    ref = _Run(Config("reference", torch.float64), reference_optimizer(optimizer, stream.params(torch.float64), hyperparameters))
    runs, skipped = [], []
    for config in configs:
        try:
            opt = make_optimizer(optimizer, stream.params(config.param_dtype), config, hyperparameters)
        except (TypeError, ValueError) as exc:
            skipped.append({"config": config.name, "stream": stream.name, "reason": str(exc)})
            continue
        runs.append(_Run(config, opt))
    for t in range(1, stream.steps + 1):
        g = stream.grad(t)
        nonzero = g != 0
        ref.flat.grad.copy_(g)
        ref.opt.step()
        r = ref.flat.data
        ref_sq = _sq_norm(r)
        for run in runs:
            _step_run(run, g, nonzero, r, ref.prev, ref_sq, t)
        ref.prev.copy_(r)
        if progress is not None:
            progress(t)
    results = [Result(run.config.name, stream.name, _final_metrics(optimizer, run, ref, stream), run.curve) for run in runs]
    ref_loss = stream.loss(ref.flat.data.float()) if stream.loss is not None else None
    return results, skipped, ref_loss


def _step_run(run: _Run, g: torch.Tensor, nonzero: torch.Tensor, r: torch.Tensor, r_prev: torch.Tensor, ref_sq: float, t: int) -> None:
    flat = run.flat
    flat.grad.copy_(g)
    run.underflow += int((nonzero & (flat.grad == 0)).sum())
    run.opt.step()
    x = flat.data
    for s in _slices(x.numel()):
        lost, moved = lost_updates(run.prev[s], x[s], r_prev[s], r[s])
        run.lost += lost
        run.moved += moved
    if run.first_nonfinite is None and not bool(torch.isfinite(x).all()):
        run.first_nonfinite = t
    run.curve.append(math.sqrt(_sq_norm(x, r)) / math.sqrt(ref_sq) if ref_sq > 0 else math.nan)
    run.prev.copy_(x)


def _final_metrics(optimizer: str, run: _Run, ref: _Run, stream: Stream) -> dict[str, Any]:
    x, r = run.flat.data, ref.flat.data
    n = x.numel()
    rel = torch.empty(n, dtype=torch.float32)
    max_ulp = 0
    for s in _slices(n):
        rel[s] = relative_error(x[s], r[s])
        ulp = ulp_distance(x[s], r[s])
        max_ulp = max(max_ulp, int(ulp.max()) if ulp.numel() else 0)
    state_name, _ = _SECOND_MOMENT[optimizer]
    flushed = None
    if state_name is not None:
        f, nz = flushed_entries(run.flat.states[state_name], ref.flat.states[state_name])
        flushed = f / nz if nz else 0.0
    total_grads = stream.steps * n
    return {
        "max_rel_error": float(rel.max()),
        "median_rel_error": float(rel.median()),
        "final_rel_error": run.curve[-1] if run.curve else 0.0,
        "max_ulp": max_ulp,
        "nan_count": int(x.isnan().sum()),
        "inf_count": int(x.isinf().sum()),
        "first_nonfinite_step": run.first_nonfinite,
        "lost_update_fraction": run.lost / run.moved if run.moved else 0.0,
        "flushed_second_moment_fraction": flushed,
        "grad_underflow_fraction": run.underflow / total_grads if total_grads else 0.0,
        "final_loss": stream.loss(x.float()) if stream.loss is not None else None,
    }


# ---------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------


def _fmt(value, kind: str = "g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf"
        if kind == "%":
            return f"{100 * value:.3g}%"
        return f"{value:.3g}"
    return str(value)


def _json_value(value):
    """JSON has no inf/NaN: they are written as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


_COLUMNS = (
    ("config", "config", None), ("stream", "stream", None),
    ("max rel err", "max_rel_error", "g"), ("median rel err", "median_rel_error", "g"),
    ("final ‖Δ‖/‖x‖", "final_rel_error", "g"), ("max ULP", "max_ulp", "g"),
    ("NaN", "nan_count", "g"), ("Inf", "inf_count", "g"), ("first non-finite", "first_nonfinite_step", "g"),
    ("lost updates", "lost_update_fraction", "%"), ("flushed 2nd moment", "flushed_second_moment_fraction", "%"),
    ("grad underflow", "grad_underflow_fraction", "%"), ("final loss", "final_loss", "g"),
)


@dataclass
class Report:
    """Everything ``compare`` measured, with plain-language findings."""

    optimizer: str
    hyperparameters: dict[str, Any]
    workload: str
    seed: int
    steps: int
    streams: list[dict[str, Any]]
    configs: list[Config]
    results: list[Result]
    skipped: list[dict[str, str]] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: dict[str, Any] | None = None

    def rows(self) -> list[list[str]]:
        return [[_fmt(r.config if key == "config" else r.stream if key == "stream" else r.metrics[key], kind)
                 for _, key, kind in _COLUMNS] for r in self.results]

    def table(self) -> str:
        """A fixed-width text table, one row per configuration and stream."""
        header = [title for title, _, _ in _COLUMNS]
        rows = self.rows()
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (inf/NaN as strings)."""
        return _json_value({
            "optimizer": self.optimizer,
            "hyperparameters": self.hyperparameters,
            "workload": self.workload,
            "seed": self.seed,
            "steps": self.steps,
            "reference": "the same update rule in float64" + (" (dml_optim.Adam, identical rule for T >= 1)" if self.optimizer == "dml-adam" else ""),
            "streams": self.streams,
            "configs": [{"name": c.name, "param_dtype": c.param_dtype, "state_dtype": c.state_dtype,
                         "compute_dtype": c.compute_dtype, "master_weights": c.master_weights,
                         "description": c.description} for c in self.configs],
            "metrics": list(METRICS),
            "definitions": _DEFINITIONS,
            "results": [{"config": r.config, "stream": r.stream, "metrics": r.metrics, "rel_error_per_step": r.curve}
                        for r in self.results],
            "skipped": self.skipped,
            "findings": self.findings,
            "notes": self.notes,
            "plot": self.plot,
        })

    def to_markdown(self) -> str:
        """The report as Markdown: setup, table, findings, definitions."""
        hyper = ", ".join(f"{k}={v}" for k, v in self.hyperparameters.items())
        out = [f"# dml-optim compare: {self.optimizer} on {self.workload}", "",
               f"Optimizer `{self.optimizer}` ({hyper}); {self.steps} steps; seed {self.seed}; reference: the same "
               "rule in float64, fed the identical gradient stream.", "", "Streams:", ""]
        out += [f"- `{s['name']}`: {s['description']}" + (f" (reference final loss {_fmt(s['reference_loss'])})" if s.get("reference_loss") is not None else "") for s in self.streams]
        out += ["", "Configurations:", ""] + [f"- `{c.name}`: {c.description}" for c in self.configs]
        header = [title for title, _, _ in _COLUMNS]
        out += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in self.rows()]
        if self.skipped:
            out += ["", "Skipped:", ""] + [f"- `{s['config']}` ({s['stream']}): {s['reason']}" for s in self.skipped]
        out += ["", "## Findings", ""] + [f"- {f}" for f in self.findings]
        if self.plot:
            out += ["", f"![relative error per step]({self.plot['path']})"]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        out += ["", "## Definitions", ""] + [f"- `{k}`: {v}" for k, v in _DEFINITIONS.items()]
        return "\n".join(out) + "\n"

    def save_plot(self, path: str | Path) -> int:
        """Write the divergence plot (needs matplotlib); returns the number of lines drawn."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("the divergence plot needs matplotlib: pip install 'dml-optim[plot]'") from exc
        fig = Figure(figsize=(13, 6))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        styles = {"recorded": "-", "synthetic": "--", "gaussian": ":"}
        colors = {name: f"C{i}" for i, name in enumerate(CONFIGS)}
        for r in self.results:
            y = [v if math.isfinite(v) and v > 0 else math.nan for v in r.curve]
            label = f"{r.config} · {r.stream}"
            if r.metrics["first_nonfinite_step"] is not None:
                label += f" (NaN/inf from step {r.metrics['first_nonfinite_step']})"
            ax.plot(range(1, len(y) + 1), y, styles.get(r.stream, "-."), color=colors.get(r.config), label=label, linewidth=1.4)
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("relative error vs float64 reference  ‖x − x_ref‖₂ / ‖x_ref‖₂")
        ax.set_title(f"{self.optimizer} on {self.workload}: divergence from the float64 reference (seed {self.seed})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return len(ax.lines)


_DEFINITIONS = {
    "rel_error_per_step": "||x - x_ref||_2 / ||x_ref||_2 over all parameters after each step (float64; NaN once a parameter is NaN)",
    "max_rel_error / median_rel_error": f"of |x_i - x_ref_i| / max(|x_ref_i|, 2^-24) over all elements at the final step (NaN counts as inf)",
    "final_rel_error": "rel_error_per_step at the final step",
    "max_ulp": "largest distance in ULPs of the storage dtype between x_i and x_ref_i rounded to that dtype (NaN elements left out)",
    "nan_count / inf_count / first_nonfinite_step": "non-finite parameters at the end; first step (1-based) after which any parameter was non-finite",
    "lost_update_fraction": "over all steps and elements where the reference moved, the fraction where the parameter did not change",
    "flushed_second_moment_fraction": "among second-moment entries (exp_avg_sq, Adagrad's sum) nonzero in the reference, the fraction that are 0",
    "grad_underflow_fraction": "gradient entries nonzero in the stream but 0 in the storage dtype (all steps)",
    "final_loss": "cross-entropy of the built-in MLP on its training data with the configuration's parameters (recorded stream)",
}


# ---------------------------------------------------------------------------------
# findings: plain language generated from the numbers
# ---------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32", torch.float64: "FP64"}[dtype]


def _compute_dtype(config: Config) -> torch.dtype:
    if config.compute_dtype is not None:
        return config.compute_dtype
    return torch.float32 if config.master_weights else config.param_dtype


def _state_dtype(config: Config) -> torch.dtype:
    if config.state_dtype is not None:
        return config.state_dtype
    return torch.float32 if config.master_weights else config.param_dtype


def _findings(report: Report, numel: dict[str, int]) -> list[str]:
    """Plain-language findings, each computed from the numbers of ``report``."""
    out: list[str] = []
    by = {(r.config, r.stream): r for r in report.results}
    configs = {c.name: c for c in report.configs}
    for stream in report.streams:
        rows = [r for r in report.results if r.stream == stream["name"]]
        if rows:
            out += _summary_findings(report, stream, rows, by)
        underflow: dict[torch.dtype, tuple[float, list[str]]] = {}
        for r in rows:
            cfg, m = configs[r.config], r.metrics
            where = f"`{r.config}` ({r.stream} stream)"
            if m["first_nonfinite_step"] is not None:
                out.append(_nonfinite_finding(report, where, r, cfg, numel[r.stream], by))
            if m["flushed_second_moment_fraction"]:
                out.append(_flush_finding(report, where, m, _state_dtype(cfg), cfg.param_dtype))
            if cfg.param_dtype != torch.float32 and not cfg.master_weights and m["lost_update_fraction"] >= 0.01:
                out.append(_lost_finding(where, m["lost_update_fraction"], cfg, by.get(("fp16-master", r.stream))))
            if m["grad_underflow_fraction"] >= 0.0001:
                underflow.setdefault(cfg.param_dtype, (m["grad_underflow_fraction"], []))[1].append(f"`{r.config}`")
        for dtype, (fraction, names) in underflow.items():
            out.append(f"{stream['name']} stream: {_pct(fraction)} of gradient entries became 0 when stored in "
                       f"{_dtype_name(dtype)} (|g| below {smallest_subnormal(dtype) / 2:.3g}) in {', '.join(names)}; "
                       "loss scaling (dml_optim.amp.DynamicLossScaler) shifts small gradients into range.")
    seen = set()
    for s in report.skipped:
        if s["config"] not in seen:
            seen.add(s["config"])
            out.append(f"`{s['config']}` skipped: {s['reason']}")
    return out


def _summary_findings(report: Report, stream: dict[str, Any], rows: list[Result], by) -> list[str]:
    name = stream["name"]
    key = lambda r: (not math.isfinite(r.metrics["final_rel_error"]), r.metrics["final_rel_error"])
    ranked = sorted(rows, key=key)
    parts = ", ".join(f"`{r.config}` {_fmt(r.metrics['final_rel_error'])}" for r in ranked)
    out = [f"{name} stream, relative error after {report.steps} steps (||x - x_ref|| / ||x_ref||), best first: {parts}."]
    if stream.get("reference_loss") is not None:
        losses = ", ".join(f"`{r.config}` {_fmt(r.metrics['final_loss'])}" for r in rows)
        out.append(f"{name} stream, final training loss on the built-in data: reference {_fmt(stream['reference_loss'])}, {losses}.")
    half = [r for r in ranked if r.config != "fp32" and math.isfinite(r.metrics["final_rel_error"])]
    if half:
        best = half[0]
        out.append(f"{name} stream: the most faithful reduced-precision configuration is `{best.config}` "
                   f"(relative error {_fmt(best.metrics['final_rel_error'])}, max {best.metrics['max_ulp']} ULP from the "
                   "reference rounded to its storage dtype).")
    master = by.get(("fp16-master", name))
    if master is not None and math.isfinite(master.metrics["final_rel_error"]):
        mm = master.metrics
        text = (f"{name} stream: `fp16-master`'s FP16 parameters did not change in {_pct(mm['lost_update_fraction'])} "
                "of the updates, but its FP32 master copy accumulated those small steps, so they are not lost")
        if mm["final_rel_error"] <= 2.0**-10:
            text += (f": its error stays at the level of FP16 rounding of the parameters ({_fmt(mm['final_rel_error'])}; "
                     "half an FP16 ULP is 2^-11 ≈ 4.9e-4 relative).")
        else:
            text += (f"; its remaining error ({_fmt(mm['final_rel_error'])}) is above FP16 rounding of the parameters: "
                     "the gradients are stored in FP16 (each rounded to 11 bits"
                     + (f", {_pct(mm['grad_underflow_fraction'])} of them to 0" if mm["grad_underflow_fraction"] else "")
                     + ") before the FP32 update sees them.")
        out.append(text)
    return out


def _nonfinite_finding(report: Report, where: str, r: Result, cfg: Config, numel: int, by) -> str:
    m = r.metrics
    bad = (m["nan_count"] + m["inf_count"]) / numel
    cdtype = _compute_dtype(cfg)
    eps = report.hyperparameters.get("epsilon")
    if eps and float(torch.tensor(eps, dtype=cdtype)) == 0.0:
        fixed = by.get(("fp16-fp32compute", r.stream))
        alt = (f" (`fp16-fp32compute` on the same stream: {fixed.metrics['nan_count']} NaN)"
               if fixed is not None and cdtype == torch.float16 else "")
        return (f"{where}: epsilon {eps:g} is 0 in {_dtype_name(cdtype)} (smallest subnormal "
                f"{smallest_subnormal(cdtype):.3g}), so an element whose gradient and state are 0 computes 0/0 and an "
                f"element whose second moment underflowed divides by 0: {_pct(bad)} of parameters were NaN or inf at "
                f"the end, first at step {m['first_nonfinite_step']}. Use epsilon >= 1e-4 with "
                f"{_dtype_name(cdtype)} arithmetic, or FP32 arithmetic{alt}.")
    return (f"{where}: {_pct(bad)} of parameters were NaN or inf at the end, first at step "
            f"{m['first_nonfinite_step']} (overflow or 0/0 in {_dtype_name(cdtype)} arithmetic).")


def _flush_finding(report: Report, where: str, m: dict[str, Any], state_dtype: torch.dtype, grad_dtype: torch.dtype) -> str:
    state, beta_key = _SECOND_MOMENT[report.optimizer]
    flushed = m["flushed_second_moment_fraction"]
    coef = 1.0 - report.hyperparameters[beta_key] if beta_key else 1.0
    half = smallest_subnormal(state_dtype) / 2
    threshold = math.sqrt(half / coef)
    if threshold < smallest_subnormal(grad_dtype) / 2:
        # the state could hold these values: the zeros come from gradients that underflowed on storage
        return (f"{where}: {_pct(flushed)} of second-moment entries ({state}) are 0 where the reference's are not, "
                f"although the state is {_dtype_name(state_dtype)}: their gradients were always below "
                f"{smallest_subnormal(grad_dtype) / 2:.3g} and became 0 when stored in {_dtype_name(grad_dtype)} "
                "(see grad underflow); loss scaling keeps them.")
    term = f"(1 - beta)·g² = {coef:g}·g²" if beta_key else "g²"
    effect = ("the parameter then moves by lr·m/epsilon instead of lr·m/sqrt(v)" if beta_key
              else "the parameter then moves by lr·g/epsilon instead of lr·g/sqrt(sum)")
    return (f"{where}: {_pct(flushed)} of second-moment entries ({state}) flushed to zero: {term} is below "
            f"{half:.3g} (half {_dtype_name(state_dtype)}'s smallest subnormal) for every |g| below {threshold:.2g}, "
            f"so it rounds to 0 and {effect}. FP32 arithmetic does not help while the state is stored in "
            f"{_dtype_name(state_dtype)}: keep the states in FP32 (`fp16-master`, or state_dtype=torch.float32).")


def _lost_finding(where: str, lost: float, cfg: Config, master: Result | None) -> str:
    ulp_one = torch.finfo(cfg.param_dtype).eps
    text = (f"{where}: {_pct(lost)} of updates were lost to rounding: the step was below half an ULP of the parameter "
            f"(the ULP of 1.0 is {ulp_one:.3g} in {_dtype_name(cfg.param_dtype)}), so the parameter stayed put while "
            "the reference moved.")
    if master is not None and math.isfinite(master.metrics["final_rel_error"]):
        return text + (f" Use FP32 master weights (master_weights=True): `fp16-master` ends at relative error "
                       f"{_fmt(master.metrics['final_rel_error'])} on the same stream.")
    return text + " Use FP32 master weights (master_weights=True)."


# ---------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------


def compare(
    optimizer: str = "adam",
    steps: int | None = None,
    workload: str = "mlp",
    seed: int = 0,
    streams: Sequence[str] | None = None,
    configs: Sequence[str] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run every configuration and the float64 reference on identical gradient streams.

    Args:
        optimizer: ``adam``, ``dml-adam``, ``adagrad`` or ``momentum``.
        steps: steps per stream (default :func:`default_steps` of the workload's size).
        workload: ``"mlp"`` (the built-in model) or a model for
            :func:`dml_optim.inventory.resolve_model` (a built-in name such as
            ``gpt2``, or the path of an inventory JSON file).
        seed: seeds the model, the data and the streams.
        streams: default ``("recorded", "synthetic")`` for ``mlp`` and
            ``("gaussian", "synthetic")`` for an inventory (which has no model
            to record gradients from).
        configs: names from :data:`CONFIGS` (default: all).
        hyperparameters: overrides of the optimizer's hyperparameters.
        progress: called as ``progress(done, total)`` after every step of every
            stream (``total`` is steps times streams); None: silent.
    """
    _check_optimizer(optimizer)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    streams = tuple(streams) if streams is not None else (("recorded", "synthetic") if workload == "mlp" else ("gaussian", "synthetic"))
    for s in streams:
        if s not in STREAMS:
            raise ValueError(f"streams: unknown stream {s!r} (choose from {', '.join(STREAMS)})")
    if "recorded" in streams and workload != "mlp":
        raise ValueError("streams: 'recorded' needs the built-in model (workload 'mlp'); an inventory has shapes only")
    names = list(configs) if configs is not None else list(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"configs: unknown configuration {name!r} (choose from {', '.join(CONFIGS)})")
    hyper = _hyperparameters(optimizer, hyperparameters)
    init, shapes, wname = workload_params(workload, seed)
    steps = default_steps(init.numel()) if steps is None else steps
    threads = torch.get_num_threads()
    if init.numel() < _CHUNK:
        # small buffers gain nothing from intra-op threads, and on a loaded
        # machine the thread hand-offs cost 10-100x the op (measured: 14 ms vs 0.16 ms)
        torch.set_num_threads(1)
    try:
        report = _compare(optimizer, steps, workload, seed, streams, names, hyper, hyperparameters, init, shapes, wname, progress)
    finally:
        torch.set_num_threads(threads)
    return report


def _compare(optimizer: str, steps: int, workload: str, seed: int, streams: tuple[str, ...], names: list[str],
             hyper: dict[str, Any], hyperparameters: dict[str, Any] | None, init: torch.Tensor,
             shapes: list[tuple[int, ...]], wname: str, progress: Callable[[int, int], None] | None) -> Report:
    """:func:`compare` after validation: run each stream, then build the report."""
    results, skipped, stream_info, numel = [], [], [], {}
    for i, name in enumerate(streams):
        if name == "recorded":
            stream = recorded_stream(optimizer, steps, seed, hyperparameters)
        elif name == "synthetic":
            stream = synthetic_stream(init, shapes, steps, seed)
        else:
            stream = gaussian_stream(init, shapes, steps, seed)

        def step_done(t: int, before: int = i * steps) -> None:
            progress(before + t, steps * len(streams))

        res, skip, ref_loss = run_stream(optimizer, stream, [CONFIGS[n] for n in names],
                                         hyperparameters=hyperparameters,
                                         progress=None if progress is None else step_done)
        results += res
        skipped += skip
        numel[name] = stream.init.numel()
        stream_info.append({"name": name, "description": stream.description, "parameters": stream.init.numel(),
                            "reference_loss": ref_loss})
    report = Report(optimizer, hyper, wname, seed, steps, stream_info, [CONFIGS[n] for n in names], results, skipped)
    report.notes.append("Arithmetic in FP16/BF16 rounds every op's result to that dtype (as DirectML does); "
                        "on the CPU each op computes internally in FP32 first, so one op's result is correctly rounded.")
    report.findings = _findings(report, numel)
    return report

