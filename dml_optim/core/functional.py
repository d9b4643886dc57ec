"""The update rules of ONNX ``Adagrad``/``Momentum``/``Adam``, DirectML's
``ADAM_OPTIMIZER`` and torch's ``AdamW``, written once.

Long by design: one cohesive job, the math; its public out-of-place
functions, their validation, the coefficients and the in-place kernels
belong together.

Two layers, one piece of math:

* **Coefficients** (``*_coefficients``): the per-step scalars of a rule
  (bias correction, learning-rate decay, ...), computed from ``R``/``T`` by
  ordinary arithmetic that works unchanged on Python numbers (eager: no device
  op, no host sync) and on 0-d tensors (compiled backend, or a step counter
  kept on the device so that an overflow can skip a step without a host sync).
* **In-place kernels** (``adam_``, ``adagrad_``, ``momentum_``): update one
  parameter tensor and its states in place, usually a whole flat buffer, with
  a handful of element-wise ops that are all native on DirectML (no ``lerp``,
  see ``dml_optim/data/torch-directml-dispatch.tsv``).  A preallocated
  ``scratch`` tensor (same shape and dtype as ``x``) makes a step allocation
  free.

The public functions ``adagrad``, ``momentum``, ``adam`` and ``dml_adam`` follow
the ONNX calling convention (inputs ``R, T, X..., G..., states...``; outputs
``X_new..., states_new...``), validate everything first, never modify their
inputs and are what the optimizers, the ONNX runner and the tests share.

Formulas (``*`` element-wise; the specs are quoted in docs/design.md)::

    ONNX Adagrad:   r = R / (1 + T * decay_factor)
                    G_reg = norm_coefficient * X + G
                    H_new = H + G_reg * G_reg
                    X_new = X - r * G_reg / (sqrt(H_new) + epsilon)
    ONNX Momentum:  G_reg = norm_coefficient * X + G
                    V_new = alpha * V + (beta if T > 0 else 1) * G_reg
                    standard: X_new = X - R * V_new
                    nesterov: X_new = X - R * (G_reg + alpha * V_new)
    ONNX Adam:      G_reg = norm_coefficient * X + G
                    V_new = alpha * V + (1 - alpha) * G_reg
                    H_new = beta * H + (1 - beta) * G_reg * G_reg
                    R_adj = R * sqrt(1 - beta**T) / (1 - alpha**T) if T > 0 else R
                    X_new = (1 - norm_coefficient_post) * (X - R_adj * V_new / (sqrt(H_new) + epsilon))
    DirectML Adam:  M = Beta1 * M + (1 - Beta1) * G
                    V = Beta2 * V + (1 - Beta2) * G * G
                    X = X - LearningRate * sqrt(1 - Beta2**T) / (1 - Beta1**T) * M / (sqrt(V) + Epsilon)

torch's AdamW (decoupled weight decay, epsilon after the bias correction)
runs through the same ``adam_`` kernel with step-dependent ``epsilon`` and a
``decay`` factor (:func:`adamw_coefficients`).

DirectML's rule is ONNX Adam with ``norm_coefficient = norm_coefficient_post = 0``
except at ``T = 0``, where DirectML computes ``0/0`` (NaN parameters) while ONNX
disables the bias correction.

.. warning:: Epsilon placement. ONNX and DirectML add ``epsilon`` to the
   *uncorrected* ``sqrt(H)`` (the "epsilon hat" form of the Adam paper);
   ``torch.optim.Adam`` adds it to the bias-corrected ``sqrt(H / (1 - beta**T))``.
   The two agree exactly only when ``epsilon == 0``.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

import torch

from dml_optim.core.tracing import is_compiling

__all__ = [
    "Scalar",
    "adagrad",
    "momentum",
    "adam",
    "dml_adam",
    "adagrad_",
    "momentum_",
    "adam_",
    "adagrad_coefficients",
    "momentum_coefficients",
    "adam_coefficients",
    "dml_adam_coefficients",
    "adamw_coefficients",
    "epsilon_before_correction",
    "axpy_",
    "scale_",
    "signed",
    "MOMENTUM_MODES",
    "check_hyperparameter",
    "check_float_tensor",
    "check_like",
]

#: A per-step scalar: a Python number or a 0-d tensor.
Scalar = Union[float, int, torch.Tensor]

MOMENTUM_MODES = ("standard", "nesterov")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------
# validation helpers (shared with the optimizers)
# --------------------------------------------------------------------------


def check_hyperparameter(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a float, or raise naming ``name`` and the value.

    Rejects non-numbers (``bool`` included), non-finite values and values
    outside ``[low, high]`` (ends open where asked).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:  # torch.optim's type for "Tensor lr must be 1-element"
            raise ValueError(f"Tensor {name} must be 1-element, got a tensor of shape {tuple(value.shape)}")
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = value.item()
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range: out of every interval we accept
        raise ValueError(f"{name} is too large for a float, got an integer of {int(value).bit_length()} bits") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high:g}, got {value!r}")
    return value


def check_float_tensor(name: str, t) -> None:
    """Raise unless ``t`` is a real floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a real floating-point tensor, got dtype {t.dtype}")
    if t.is_sparse:
        raise TypeError(f"{name} must be a dense tensor, got a sparse one")


def _scalar(name: str, value, *, integer: bool = False) -> float | int:
    """``R`` or ``T`` as a Python number: a number or a 1-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 and value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real scalar, got dtype {value.dtype}")
        if integer and value.dtype.is_floating_point:
            raise TypeError(f"{name} must be an integer scalar, got dtype {value.dtype}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real scalar, got {value!r} ({type(value).__name__})")
    if integer:
        if not isinstance(value, numbers.Integral):
            if not (math.isfinite(value) and float(value).is_integer()):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        value = int(value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        if value > _INT64_MAX:
            raise ValueError(f"{name} must fit in int64 (ONNX's type for {name}), got {value}")
        return value
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _split(inputs: Sequence, groups: int, names: Sequence[str]) -> list[list[torch.Tensor]]:
    """Split ONNX variadic inputs into ``groups`` equal lists and check them."""
    if len(inputs) == 0 or len(inputs) % groups:
        raise ValueError(
            f"inputs: expected a positive multiple of {groups} tensors "
            f"({', '.join(n + '...' for n in names)}), got {len(inputs)}"
        )
    n = len(inputs) // groups
    parts = [list(inputs[i * n : (i + 1) * n]) for i in range(groups)]
    for name, part in zip(names, parts):
        for i, t in enumerate(part):
            check_float_tensor(f"{name}[{i}]", t)
    for i, x in enumerate(parts[0]):
        for name, part in zip(names[1:], parts[1:]):
            check_like(f"{name}[{i}]", part[i], f"{names[0]}[{i}]", x)
    return parts


def check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``t`` has ``ref``'s shape (ValueError), dtype (TypeError) and device (ValueError)."""
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, but {ref_name} has shape {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, but {ref_name} has dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, but {ref_name} is on {ref.device}")


# --------------------------------------------------------------------------
# scalar arithmetic that works on numbers and on 0-d tensors
# --------------------------------------------------------------------------


def _div(a: Scalar, b: Scalar) -> Scalar:
    """``a / b`` with IEEE semantics for Python floats (x/0 = ±inf, 0/0 = nan)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a / b
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def _where(cond: Scalar, a: Scalar, b: Scalar, like: Scalar = None) -> Scalar:
    """``a if cond else b``; element-wise when ``cond`` is a tensor.

    Number operands become tensors shaped and typed like ``like`` with
    ``full_like`` (a device fill: no host-to-device copy, no sync).
    """
    if isinstance(cond, torch.Tensor):
        a, b = (v if isinstance(v, torch.Tensor) else torch.full_like(like, v) for v in (a, b))
        return torch.where(cond, a, b)
    return a if cond else b


def _sqrt(a: Scalar) -> Scalar:
    if isinstance(a, torch.Tensor):
        return torch.sqrt(a)
    return math.sqrt(a)


def _one_minus_pow(base: Scalar, T: Scalar) -> Scalar:
    """``1 - base**T``, precise on the device too.

    For a tensor ``T`` this is ``-expm1(T * log(base))``: ``1 - base**T`` in
    float32 loses most digits to cancellation when ``base`` is near 1 (0.999:
    relative error 1e-5), while ``log(base)`` is taken in float64 on the host
    (a Python ``base``) and ``expm1`` keeps the small result precise.
    """
    if not isinstance(T, torch.Tensor) and not isinstance(base, torch.Tensor):
        return 1 - base**T
    log_base = torch.log(base) if isinstance(base, torch.Tensor) else (math.log(base) if base > 0 else -math.inf)
    return torch.expm1(T * log_base).neg()


def _step(T: Scalar) -> Scalar:
    """A tensor step counter as floating point (an integer one would truncate the
    coefficients computed from it); float32 unless it is already a float type."""
    if isinstance(T, torch.Tensor) and not T.is_floating_point():
        return T.to(torch.float32)
    return T


def adagrad_coefficients(R: Scalar, T: Scalar, *, decay_factor: float) -> dict[str, Scalar]:
    """``{"rate": R / (1 + T * decay_factor)}``."""
    T = _step(T)
    return {"rate": _div(R, 1 + T * decay_factor)}


def momentum_coefficients(R: Scalar, T: Scalar, *, beta: float) -> dict[str, Scalar]:
    """``{"lr": R, "grad_scale": beta if T > 0 else 1}``."""
    T = _step(T)
    return {"lr": R, "grad_scale": _where(T > 0, beta, 1.0, like=T)}


def adam_coefficients(R: Scalar, T: Scalar, *, alpha: float, beta: float) -> dict[str, Scalar]:
    """ONNX: ``{"step_size": R * sqrt(1 - beta**T) / (1 - alpha**T) if T > 0 else R}``."""
    T = _step(T)
    return {"step_size": _where(T > 0, _div(R * _sqrt(_one_minus_pow(beta, T)), _one_minus_pow(alpha, T)), R, like=T)}


def adamw_coefficients(lr: Scalar, T: Scalar, *, beta1: float, beta2: float, eps: Scalar,
                       weight_decay: Scalar) -> dict[str, Scalar]:
    """torch's AdamW (T from 1) in the form of :func:`adam_`'s scalars.

    torch computes ``X - lr / (1 - beta1**T) * V / (sqrt(H) / sqrt(1 - beta2**T) + eps)``
    after ``X *= 1 - lr * weight_decay``.  Multiplying numerator and
    denominator by ``sqrt(1 - beta2**T)`` gives :func:`adam_`'s form with::

        step_size = lr * sqrt(1 - beta2**T) / (1 - beta1**T)
        epsilon   = eps * sqrt(1 - beta2**T)
        decay     = 1 - lr * weight_decay

    (the same update, one division fewer per element).
    """
    T = _step(T)
    root = _sqrt(_one_minus_pow(beta2, T))
    decay = 1 - lr * weight_decay if isinstance(weight_decay, torch.Tensor) or weight_decay else 1.0
    return {"step_size": _div(lr * root, _one_minus_pow(beta1, T)), "epsilon": eps * root, "decay": decay}


def epsilon_before_correction(epsilon: float, beta: float, T: int) -> float:
    """torch's Adam ``eps`` (added after the bias correction) that places ``epsilon`` before it, as ONNX
    and DirectML do: ``epsilon / sqrt(1 - beta**T)``, since
    ``sqrt(H) / sqrt(1 - beta**T) + eps = (sqrt(H) + epsilon) / sqrt(1 - beta**T)``
    (the fused backend's mapping onto ``torch._fused_adam_``; ``beta < 1``, ``T >= 1``)."""
    return epsilon / math.sqrt(1 - beta**T)


def dml_adam_coefficients(learning_rate: Scalar, T: Scalar, *, beta1: float, beta2: float) -> dict[str, Scalar]:
    """DirectML: ``{"step_size": LearningRate * sqrt(1 - Beta2**T) / (1 - Beta1**T)}`` (NaN at T = 0)."""
    T = _step(T)
    return {"step_size": _div(learning_rate * _sqrt(_one_minus_pow(beta2, T)), _one_minus_pow(beta1, T))}


# --------------------------------------------------------------------------
# in-place kernels
# --------------------------------------------------------------------------


def axpy_(x: torch.Tensor, y: torch.Tensor, c: Scalar) -> torch.Tensor:
    """``x += c * y`` (one op; ``c`` a number or a 0-d tensor).  Traced (:mod:`dml_optim.core.tracing`), a tensor
    ``c`` takes ``x + y * c``: ``addcmul``'s ``value`` of 1 would stay a vector multiply in the kernel."""
    if isinstance(c, torch.Tensor):
        return x.add_(y * c) if is_compiling() else x.addcmul_(y, c)
    return x.add_(y, alpha=c)


def _add_(x: torch.Tensor, c: Scalar) -> torch.Tensor:
    """``x += c`` (one op, skipped when ``c`` is the number 0)."""
    if isinstance(c, torch.Tensor) or c != 0:
        x.add_(c)
    return x


def scale_(x: torch.Tensor, c: Scalar) -> torch.Tensor:
    """``x *= c`` (one op, skipped when ``c`` is the number 1)."""
    if isinstance(c, torch.Tensor) or c != 1:
        x.mul_(c)
    return x


def _add_square_(h: torch.Tensor, g: torch.Tensor, c: Scalar, scratch: torch.Tensor | None) -> torch.Tensor:
    """``h += c * g * g``; with a tensor ``c`` the product goes through ``scratch``."""
    if isinstance(c, torch.Tensor):
        if is_compiling():  # (as in axpy_: the same value, no multiply by 1)
            return h.add_(g * c * g)
        return h.addcmul_(torch.mul(g, c, out=scratch), g)
    return h.addcmul_(g, g, value=c)


def _add_ratio_(x: torch.Tensor, num: torch.Tensor, den: torch.Tensor, c: Scalar) -> torch.Tensor:
    """``x += c * num / den``; overwrites ``den`` when ``c`` is a tensor."""
    if isinstance(c, torch.Tensor):
        if is_compiling():  # (as in axpy_)
            return x.add_(num / den * c)
        return x.addcmul_(torch.div(num, den, out=den), c)
    return x.addcdiv_(num, den, value=c)


def _regularized(x: torch.Tensor, g: torch.Tensor, norm_coefficient: Scalar, scratch: torch.Tensor | None,
                 grad_sign: float = 1.0) -> torch.Tensor:
    """``U`` with ``G_reg = grad_sign * U``: ``U = G + grad_sign * norm_coefficient * X``.

    (``g`` itself when the coefficient is the number 0.)  ``grad_sign`` is -1
    for torch's ``maximize``, which negates the gradient *before* the L2 term
    is added: ``G_reg = -G + norm_coefficient * X = -(G - norm_coefficient * X)``;
    negation is exact, so the callers fold the sign into their coefficients.
    """
    norm_coefficient = signed(norm_coefficient, grad_sign)
    if not isinstance(norm_coefficient, torch.Tensor) and norm_coefficient == 0:
        return g
    if isinstance(norm_coefficient, torch.Tensor):
        return torch.mul(x, norm_coefficient, out=scratch).add_(g)
    return torch.add(g, x, alpha=norm_coefficient, out=scratch)


def signed(c: Scalar, sign: float) -> Scalar:
    """``sign * c`` without an op when ``sign`` is 1 (``sign`` is a structural Python number: +1 or -1)."""
    if sign == 1:
        return c
    return c.neg() if isinstance(c, torch.Tensor) else -c


def adagrad_(
    x: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    *,
    rate: Scalar,
    epsilon: Scalar,
    norm_coefficient: Scalar = 0.0,
    grad_sign: float = 1.0,
    scratch: torch.Tensor | None = None,
    scratch2: torch.Tensor | None = None,
) -> None:
    """ONNX Adagrad in place on ``x``/``h`` (``g`` is read only).

    ``rate`` is ``adagrad_coefficients(...)["rate"]``; ``grad_sign`` -1 is
    torch's ``maximize`` (``G_reg = norm_coefficient * X - G``).  Needs two
    scratch tensors when ``norm_coefficient`` is nonzero (one otherwise).
    """
    u = _regularized(x, g, norm_coefficient, scratch, grad_sign)  # G_reg = grad_sign * u
    h.addcmul_(u, u)
    den = _add_(torch.sqrt(h, out=scratch2 if u is scratch else scratch), epsilon)
    _add_ratio_(x, u, den, signed(rate.neg() if isinstance(rate, torch.Tensor) else -rate, grad_sign))


def momentum_(
    x: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor | None,
    *,
    lr: Scalar,
    grad_scale: Scalar,
    alpha: Scalar,
    nesterov: bool,
    norm_coefficient: Scalar = 0.0,
    grad_sign: float = 1.0,
    scratch: torch.Tensor | None = None,
) -> None:
    """ONNX Momentum in place on ``x``/``v``; ``grad_scale`` is ``beta`` or 1 at T = 0.

    ``grad_sign`` -1 is torch's ``maximize`` (``G_reg = norm_coefficient * X - G``).
    ``v`` None is SGD without momentum (torch.optim.SGD with ``momentum=0``
    keeps no buffer): ``X = X - lr * G_reg``.
    """
    u = _regularized(x, g, norm_coefficient, scratch, grad_sign)  # G_reg = grad_sign * u
    neg_lr = lr.neg() if isinstance(lr, torch.Tensor) else -lr
    if v is None:
        axpy_(x, u, signed(neg_lr, grad_sign))
        return
    scale_(v, alpha)
    axpy_(v, u, signed(grad_scale, grad_sign))
    if nesterov:
        axpy_(x, u, signed(neg_lr, grad_sign))
        axpy_(x, v, neg_lr * alpha)
    else:
        axpy_(x, v, neg_lr)


def adam_(
    x: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    *,
    step_size: Scalar,
    alpha: Scalar,
    beta: Scalar,
    epsilon: Scalar,
    norm_coefficient: Scalar = 0.0,
    norm_coefficient_post: Scalar = 0.0,
    decay: Scalar = 1.0,
    grad_sign: float = 1.0,
    h_max: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    scratch2: torch.Tensor | None = None,
) -> None:
    """ONNX Adam (and DirectML ADAM_OPTIMIZER, and torch's AdamW) in place on ``x``/``v``/``h``::

        X = decay * X                                   (AdamW: 1 - lr * weight_decay)
        G_reg = norm_coefficient * X + grad_sign * G    (grad_sign -1: torch's maximize)
        V = alpha * V + (1 - alpha) * G_reg
        H = beta * H + (1 - beta) * G_reg * G_reg
        H_max = max(H_max, H)                           (AMSGrad, when h_max is given)
        X = X - step_size * V / (sqrt(H or H_max) + epsilon)
        X = (1 - norm_coefficient_post) * X

    ``step_size`` is ``adam_coefficients``, ``dml_adam_coefficients`` or
    ``adamw_coefficients``'s ``"step_size"`` (AdamW also sets ``epsilon`` and
    ``decay``).  The second-moment term uses ``(1 - beta)`` computed here, so
    with tensor ``alpha``/``beta`` the result stays exact for a no-op step
    (``alpha = beta = 1``, ``step_size = 0``).  ``scratch2`` is needed only with a
    nonzero ``norm_coefficient`` and a tensor ``beta`` (else allocated).
    """
    scale_(x, decay)
    u = _regularized(x, g, norm_coefficient, scratch, grad_sign)  # G_reg = grad_sign * u
    scale_(v, alpha)
    axpy_(v, u, (1 - alpha) * grad_sign)
    scale_(h, beta)
    _add_square_(h, u, 1 - beta, scratch if u is not scratch else scratch2)
    if h_max is not None:
        h = torch.maximum(h_max, h, out=h_max)
    den = _add_(torch.sqrt(h, out=scratch), epsilon)
    _add_ratio_(x, v, den, step_size.neg() if isinstance(step_size, torch.Tensor) else -step_size)
    scale_(x, 1 - norm_coefficient_post)


# --------------------------------------------------------------------------
# out-of-place, ONNX calling convention
# --------------------------------------------------------------------------


def _prepare(R, T, inputs, groups: int, names: Sequence[str]):
    R = _scalar("R", R)
    T = _scalar("T", T, integer=True)
    parts = _split(inputs, groups, names)
    return R, T, parts


def adagrad(R, T, *inputs: torch.Tensor, decay_factor: float = 0.0, epsilon: float = 0.0, norm_coefficient: float = 0.0):
    """ONNX ``Adagrad-1``: ``adagrad(R, T, X..., G..., H...) -> (X_new..., H_new...)``.

    ``r = R / (1 + T * decay_factor)``; ``H_new = H + G_reg**2``;
    ``X_new = X - r * G_reg / (sqrt(H_new) + epsilon)`` with ``G_reg = norm_coefficient * X + G``.
    Equals ``torch.optim.Adagrad(lr=R, lr_decay=decay_factor, eps=epsilon,
    weight_decay=norm_coefficient)`` with T counted from 0.
    """
    decay_factor = check_hyperparameter("decay_factor", decay_factor)
    epsilon = check_hyperparameter("epsilon", epsilon)
    norm_coefficient = check_hyperparameter("norm_coefficient", norm_coefficient)
    R, T, (X, G, H) = _prepare(R, T, inputs, 3, ("X", "G", "H"))
    coef = adagrad_coefficients(R, T, decay_factor=decay_factor)
    X = [x.clone() for x in X]
    H = [h.clone() for h in H]
    for x, g, h in zip(X, G, H):
        adagrad_(x, g, h, epsilon=epsilon, norm_coefficient=norm_coefficient, **coef)
    return (*X, *H)


def momentum(R, T, *inputs: torch.Tensor, alpha: float, beta: float, mode: str, norm_coefficient: float):
    """ONNX ``Momentum-1``: ``momentum(R, T, X..., G..., V...) -> (X_new..., V_new...)``.

    ``V_new = alpha * V + (beta if T > 0 else 1) * G_reg``; standard:
    ``X_new = X - R * V_new``; nesterov: ``X_new = X - R * (G_reg + alpha * V_new)``.
    Standard equals ``torch.optim.SGD(lr=R, momentum=alpha, dampening=1 - beta,
    weight_decay=norm_coefficient)``; nesterov with ``beta = 1`` equals
    ``SGD(..., nesterov=True, dampening=0)``.  All attributes are required, as in ONNX.
    """
    alpha = check_hyperparameter("alpha", alpha)
    beta = check_hyperparameter("beta", beta)
    norm_coefficient = check_hyperparameter("norm_coefficient", norm_coefficient)
    if mode not in MOMENTUM_MODES:
        raise ValueError(f"mode must be 'standard' or 'nesterov', got {mode!r}")
    R, T, (X, G, V) = _prepare(R, T, inputs, 3, ("X", "G", "V"))
    coef = momentum_coefficients(R, T, beta=beta)
    X = [x.clone() for x in X]
    V = [v.clone() for v in V]
    for x, g, v in zip(X, G, V):
        momentum_(x, g, v, alpha=alpha, nesterov=mode == "nesterov", norm_coefficient=norm_coefficient, **coef)
    return (*X, *V)


def adam(
    R,
    T,
    *inputs: torch.Tensor,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
):
    """ONNX ``Adam-1``: ``adam(R, T, X..., G..., V..., H...) -> (X_new..., V_new..., H_new...)``.

    See the module docstring for the formula.  Epsilon is added to the
    uncorrected ``sqrt(H_new)``: this equals ``torch.optim.Adam`` (T from 1)
    only when ``epsilon == 0``.
    """
    alpha = check_hyperparameter("alpha", alpha)
    beta = check_hyperparameter("beta", beta)
    epsilon = check_hyperparameter("epsilon", epsilon)
    norm_coefficient = check_hyperparameter("norm_coefficient", norm_coefficient)
    norm_coefficient_post = check_hyperparameter("norm_coefficient_post", norm_coefficient_post)
    R, T, (X, G, V, H) = _prepare(R, T, inputs, 4, ("X", "G", "V", "H"))
    coef = adam_coefficients(R, T, alpha=alpha, beta=beta)
    X = [x.clone() for x in X]
    V = [v.clone() for v in V]
    H = [h.clone() for h in H]
    for x, g, v, h in zip(X, G, V, H):
        adam_(
            x, g, v, h, alpha=alpha, beta=beta, epsilon=epsilon,
            norm_coefficient=norm_coefficient, norm_coefficient_post=norm_coefficient_post, **coef,
        )
    return (*X, *V, *H)


def dml_adam(X, M, V, G, T, *, learning_rate: float, beta1: float, beta2: float, epsilon: float):
    """DirectML ``DML_OPERATOR_ADAM_OPTIMIZER``: returns ``(X, M, V)`` updated.

    Argument order follows ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` (parameters,
    first moment, second moment, gradient, training step).  At ``T = 0``
    DirectML's ``Alpha`` is ``0/0``: the result is NaN, faithfully (our
    optimizers start at T = 1; the validator warns on 0).  Epsilon placement
    differs from ``torch.optim.Adam`` (see the module docstring).
    """
    learning_rate = check_hyperparameter("learning_rate", learning_rate)
    beta1 = check_hyperparameter("beta1", beta1, low=0.0, high=1.0)
    beta2 = check_hyperparameter("beta2", beta2, low=0.0, high=1.0)
    epsilon = check_hyperparameter("epsilon", epsilon)
    T = _scalar("T", T, integer=True)
    (x,), (m,), (v,), (g,) = _split((X, M, V, G), 4, ("X", "M", "V", "G"))
    coef = dml_adam_coefficients(learning_rate, T, beta1=beta1, beta2=beta2)
    x, m, v = x.clone(), m.clone(), v.clone()
    adam_(x, g, m, v, alpha=beta1, beta=beta2, epsilon=epsilon, **coef)
    return x, m, v
