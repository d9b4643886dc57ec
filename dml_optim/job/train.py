"""Training the built-in model on the built-in data: the library behind ``dml-optim train``.

:func:`train` runs one optimizer (ours, or its ``torch.optim`` equivalent from
docs/design.md §2) over the :mod:`dml_optim.job.toy` problem and returns a
:class:`RunResult`: losses before and after, held-out accuracy, median step
times, and an audit of one optimizer step (aten ops per step and DirectML CPU
fallbacks, from :func:`dml_optim.audit.audit_step`).  Two runs with the same
:class:`TrainConfig` see the same initial weights and the same batches, so
``dml_optim`` and ``torch.optim`` can be compared side by side.

Precision (``TrainConfig.dtype``):

* ``float32``: FP32 parameters, gradients and optimizer state.
* ``float16``: FP16 parameters, gradients and state, no loss scaling.  An
  optimizer with an epsilon uses ``1e-4`` (:data:`FP16_EPSILON`): the FP32
  defaults (1e-6, 1e-8, 1e-10) are at or below FP16's subnormal range.  The
  loss is computed in FP32 from FP16 logits.
* ``bfloat16``: bf16 parameters, gradients and state (bf16's range needs no
  loss scaling).  With ``TrainConfig.rounding="stochastic"`` ours rounds the
  updated parameters stochastically (``rounding="stochastic"``); torch.optim's
  run rounds to nearest, as it can only do.
* ``mixed``: FP16 parameters and gradients; ours keeps an FP32 master copy and
  FP32 state (``master_weights=True``) and scales the loss with
  :class:`dml_optim.training.amp.DynamicLossScaler` (everything on the device).  The
  torch.optim equivalent is torch's own recipe: FP32 parameters,
  ``torch.autocast(dtype=float16)`` and ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as nnf

from dml_optim.devices import DEVICES, fallback_counter, resolve as resolve_device
from dml_optim.job import toy
from dml_optim.optimizers import registry
from dml_optim.optimizers.registry import epsilon_name
from dml_optim.core.quant import MIN_ELEMENTS, QuantizedState

__all__ = [
    "DTYPES", "ROUNDINGS", "DEVICES", "DEFAULT_STEPS", "DEFAULT_BATCH_SIZE", "FP16_EPSILON",
    "TrainConfig", "RunResult", "resolve_device", "optimizer_hyperparameters", "train",
]

#: ``--dtype`` choices.
DTYPES = ("float32", "float16", "bfloat16", "mixed")
#: ``--rounding`` choices (ours, float16/bfloat16 parameters).
ROUNDINGS = ("nearest", "stochastic")
#: ``--device`` choices.
DEFAULT_STEPS = 1000
DEFAULT_BATCH_SIZE = 128
#: Epsilon of every optimizer that has one, with FP16 state (``--dtype float16``).
FP16_EPSILON = 1e-4
#: How many loss values :attr:`RunResult.loss_curve` keeps (evenly spaced).
CURVE_POINTS = 21


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: ``optimizer`` is a registry name; ``lr=None`` means its ``spec.train_lr``
    (a rate that trains the toy model well in :data:`DEFAULT_STEPS` steps)."""

    optimizer: str = "adam"
    lr: float | None = None
    steps: int = DEFAULT_STEPS
    batch_size: int = DEFAULT_BATCH_SIZE
    dtype: str = "float32"
    seed: int = 0
    #: dml_optim's ``state_bits`` (None, 8 or 4); torch.optim's run keeps full-precision state
    state_bits: int | None = None
    #: dml_optim's ``rounding`` of float16/bfloat16 parameters ("nearest" or "stochastic")
    rounding: str = "nearest"
    #: ours steps inside backward (:func:`dml_optim.step_in_backward`), each run as its gradients are complete
    step_in_backward: bool = False
    hidden: int = toy.HIDDEN
    n_train: int = toy.N_TRAIN
    n_test: int = toy.N_TEST

    def validated(self) -> "TrainConfig":
        """This config with ``lr`` filled in; ``ValueError`` naming the bad field otherwise."""
        spec = registry.spec(self.optimizer)  # ValueError listing the names
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "batch_size", "hidden", "n_train", "n_test"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.state_bits, bool) or self.state_bits not in (None, 8, 4):
            raise ValueError(f"state_bits must be None, 8 or 4, got {self.state_bits!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.rounding == "stochastic" and self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"rounding='stochastic' rounds float16/bfloat16 parameters; dtype is {self.dtype!r}")
        if not isinstance(self.step_in_backward, bool):
            raise ValueError(f"step_in_backward must be a bool, got {self.step_in_backward!r}")
        if self.step_in_backward and self.dtype == "mixed":
            raise ValueError("step_in_backward with dtype='mixed': a loss scaler decides on every gradient whether "
                             "the step happens; use dtype='bfloat16' or 'float32'")
        lr = spec.train_lr if self.lr is None else self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        return replace(self, lr=float(lr))


@dataclass
class RunResult:
    """The outcome of one :func:`train` run (all plain Python values; JSON-ready via :meth:`to_dict`).

    Losses are the mean cross-entropy over the whole training set, before the
    first and after the last step; ``test_accuracy`` is on the held-out set.
    Times are medians over the steps, with the device synchronised around each
    measured region: ``median_optimizer_step_ms`` times ``optimizer.step()``
    (and, in mixed precision, the loss scaler's step and update);
    ``median_step_ms`` the whole iteration (batch, forward, backward, step).
    ``audit`` has ``total_ops``, ``fallback_ops``, ``fallbacks`` and
    ``host_syncs`` of one extra optimizer step run after the evaluation, or
    ``error`` when the audit could not run.
    """

    impl: str
    optimizer: str
    hyperparameters: dict[str, Any]
    dtype: str
    param_dtype: str
    state_dtype: str
    device: str
    steps: int
    batch_size: int
    seed: int
    initial_loss: float
    final_loss: float
    train_accuracy: float
    test_accuracy: float
    chance: float
    median_step_ms: float
    median_optimizer_step_ms: float
    total_s: float
    skipped_steps: int | None = None
    loss_scale: float | None = None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    #: on the stand-in DirectML device: the ops of the whole run (forward, backward, steps) that DirectML runs
    #: through its CPU fallback, with their counts, as the stand-in counted them (None elsewhere)
    directml_fallbacks: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["loss_curve"] = [[s, v] for s, v in self.loss_curve]
        return out


# ----------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------

def _synchronize(device: torch.device, probe: torch.Tensor) -> None:
    """Wait for the device's queued work (CPU: nothing to wait for).

    DirectML has no ``synchronize()``; reading one element of ``probe`` back
    waits for the queue instead.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        probe.reshape(-1)[:1].cpu()


# ----------------------------------------------------------------------------
# optimizers
# ----------------------------------------------------------------------------

def optimizer_hyperparameters(config: TrainConfig) -> dict[str, Any]:
    """Hyperparameters passed to our optimizer (and mapped to torch.optim's) for ``config``.

    ``lr`` always; in ``float16``, the optimizer's epsilon (AdamW's ``eps``)
    is :data:`FP16_EPSILON`: the defaults (1e-6, 1e-8, 1e-10) round to or
    near 0 in FP16, and Adagrad then computes ``0 / (0 + 0)`` = NaN for a
    parameter whose gradients have all been 0.  Momentum has no epsilon.
    """
    config = config.validated()
    hyper: dict[str, Any] = {"lr": config.lr}
    eps = epsilon_name(config.optimizer)
    if config.dtype == "float16" and eps is not None:
        hyper[eps] = FP16_EPSILON
    return hyper


def _describe_hyperparameters(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The first param group's settings as plain values; in ours, torch.optim's names of the same values
    (kept in our groups for schedulers, e.g. ``betas``) are left out: they repeat ours."""
    group = opt.param_groups[0]
    spec = getattr(type(opt), "spec", None)
    repeated = set(spec.torch_names) if spec is not None else set()
    out = {}
    for key, value in group.items():
        if key == "params" or key in repeated:
            continue
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        if value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out


def _name(opt: torch.optim.Optimizer) -> str:
    cls = type(opt)
    return f"{'torch.optim' if cls.__module__.startswith('torch.optim') else 'dml_optim'}.{cls.__name__}"


def _state_dtype(opt: torch.optim.Optimizer, fallback: torch.dtype) -> str:
    infos = opt.flat_buffers() if hasattr(opt, "flat_buffers") else []
    quantized = [s for i in infos for s in i.states.values() if isinstance(s, QuantizedState)]
    if quantized:
        full = sorted({str(s.dtype).replace("torch.", "") for i in infos for s in i.states.values()
                       if not isinstance(s, QuantizedState)})
        return (f"{quantized[0].format.bits}-bit blocks"
                + (f" ({', '.join(full)} under {MIN_ELEMENTS} elements)" if full else ""))
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                return str(value.dtype).replace("torch.", "")
    for info in opt.flat_buffers() if hasattr(opt, "flat_buffers") else []:
        for value in info.states.values():
            if isinstance(value, QuantizedState):
                return f"{value.format.bits}-bit"
            return str(value.dtype).replace("torch.", "")
    return str(fallback).replace("torch.", "")


def _audit(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``total_ops``, ``fallback_ops``, ``fallbacks``, ``host_syncs`` of one step of ``opt`` (it steps)."""
    try:
        from dml_optim.audit import audit_step

        report = audit_step(opt)
    except Exception as exc:  # an audit failure must not hide the training result
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    return {
        "total_ops": report.total_ops,
        "fallback_ops": report.fallback_ops,
        "fallbacks": [{"op": op, "count": n} for op, n in report.fallbacks],
        "host_syncs": report.host_syncs,
        "tensors": report.num_tensors,
        "flat_buffers": report.flat_buffers,
    }


# ----------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------

@torch.no_grad()
def _mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 4096) -> float:
    total = 0.0
    for i in range(0, x.shape[0], batch):
        logits = model(x[i:i + batch]).float()
        total += float(nnf.cross_entropy(logits, y[i:i + batch], reduction="sum"))
    return total / x.shape[0]


#: ``progress(step, steps, loss)``: called after steps the caller asked for (see :func:`train`).
ProgressFn = Callable[[int, int, float], None]


def train(
    config: TrainConfig = TrainConfig(),
    *,
    device: torch.device | str = "cpu",
    impl: str = "dml_optim",
    progress: ProgressFn | None = None,
    progress_every: int = 0,
    audit: bool = True,
) -> RunResult:
    """Train the toy MLP on the toy data with ``config`` and return a :class:`RunResult`.

    Args:
        config: hyperparameters and sizes (validated; ``ValueError`` otherwise).
        device: where to train.
        impl: ``"dml_optim"`` (ours) or ``"torch"`` (the torch.optim equivalent,
            docs/design.md §2, ``foreach=True``; same initial weights, same batches).
        progress: called as ``progress(step, steps, loss)`` every
            ``progress_every`` steps and after the last one (reads the loss: a
            host sync at those steps only).
        progress_every: see ``progress``; 0 means only after the last step.
        audit: run :func:`dml_optim.audit.audit_step` on one extra optimizer
            step after the evaluation (it does not affect the reported numbers).
    """
    config = config.validated()
    if impl not in ("dml_optim", "torch"):
        raise ValueError(f"impl must be 'dml_optim' or 'torch', got {impl!r}")
    if isinstance(progress_every, bool) or not isinstance(progress_every, int) or progress_every < 0:
        raise ValueError(f"progress_every must be a non-negative integer, got {progress_every!r}")
    device = torch.device(device)
    mixed = config.dtype == "mixed"
    torch_amp = mixed and impl == "torch"
    param_dtype = (torch.float32 if (config.dtype == "float32" or torch_amp)
                   else torch.bfloat16 if config.dtype == "bfloat16" else torch.float16)

    x_train, y_train, x_test, y_test = toy.make_dataset(
        config.seed, config.n_train, config.n_test, device=device, dtype=param_dtype)
    model = toy.make_model(config.seed, config.hidden, device=device, dtype=param_dtype)
    gen = torch.Generator().manual_seed(config.seed + 1)
    batches = torch.randint(0, config.n_train, (config.steps, config.batch_size), generator=gen).to(device)
    hyper = optimizer_hyperparameters(config)
    if impl == "torch":  # foreach=True: what torch 2.4 picks on a DirectML device (and fine on CPU/CUDA)
        opt = registry.torch_equivalent(config.optimizer, model.parameters(), foreach=True, **hyper)
    else:  # mixed: an FP32 master copy of the FP16 parameters, and FP32 state
        precision = {"rounding": "stochastic"} if config.rounding == "stochastic" else {}
        opt = registry.build(config.optimizer, model.parameters(), master_weights=mixed, state_bits=config.state_bits,
                             **precision, **hyper)
    # float16 parameters stepped inside backward (the lean configuration DirectML runs) scale the loss: each run
    # is unscaled, checked and stepped on the device as its gradients arrive
    lean_fp16 = param_dtype == torch.float16 and config.step_in_backward and impl == "dml_optim"
    scaler = _make_scaler(device, mixed or lean_fp16, torch_amp)
    inside = None
    if config.step_in_backward and impl == "dml_optim":  # (torch.optim's run steps after backward)
        from dml_optim.training.backward import step_in_backward

        inside = step_in_backward(opt, scaler=scaler)
    probe = next(model.parameters())

    counting = fallback_counter(device)
    initial_loss = _mean_loss(model, x_train, y_train)
    losses: list[torch.Tensor] = []
    skipped = torch.zeros((), device=device) if ((mixed or lean_fp16) and not torch_amp) else None
    step_ms: list[float] = []
    opt_ms: list[float] = []
    start = time.perf_counter()
    for i in range(config.steps):
        _synchronize(device, probe)
        t0 = time.perf_counter()
        idx = batches[i]
        opt.zero_grad()
        with _autocast(device, torch_amp):
            logits = model(x_train[idx])
        loss = nnf.cross_entropy(logits.float(), y_train[idx])
        (scaler.scale(loss) if scaler is not None else loss).backward()
        _synchronize(device, probe)
        t1 = time.perf_counter()
        if scaler is None:
            opt.step()  # (inside backward: nothing is left to step; the time is backward's)
        elif torch_amp:
            scaler.step(opt)
            scaler.update()
        else:
            skipped += scaler.step(opt)
            scaler.update()
        _synchronize(device, probe)
        t2 = time.perf_counter()
        step_ms.append((t2 - t0) * 1e3)
        opt_ms.append((t2 - t1) * 1e3)
        losses.append(loss.detach())
        if progress is not None and (i + 1 == config.steps or (progress_every and (i + 1) % progress_every == 0)):
            progress(i + 1, config.steps, float(losses[-1]))
    total_s = time.perf_counter() - start
    fallbacks = counting() if counting is not None else None
    if inside is not None:
        inside.remove()  # (the audit's step after the evaluation is a plain one)

    final_loss = _mean_loss(model, x_train, y_train)
    curve = torch.stack(losses).float().cpu().tolist()
    picks = sorted({round(k * (len(curve) - 1) / (CURVE_POINTS - 1)) for k in range(CURVE_POINTS)})
    result = RunResult(
        impl="torch.optim" if impl == "torch" else "dml_optim",
        optimizer=_name(opt),
        hyperparameters=_describe_hyperparameters(opt),
        dtype=config.dtype,
        param_dtype=str(param_dtype).replace("torch.", ""),
        state_dtype=_state_dtype(opt, param_dtype),
        device=str(device),
        steps=config.steps,
        batch_size=config.batch_size,
        seed=config.seed,
        initial_loss=initial_loss,
        final_loss=final_loss,
        train_accuracy=toy.accuracy(model, x_train, y_train),
        test_accuracy=toy.accuracy(model, x_test, y_test),
        chance=toy.chance_level(),
        median_step_ms=statistics.median(step_ms),
        median_optimizer_step_ms=statistics.median(opt_ms),
        total_s=total_s,
        skipped_steps=None if skipped is None else int(skipped.item()),
        loss_scale=None if scaler is None else float(scaler.get_scale()),
        loss_curve=[(p + 1, curve[p]) for p in picks],
        directml_fallbacks=fallbacks,
    )
    if audit:
        result.audit = _audit(opt)
    return result


def _make_scaler(device: torch.device, mixed: bool, torch_amp: bool):
    if not mixed:
        return None
    if torch_amp:
        return torch.amp.GradScaler(device.type)
    from dml_optim.training.amp import DynamicLossScaler

    return DynamicLossScaler(device=device)


def _autocast(device: torch.device, enabled: bool):
    if not enabled:
        import contextlib

        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.float16)
