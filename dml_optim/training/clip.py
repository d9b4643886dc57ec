"""Gradient clipping over the flat gradient buffers: a fixed number of ops, whatever the model.

``torch.nn.utils.clip_grad_norm_`` on torch-directml runs one norm and one
multiply per parameter tensor (the plugin has no ``_foreach_norm`` kernel),
plus a ``stack``: ~320 dispatches for resnet50's 161 tensors.
:func:`clip_grad_norm_` computes the same total norm from the optimizer's
flat gradient buffers: a ``linalg_vector_norm`` per block of each buffer and
one over the blocks' (as accurate as torch's norm of per-tensor norms), a
handful of ops to combine them, one multiply per buffer, all DirectML-native, no host
sync (unless ``error_if_nonfinite``).
"""

from __future__ import annotations

import torch

from dml_optim.core.functional import check_hyperparameter

__all__ = ["clip_grad_norm_", "NORM_BLOCK"]

#: A flat gradient buffer's norm is taken in blocks of this many elements, then over the blocks' norms: one
#: float32 reduction over a whole model's buffer loses what small gradients add after large ones (16.7M
#: N(0, 1) gradients, 2 cores: 6.5e-4 relative, where torch's norm of per-tensor norms is 1.2e-6).
NORM_BLOCK = 1 << 12


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of a flat gradient buffer: the norm of its blocks' norms (:data:`NORM_BLOCK` elements
    each, the elements after the last whole block one more part: 2 or 4 ops whatever the size; ``inf`` has no
    rounding to lose: one)."""
    rows = grad.numel() // NORM_BLOCK
    if rows < 2 or norm_type == float("inf"):
        return torch.linalg.vector_norm(grad, norm_type)
    cut = rows * NORM_BLOCK
    parts = torch.linalg.vector_norm(grad[:cut].view(rows, NORM_BLOCK), norm_type, dim=1)
    if cut < grad.numel():  # (its own norm: small elements after large blocks are not lost beside them)
        parts = torch.cat([parts, torch.linalg.vector_norm(grad[cut:], norm_type).reshape(1)])
    return torch.linalg.vector_norm(parts, norm_type)


@torch.no_grad()
def clip_grad_norm_(optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``optimizer``'s parameters to a total norm of ``max_norm``; return the norm.

    The same result as ``torch.nn.utils.clip_grad_norm_(params, max_norm,
    norm_type, error_if_nonfinite)`` over the optimizer's parameters that have
    gradients: the total norm is the ``norm_type``-norm of all gradients
    together (``inf``: the largest magnitude), returned as a 0-d tensor on the
    device of the first buffer; if it exceeds ``max_norm`` every gradient is
    scaled by ``max_norm / (total_norm + 1e-6)``.  Call it after unscaling
    (``GradScaler.unscale_`` or ``DynamicLossScaler.unscale_``) and before the
    step.  Parameters without a gradient are left out, as in torch.

    Args:
        optimizer: a dml_optim optimizer.
        max_norm: the largest total norm allowed (>= 0).
        norm_type: the p of the p-norm (> 0, or ``inf``).
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is inf or
            NaN (one host sync), instead of scaling by it.
    """
    from dml_optim.optimizers.base import FlatOptimizer

    if not isinstance(optimizer, FlatOptimizer):
        raise TypeError(f"optimizer must be a dml_optim optimizer (it clips its flat gradient buffers), got "
                        f"{type(optimizer).__name__}; use torch.nn.utils.clip_grad_norm_ for others")
    max_norm = check_hyperparameter("max_norm", max_norm, low=0.0)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not (norm_type > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    flats = [flat for _, flat in optimizer._prepare()]
    if not flats:
        return torch.tensor(0.0)
    device = flats[0].device
    norms = [_norm(flat.grad, norm_type) for flat in flats]
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           "clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for flat in flats:
        flat.grad.mul_(coef.to(flat.device, flat.grad.dtype))
        flat.write_back()  # (gradients the caller holds: clipped where they are too)
    return total

