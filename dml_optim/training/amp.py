"""Dynamic loss scaling on the device: no host sync, no CPU fallback.

FP16 gradients underflow: every ``|g|`` below 2**-24 ≈ 5.96e-8 becomes 0.
Loss scaling multiplies the loss (hence every gradient) by a large factor
``S`` before ``backward()`` and divides the gradients by ``S`` before the
update; ``S`` is adapted so that gradients use FP16's range without
overflowing.  Two ways to use it with ``dml_optim`` optimizers:

* :class:`DynamicLossScaler` (the fully DirectML-native path)::

      scaler = DynamicLossScaler()
      for x, y in data:
          opt.zero_grad()
          scaler.scale(loss_fn(model(x), y)).backward()
          scaler.step(opt)      # unscale + inf/NaN check + gated step, on the device
          scaler.update()       # growth/backoff rule, on the device

* ``torch.amp.GradScaler``, unchanged.  With float32 gradients GradScaler
  does its own unscaling (one native foreach kernel on CUDA and the CPU) and
  calls ``step()`` only when nothing overflowed, as for any torch.optim
  optimizer; frameworks rely on that (Lightning's mixed precision with
  ``gradient_clip_val``); bfloat16 gradients take the same path.  With
  float16 gradients (FP16 parameters, e.g. ``master_weights=True``), whose
  unscaling GradScaler refuses, our optimizers set
  ``_step_supports_amp_scaling`` and GradScaler hands over
  ``grad_scale``/``found_inf``: the unscale and the gated skip then run in
  our step, on the device, with no host sync.

  On DirectML, GradScaler's inf check (``_amp_foreach_non_finite_check_and_unscale_``)
  and its ``update()`` (``_amp_update_scale_``) have no DirectML kernel and run
  on the CPU whatever the optimizer does: use :class:`DynamicLossScaler` there
  (everything native, no host sync).

With either, the skip is exact: on overflow, parameters, optimizer states
and step counters stay bit-for-bit as they were
(:meth:`dml_optim.FlatOptimizer.step_scaled`).

Scale rule (``torch._amp_update_scale_``'s, computed here with ``gt``,
``ge``, ``lt``, ``add``, ``mul`` and ``where``, all DirectML-native)::

    if found_inf:   scale *= backoff_factor;  tracker = 0
    else:           tracker += 1
                    if tracker == growth_interval:
                        if isfinite(scale * growth_factor): scale *= growth_factor
                        tracker = 0
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["DynamicLossScaler"]

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_args(init_scale, growth_factor, backoff_factor, growth_interval) -> tuple[float, float, float, int]:
    init_scale = _real("init_scale", init_scale)
    if init_scale <= 0:
        raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
    growth_factor = _real("growth_factor", growth_factor)
    if growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
    backoff_factor = _real("backoff_factor", backoff_factor)
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral):
        raise TypeError(f"growth_interval must be an int, got {growth_interval!r} ({type(growth_interval).__name__})")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}")
    return init_scale, growth_factor, backoff_factor, int(growth_interval)


class DynamicLossScaler:
    """A loss scaler whose whole loop runs on the device (no host sync).

    Arguments and their meaning are ``torch.amp.GradScaler``'s:

    Args:
        init_scale: initial scale ``S`` (> 0; default ``2**16``).
        growth_factor: ``S`` is multiplied by it after ``growth_interval``
            consecutive steps without inf/NaN gradients (> 1).
        backoff_factor: ``S`` is multiplied by it after a step with inf/NaN
            gradients, which is skipped (in (0, 1)).
        growth_interval: number of clean steps before growing (>= 1).
        device: where ``S`` lives; by default the device of the first loss
            passed to :meth:`scale`.

    Per iteration: :meth:`scale` the loss, ``backward()``, :meth:`step` each
    optimizer (a ``dml_optim`` optimizer: it needs ``step_scaled``), then
    :meth:`update` once.  With the step inside backward
    (``dml_optim.step_in_backward(optimizer, scaler=scaler)``) each run of
    parameters is unscaled, checked and stepped during ``backward()``, and
    :meth:`step` has nothing left to do: :meth:`scale`, ``backward()``,
    :meth:`update`.  Only :meth:`get_scale` and :meth:`state_dict` read a
    value back to the host (a sync); everything else is queued on the device.
    ``state_dict()`` has ``torch.amp.GradScaler``'s layout, so checkpoints
    move between the two.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str | None = None,
    ):
        init_scale, growth_factor, backoff_factor, growth_interval = _check_args(
            init_scale, growth_factor, backoff_factor, growth_interval)
        self._init_scale = init_scale
        self._init_tracker = 0
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._inv_scale: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        self._stepped: set[int] = set()
        self._unscaled: dict[int, torch.Tensor] = {}
        self._in_backward: dict[int, torch.Tensor] = {}  # optimizers stepped inside backward: their found_inf
        if device is not None:
            self._lazy_init(torch.device(device))

    # -- device state ------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self._scale = torch.full((), self._init_scale, **f32)
        self._growth_tracker = torch.full((), self._init_tracker, dtype=torch.int32, device=device)
        self._inv_scale = torch.reciprocal(self._scale)
        # constants of the update rule, made once (where.self needs tensor operands)
        self._zero_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._factors = {
            "one": torch.ones((), **f32),
            "growth": torch.full((), self._growth_factor, **f32),
            "backoff": torch.full((), self._backoff_factor, **f32),
        }

    @property
    def device(self) -> torch.device | None:
        """The device the scale lives on (None until the first :meth:`scale`)."""
        return None if self._scale is None else self._scale.device

    # -- the loop ------------------------------------------------------------------

    def scale(self, outputs):
        """``outputs * S`` for a tensor, or for each tensor of a list/tuple."""
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale: outputs must be a Tensor or a list/tuple of Tensors, got {type(outputs).__name__}")

    def step(self, optimizer) -> torch.Tensor:
        """Unscale, check and step ``optimizer`` on the device; returns ``found_inf``.

        ``found_inf`` is a 0-d float32 device tensor (1.0: the step was skipped
        because a gradient was inf/NaN, 0.0: it was taken); reading it is a
        host sync, so the training loop normally doesn't.
        """
        step_scaled = getattr(optimizer, "step_scaled", None)
        if step_scaled is None:
            raise TypeError(
                f"DynamicLossScaler.step: optimizer must be a dml_optim optimizer (it calls step_scaled), "
                f"got {type(optimizer).__name__}; use torch.amp.GradScaler for other optimizers"
            )
        if self._scale is None:
            raise RuntimeError("DynamicLossScaler.step() was called before scale(loss): the gradients are not scaled")
        if id(optimizer) in self._in_backward:  # stepped inside backward, run by run: nothing left to step
            return self._in_backward[id(optimizer)]
        if id(optimizer) in self._stepped:
            raise RuntimeError("DynamicLossScaler.step() was already called for this optimizer since the last update()")
        unscaled = self._unscaled.pop(id(optimizer), None)
        if unscaled is None:
            found_inf = step_scaled(self._inv_scale)
        else:  # unscale_() ran first: the gradients are already unscaled and checked
            found_inf = step_scaled(None, found_inf=unscaled)
        found_inf = found_inf.to(self._scale.device)
        self._found_inf = found_inf if self._found_inf is None else self._found_inf + found_inf
        self._stepped.add(id(optimizer))
        # (the optimizer stepped, through step_scaled: torch's LRScheduler reads this flag, set by the step() it
        # wraps, to warn when scheduler.step() comes first)
        optimizer._opt_called = True
        return found_inf

    def unscale_(self, optimizer) -> torch.Tensor:
        """Unscale ``optimizer``'s gradients in place now (e.g. to clip them), on the device.

        Returns ``found_inf`` like :meth:`step`; the following :meth:`step` then
        neither unscales nor checks again.  At most once per optimizer per
        iteration.
        """
        unscale = getattr(optimizer, "unscale_", None)
        if unscale is None or getattr(optimizer, "step_scaled", None) is None:
            raise TypeError(
                f"DynamicLossScaler.unscale_: optimizer must be a dml_optim optimizer, got {type(optimizer).__name__}"
            )
        if self._scale is None:
            raise RuntimeError("DynamicLossScaler.unscale_() was called before scale(loss): the gradients are not scaled")
        if id(optimizer) in self._unscaled or id(optimizer) in self._stepped:
            raise RuntimeError("DynamicLossScaler.unscale_() was already called (or step()) for this optimizer since the last update()")
        found_inf = unscale(self._inv_scale)
        self._unscaled[id(optimizer)] = found_inf
        return found_inf

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the growth/backoff rule (on the device), or set ``new_scale``."""
        if self._scale is None:
            raise RuntimeError("DynamicLossScaler.update() was called before scale(loss)")
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            if self._found_inf is None:
                raise RuntimeError("DynamicLossScaler.update() was called before any step(optimizer) since the last update() "
                                   "(or any backward of an optimizer stepping inside backward)")
            self._apply_rule(self._found_inf)
        torch.reciprocal(self._scale, out=self._inv_scale)
        self._found_inf = None
        self._stepped.clear()
        self._unscaled.clear()
        self._in_backward.clear()

    # -- the step inside backward ------------------------------------------------------------------

    def inverse_scale(self) -> torch.Tensor:
        """``1 / S`` as a 0-d float32 tensor on the device, updated in place by :meth:`update` (the step inside
        backward reads it for every run: :func:`dml_optim.step_in_backward` with ``scaler=``)."""
        if self._inv_scale is None:
            raise RuntimeError("DynamicLossScaler: scale(loss) comes before backward(): the scale is made there")
        return self._inv_scale

    def record_step(self, optimizer, found_inf: torch.Tensor) -> None:
        """Count ``optimizer`` as stepped in this iteration with ``found_inf`` (0-d float32 on the device: how
        many of its runs skipped an inf or NaN gradient) by the step inside backward, so that :meth:`update`
        backs the scale off when any did; :meth:`step` then steps nothing and returns it.  No host sync."""
        found = found_inf.to(self._scale.device, torch.float32)
        previous = self._in_backward.get(id(optimizer))
        self._in_backward[id(optimizer)] = found if previous is None else previous + found
        self._found_inf = found if self._found_inf is None else self._found_inf + found

    def _set_scale(self, new_scale) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1:
                raise ValueError(f"update: new_scale must be a 1-element tensor, got shape {tuple(new_scale.shape)}")
            self._scale.copy_(new_scale.reshape(()))
            return
        value = _real("new_scale", new_scale)
        if value <= 0:
            raise ValueError(f"update: new_scale must be > 0, got {value!r}")
        self._scale.fill_(value)

    def _apply_rule(self, found_inf: torch.Tensor) -> None:
        """``torch._amp_update_scale_``'s rule with native ops (gt, add, ge, where, mul, lt, copy_)."""
        c = self._factors
        found = found_inf > 0
        tracker = torch.where(found, self._zero_tracker, self._growth_tracker + 1)
        grow = tracker >= self._growth_interval
        tracker = torch.where(grow, self._zero_tracker, tracker)
        factor = torch.where(found, c["backoff"], torch.where(grow, c["growth"], c["one"]))
        new_scale = self._scale * factor
        self._scale.copy_(torch.where(new_scale < math.inf, new_scale, self._scale))
        self._growth_tracker.copy_(tracker)

    # -- inspection and checkpoints -------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float.  **Host sync** (reads the device)."""
        return self._init_scale if self._scale is None else float(self._scale.item())

    def state_dict(self) -> dict[str, Any]:
        """``torch.amp.GradScaler``'s layout. **Host sync** (reads scale and tracker)."""
        tracker = self._init_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.amp.GradScaler`` (validated first)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"load_state_dict: missing keys {missing}")
        scale, growth, backoff, interval = _check_args(
            state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, numbers.Integral) or tracker < 0:
            raise ValueError(f"load_state_dict: _growth_tracker must be an int >= 0, got {tracker!r}")
        self._init_scale, self._init_tracker = scale, int(tracker)
        self._growth_factor, self._backoff_factor, self._growth_interval = growth, backoff, interval
        if self._scale is not None:
            self._lazy_init(self._scale.device)
