"""The metrics of the precision harness: pure functions with known answers, and their definitions.

Each function is checked on hand-made values in ``tests/test_precision.py``;
:data:`METRICS` names what every result carries and :data:`DEFINITIONS`
states each in one line (the reports print them).  ``x`` is a configuration's
parameters, ``r`` the float64 reference's, at the final step unless stated:

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
  (``x_t == x_{t-1}``): updates smaller than half an ULP, rounded away (or,
  with master weights or Kahan, held back in the master copy or the
  compensation buffer).
* ``flushed_second_moment_fraction``: among the second-moment entries
  (``exp_avg_sq``, Adagrad's ``sum``; none for Momentum) that are nonzero in
  the reference, the fraction that are 0 in the configuration.
* ``grad_underflow_fraction``: gradient entries that are nonzero in the
  stream but 0 once stored in the configuration's dtype (all steps).
* ``final_loss``: the built-in model's cross-entropy on its training data with
  the configuration's parameters (evaluated in float32; recorded stream only).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "METRICS", "DEFINITIONS", "REL_ERROR_FLOOR", "CHUNK", "chunks", "smallest_subnormal", "relative_error",
    "ulp_distance", "lost_updates", "flushed_entries", "squared_norm",
]

#: Floor of the denominator of the element-wise relative error (FP16's smallest subnormal).
REL_ERROR_FLOOR = 2.0**-24
#: Elements per chunk when measuring (bounds temporary memory).
CHUNK = 1 << 22

#: Every metric a result carries (None where it does not apply).
METRICS = (
    "max_rel_error", "median_rel_error", "final_rel_error", "max_ulp", "nan_count", "inf_count",
    "first_nonfinite_step", "lost_update_fraction", "flushed_second_moment_fraction",
    "grad_underflow_fraction", "final_loss",
)

#: One line per metric, as the reports print them.
DEFINITIONS = {
    "rel_error_per_step": "||x - x_ref||_2 / ||x_ref||_2 over all parameters after each step (float64; NaN once a parameter is NaN)",
    "max_rel_error / median_rel_error": "of |x_i - x_ref_i| / max(|x_ref_i|, 2^-24) over all elements at the final step (NaN counts as inf)",
    "final_rel_error": "rel_error_per_step at the final step",
    "max_ulp": "largest distance in ULPs of the storage dtype between x_i and x_ref_i rounded to that dtype (NaN elements left out)",
    "nan_count / inf_count / first_nonfinite_step": "non-finite parameters at the end; first step (1-based) after which any parameter was non-finite",
    "lost_update_fraction": "over all steps and elements where the reference moved, the fraction where the parameter did not change",
    "flushed_second_moment_fraction": "among second-moment entries (exp_avg_sq, Adagrad's sum) nonzero in the reference, the fraction that are 0",
    "grad_underflow_fraction": "gradient entries nonzero in the stream but 0 in the storage dtype (all steps)",
    "final_loss": "cross-entropy of the built-in MLP on its training data with the configuration's parameters (recorded stream)",
}


def chunks(n: int):
    """Slices of ``range(n)`` of at most :data:`CHUNK` elements."""
    for a in range(0, n, CHUNK):
        yield slice(a, min(a + CHUNK, n))


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


def squared_norm(x: torch.Tensor, r: torch.Tensor | None = None) -> float:
    """``||x||_2**2``, or ``||x - r||_2**2``, in float64, chunk by chunk."""
    total = 0.0
    for s in chunks(x.numel()):
        d = x[s].double() if r is None else x[s].double() - r[s]
        total += float(torch.dot(d, d))
    return total
