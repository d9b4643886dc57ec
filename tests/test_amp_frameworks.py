"""``torch.amp.GradScaler`` driving our optimizers, against torch.optim, with every warning an error.

GradScaler has two paths (docs/design.md, §5, "AMP"):

* float32 gradients: ours reports ``_step_supports_amp_scaling = False``, so GradScaler unscales
  with its own kernels (``unscale_``, which frameworks call before clipping) and calls our
  ``step()`` only when nothing overflowed: the same path as for torch.optim, which must give the
  same parameters and the same scale trajectory (Momentum: bit for bit with torch's fused SGD, which
  our default backend runs on the CPU for float32 parameters, put on GradScaler's own path as ours
  is: tests/_frameworks.py, ``torch_twin``);
* float16 gradients (GradScaler refuses to unscale those itself): ours reports True and GradScaler
  hands over ``grad_scale``/``found_inf`` (its current protocol; the old ``step(grad_scaler=...)``
  keyword raises a FutureWarning every step).  torch.optim cannot take that path at all, so its
  twin gets the same scaled gradients, multiplied by ``1/scale`` by hand as our step does, and
  skips the steps that overflowed.  Our step is gated there, and the gated rule rounds its
  coefficients to float16 (``GATED_FLOAT16``); bit equality is the strict xfail below.

Each loop runs under ``warnings.simplefilter("error")``, so a FutureWarning (or any other) from a
step fails the test.  One step overflows on purpose (an infinite loss).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _frameworks import BY_ID, PAIR_IDS, PAIRS, Pair, moved, params_of, torch_twin

import dml_optim

pytestmark = pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"),
                                reason="torch.amp.GradScaler('cpu') needs torch >= 2.3")

STEPS = 8
OVERFLOW_AT = 3
INIT_SCALE = 2.0 ** 10
GROWTH_INTERVAL = 2


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).to(dtype)


def _batches(dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g).to(dtype), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]


def _loss(model, x, y, step):
    loss = F.cross_entropy(model(x).float(), y)
    return loss * float("inf") if step == OVERFLOW_AT else loss


def _with_gradscaler(make, dtype, *, unscale_and_clip=False):
    model = _model(dtype)
    opt = make(model.parameters(), 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, (x, y) in enumerate(_batches(dtype)):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y, step)).backward()
            if unscale_and_clip:  # what Lightning, accelerate and the Trainer do before clipping
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return params_of(model), scales, opt


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_float32_gradients_take_gradscalers_own_path_like_torch(pair, unscale_and_clip):
    ours, scales, opt = _with_gradscaler(pair.ours, torch.float32, unscale_and_clip=unscale_and_clip)
    theirs, torch_scales, _ = _with_gradscaler(pair.theirs, torch.float32, unscale_and_clip=unscale_and_clip)
    assert opt._step_supports_amp_scaling is False
    assert scales == torch_scales and scales[OVERFLOW_AT] < scales[OVERFLOW_AT - 1]  # the overflow halved it
    assert opt.state_dict()["state"][0]["step"].item() == STEPS - 1  # the overflowing step was skipped
    assert moved(params_of(_model(torch.float32)), ours)
    pair.assert_same(ours, theirs)


#: float16 and bfloat16 parameters.  Without a gate our float16/bfloat16 Momentum and Adagrad steps
#: are torch's SGD and Adagrad bit for bit (their default implementations: our default backend runs
#: torch's fused kernels for float32/float64 only, and ``torch_twin`` picks the default here).
#: Adam-family twins are left out in float16, whose second moments of ordinary gradients are
#: subnormal and round differently in the two orders of operations.
FP16_PAIRS = [
    BY_ID["momentum"],
    Pair("adagrad", lambda p, lr: dml_optim.Adagrad(p, lr=lr, epsilon=1e-3),
         lambda p, lr: torch_twin(torch.optim.Adagrad)(p, lr=lr, eps=1e-3), exact=True),
]
FP16_IDS = [p.id for p in FP16_PAIRS]

#: Our step under GradScaler's protocol is *gated* (it skips on ``found_inf`` without a host
#: sync), and the gated eager rule applies its per-step coefficients as 0-d tensors
#: (``addcmul_``/``mul_`` with a tensor operand), which torch casts to the parameters' dtype: lr
#: 0.05 becomes 0.04999 and momentum 0.9 becomes 0.8999 in float16, where the ungated step passes
#: Python floats and rounds once.  That flips the rounding of some updates.  Observed after 7
#: steps: Momentum 7.6e-6 (3 of 256 elements), Adagrad 4.9e-4 on weights of magnitude 0.3, i.e.
#: at most 2 float16 ulps; the bound is 4 ulps relative, 2 ulps at 0.25 absolute.  A missing or
#: doubled unscale, or a step taken on the overflow, moves the weights by 1e-2 or more.
GATED_FLOAT16 = dict(rtol=2.0 ** -8, atol=2.0 ** -11)


def _torch_twin_unscaled_by_hand(pair):
    """torch.optim cannot take GradScaler's float16 path: ``unscale_`` refuses float16 gradients,
    and torch's ``fused=True`` SGD, the one that takes ``grad_scale``/``found_inf``, is no reference
    on the CPU (in torch 2.13 its float16 result is off by up to 10 ulps after one step, from 16
    elements on, where its for-loop SGD rounds correctly).  The twin gets the same scaled
    gradients, multiplied by ``1/scale`` (the multiply our step does), skips the steps that
    overflowed and follows GradScaler's growth/backoff rule."""
    model = _model(torch.float16)
    twin = pair.theirs(model.parameters(), 0.05)
    scale, tracker, expected_scales = INIT_SCALE, 0, []
    for step, (x, y) in enumerate(_batches(torch.float16)):
        twin.zero_grad()
        (_loss(model, x, y, step) * scale).backward()
        grads = [p.grad for p in model.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            for g in grads:
                g.mul_(1.0 / scale)
            twin.step()
            tracker += 1
            if tracker == GROWTH_INTERVAL:  # GradScaler's rule: grow after GROWTH_INTERVAL good steps
                scale, tracker = scale * 2.0, 0
        else:  # skip the step, back off
            scale, tracker = scale * 0.5, 0
        expected_scales.append(scale)
    return params_of(model), expected_scales


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("pair", FP16_PAIRS, ids=FP16_IDS)
def test_bfloat16_gradients_take_gradscalers_own_path_like_torch(pair, unscale_and_clip):
    """GradScaler unscales bfloat16 gradients itself (it refuses only float16), so torch.optim runs
    under it; ours takes the same path (no in-step unscaling, so no gate) and equals it bit for bit,
    and ``unscale_`` + clipping (Lightning, accelerate) works as for torch.optim."""
    ours, scales, opt = _with_gradscaler(pair.ours, torch.bfloat16, unscale_and_clip=unscale_and_clip)
    theirs, torch_scales, _ = _with_gradscaler(pair.theirs, torch.bfloat16, unscale_and_clip=unscale_and_clip)
    assert opt._step_supports_amp_scaling is False
    assert scales == torch_scales and scales[OVERFLOW_AT] < scales[OVERFLOW_AT - 1]
    assert opt.state_dict()["state"][0]["step"].item() == STEPS - 1
    assert moved(params_of(_model(torch.bfloat16)), ours)
    pair.assert_same(ours, theirs, torch.bfloat16)


@pytest.mark.parametrize("pair", FP16_PAIRS, ids=FP16_IDS)
def test_float16_gradients_are_unscaled_in_our_step_without_a_warning(pair):
    """GradScaler hands ``grad_scale``/``found_inf`` to our step (no FutureWarning: the loop runs
    with warnings as errors); the overflowing step is skipped inside it, the scale follows
    GradScaler's rule, and the weights follow torch's twin to the gated step's rounding."""
    ours, scales, opt = _with_gradscaler(pair.ours, torch.float16)
    assert opt._step_supports_amp_scaling is True
    assert opt.state_dict()["state"][0]["step"].item() == STEPS - 1
    theirs, expected_scales = _torch_twin_unscaled_by_hand(pair)
    assert scales == expected_scales
    assert moved(params_of(_model(torch.float16)), ours)
    pair.assert_same(ours, theirs, torch.float16, tol=GATED_FLOAT16)


@pytest.mark.xfail(strict=True, reason="the gated step rounds its coefficients to float16 (see GATED_FLOAT16): "
                                       "a library fix in dml_optim/core/functional.py makes this pass; then drop the mark")
@pytest.mark.parametrize("pair", FP16_PAIRS, ids=FP16_IDS)
def test_float16_gradscaler_step_is_bit_identical_to_torch(pair):
    """What torch.optim's semantics give and our ungated float16 step already gives: bit equality."""
    ours, _, _ = _with_gradscaler(pair.ours, torch.float16)
    theirs, _ = _torch_twin_unscaled_by_hand(pair)
    pair.assert_same(ours, theirs, torch.float16)
