"""accelerate's documented flow with our optimizers, against torch.optim in the same flow.

The documented order builds the optimizer on the model's parameters *before*
``accelerator.prepare(model, optimizer, dataloader)``; ``prepare`` may then move the model
(to the GPU) and mixed precision may wrap it.  Our optimizers pack the parameters into a flat
buffer at construction, so the step after ``prepare`` (or after ``model.half()``,
``.double()``, ``.to(...)``) must follow them to their new device and dtype.

Every test trains the same tiny MLP twice from the same weights and batches, once with ours
and once with its torch.optim twin (tests/_frameworks.py), through ``accelerator.backward``,
``accelerator.clip_grad_norm_`` (clipping active: the norms exceed the limit) and the prepared
optimizer (and scheduler), and compares the final parameters: Momentum bit for bit (on the CPU,
in float32/float64, with torch's fused SGD, which our default backend runs there; in
float16/bfloat16 with torch's default SGD), the Adam family to its tolerance.

On the CPU accelerate runs ``mixed_precision="bf16"`` with autocast, and ``"fp16"`` neither with
autocast nor with a GradScaler (``Accelerator.__init__``: fp16 is native only off the CPU).  The
fp16 flow (``backward`` scales, ``clip_grad_norm_`` unscales through ``GradScaler.unscale_``, the
prepared optimizer steps through ``scaler.step`` and reports ``step_was_skipped``, the prepared
scheduler does not step after a skipped step) is run on the CPU by giving the Accelerator what it
builds for fp16 on a GPU: ``native_amp`` (float16 autocast around ``forward``) and a CPU
``GradScaler``.  The plain ``mixed_precision="fp16"`` flag and the move to the GPU by ``prepare``
need CUDA and say so when skipped.  Gradient accumulation follows accelerate's documented loop
(``with accelerator.accumulate(model)``, clipping only when ``sync_gradients``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from _frameworks import BY_ID, PAIR_IDS, PAIRS, Pair, amp_future_warnings, moved, need, params_of, reset_accelerate
from _frameworks import fresh_accelerate  # noqa: F401 - the fixture, used through pytestmark

import dml_optim

need("accelerate")
from accelerate import Accelerator  # noqa: E402

CUDA = torch.cuda.is_available()
NO_CUDA = "needs CUDA: on the CPU accelerate runs fp16 without autocast or GradScaler and never moves the model"
LR = 0.05
CLIP = 0.5
EPOCHS = 2


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16)


def _trace(opt) -> tuple:
    group = opt.param_groups[0]
    return (group["lr"],) + tuple(group[k] for k in ("betas", "momentum") if k in group)


def _cpu_fp16(accelerator: Accelerator) -> None:
    """What ``Accelerator(mixed_precision="fp16")`` sets up on a GPU, on the CPU (before ``prepare``):
    ``native_amp`` (``prepare`` wraps ``forward`` in float16 autocast; ``clip_grad_norm_`` unscales)
    and a GradScaler (``backward`` scales the loss; the prepared optimizer steps through it)."""
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None  # what the CPU gives
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)


def _train(make, *, mixed_precision="no", cast=None, scheduler=None, device="cpu", cpu_fp16=False, overflow_at=None):
    """The documented flow; returns a dict: final parameters on the CPU, clip norms, (lr,
    betas/momentum) per step, which steps were skipped, the loss scale per step, the Accelerator."""
    model = _model()
    opt = make(model.parameters(), LR)  # before prepare (and before any cast)
    if cast is not None:
        cast(model)
    sched = scheduler(opt) if scheduler else None
    # the first Linear's output dtype: float16/bfloat16 under autocast (prepare converts the model's output to float32)
    out_dtypes = set()
    model[0].register_forward_hook(lambda module, args, out: out_dtypes.add(out.dtype))
    accelerator = Accelerator(mixed_precision="fp16" if cpu_fp16 else mixed_precision, cpu=device == "cpu")
    if cpu_fp16:
        _cpu_fp16(accelerator)
    prepared = accelerator.prepare(model, opt, _loader(), *([sched] if sched else []))
    model, opt, loader = prepared[:3]
    norms, trace, skipped, scales = [], [], [], []
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            x = x.to(next(model.parameters()).dtype)
            loss = F.cross_entropy(model(x).float(), y)
            if len(norms) == overflow_at:
                loss = loss * float("inf")
            accelerator.backward(loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            if sched is not None:
                prepared[3].step()
            trace.append(_trace(opt))
            skipped.append(opt.step_was_skipped)
            scales.append(accelerator.scaler.get_scale() if accelerator.scaler is not None else None)
    assert next(model.parameters()).device.type == device
    return dict(params=params_of(model), norms=norms, trace=trace, skipped=skipped, scales=scales,
                out_dtypes=out_dtypes, accelerator=accelerator)


def _same_norms(pair, norms, torch_norms, dtype=torch.float32):
    """The norms ``clip_grad_norm_`` returned: equal for an exact pair, else to the pair's tolerance
    (the parameters differ by ulps, so the gradients do)."""
    tol = dict(rtol=0, atol=0) if pair.exact else pair.tolerance(dtype)
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64), torch.tensor(torch_norms, dtype=torch.float64),
                               **tol, equal_nan=True)  # an overflowing step's norm is inf or nan for both


def _compare(pair, dtype=torch.float32, **kwargs):
    """Ours and torch's twin through the same flow: the same parameters, clip norms, schedule, skips."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _train(pair.ours, **kwargs)
    reset_accelerate()
    theirs = _train(pair.theirs, **kwargs)
    assert moved(params_of(_model()), ours["params"]), "the parameters never moved"
    assert max(n for n in ours["norms"] if math.isfinite(n)) > CLIP, f"clipping never engaged ({ours['norms']})"
    assert [p.dtype for p in ours["params"]] == [dtype] * len(ours["params"])
    pair.assert_same(ours["params"], theirs["params"], dtype)
    _same_norms(pair, ours["norms"], theirs["norms"], dtype)
    assert ours["skipped"] == theirs["skipped"] and ours["scales"] == theirs["scales"]
    assert not amp_future_warnings(caught)
    return ours, theirs


# -- the documented order, fp32 and mixed precision --------------------------------------------


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_documented_order_with_clipping_equals_torch(pair, mixed_precision):
    """``opt = dml_optim.X(model.parameters())`` then ``accelerator.prepare(model, opt, dl)``."""
    ours, _ = _compare(pair, mixed_precision=mixed_precision)
    assert ours["accelerator"].mixed_precision == mixed_precision
    assert ours["out_dtypes"] == {torch.bfloat16 if mixed_precision == "bf16" else torch.float32}  # autocast or not


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("mixed_precision", ["no", "fp16", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_prepare_moves_the_model_to_cuda_and_the_optimizer_follows(pair, mixed_precision):
    """Built on CPU parameters; ``prepare`` moves the model to the GPU; fp16 adds a GradScaler
    (native unscale in ``clip_grad_norm_``, then ``scaler.step``), which needs no FutureWarning."""
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    # Both optimizers are built on the CPU parameters: Momentum's twin is torch's fused SGD there
    # (what our CPU backend runs), and after the move it runs torch's fused CUDA kernel while ours
    # runs its CUDA step (eager or compiled): the same update, rounded differently, so the pair's
    # tolerance instead of bit equality.
    ours, _ = _compare(replace(pair, exact=False), mixed_precision=mixed_precision, device="cuda")
    assert (ours["accelerator"].scaler is not None) == (mixed_precision == "fp16")


OVERFLOW_AT = 2


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_fp16_flow_with_gradscaler_and_an_overflow_equals_torch(pair):
    """accelerate's fp16 flow (on the CPU, see the module docstring) with OneCycleLR at its
    defaults and one overflowing step: ``clip_grad_norm_`` unscales through GradScaler (float32
    gradients: ours leaves that to GradScaler), the overflow skips the step for ours as for torch,
    ``step_was_skipped`` says so, the prepared scheduler holds still on it, and the scale halves."""
    onecycle = SCHEDULERS["OneCycleLR"]
    ours, theirs = _compare(pair, cpu_fp16=True, overflow_at=OVERFLOW_AT, scheduler=onecycle)
    assert ours["out_dtypes"] == {torch.float16}  # the forward ran under float16 autocast
    assert ours["skipped"] == [i == OVERFLOW_AT for i in range(EPOCHS * 4)]
    assert ours["scales"][OVERFLOW_AT] == ours["scales"][OVERFLOW_AT - 1] / 2
    assert ours["trace"] == theirs["trace"] and ours["trace"][OVERFLOW_AT] == ours["trace"][OVERFLOW_AT - 1]
    opt = ours["accelerator"]._optimizers[0].optimizer
    assert opt._step_supports_amp_scaling is False
    assert opt.state_dict()["state"][0]["step"].item() == EPOCHS * 4 - 1


ACCUMULATE = 2


def _train_accumulating(make, set_to_none):
    """accelerate's documented gradient accumulation: ``with accelerator.accumulate(model)``, clip
    only when the gradients are synced; the prepared optimizer and scheduler step (and zero) only
    then.  Returns (final parameters, clip norms, lr/momentum per optimizer step, optimizer)."""
    model = _model()
    opt = make(model.parameters(), LR)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=EPOCHS * 4 // ACCUMULATE)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader, sched = accelerator.prepare(model, opt, _loader(), sched)
    norms, trace = [], []
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                sched.step()
                if accelerator.sync_gradients:
                    trace.append(_trace(opt))
                opt.zero_grad(**({} if set_to_none is None else {"set_to_none": set_to_none}))
    return params_of(model), norms, trace, opt.optimizer


@pytest.mark.parametrize("set_to_none", [None, False], ids=["zero_grad-default", "zero_grad-set_to_none-False"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_gradient_accumulation_with_clipping_equals_torch(pair, set_to_none):
    """Two micro-batches per step.  accelerate's ``zero_grad()`` defaults to ``set_to_none=True``
    (ours then gathers autograd's fresh gradients at each step); with ``False`` the gradients stay
    views of our flat buffer and accumulate there.  Either way: torch's result."""
    ours, norms, trace, opt = _train_accumulating(pair.ours, set_to_none)
    reset_accelerate()
    theirs, torch_norms, torch_trace, _ = _train_accumulating(pair.theirs, set_to_none)
    assert len(norms) == EPOCHS * 4 // ACCUMULATE and max(norms) > CLIP
    assert opt.state_dict()["state"][0]["step"].item() == EPOCHS * 4 // ACCUMULATE
    assert moved(params_of(_model()), ours)
    pair.assert_same(ours, theirs)
    _same_norms(pair, norms, torch_norms)
    assert trace == torch_trace and len({t[1] for t in trace}) > 1


# -- built, then cast, then prepared ------------------------------------------------------------

CASTS = {
    "double": (lambda m: m.double(), torch.float64),
    "to-float64": (lambda m: m.to(torch.float64), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
}
#: bfloat16 needs an epsilon it can hold (1e-8 is fine in bfloat16's range, but eps=0 gives 0/0 on
#: an underflowed second moment, for torch.optim as for us): AdamW with eps=1e-3 there.  Adam in
#: float16 is left out: its second moments of ordinary gradients (1e-3 squared) are float16
#: subnormals, where torch's order of operations and ours round differently (observed: one
#: element in 256 off by 15% after 8 steps); Momentum covers float16, bit for bit.
ADAMW_LOW = Pair("adamw-eps1e-3", lambda p, lr: dml_optim.AdamW(p, lr=lr, eps=1e-3, weight_decay=0.1),
                 lambda p, lr: torch.optim.AdamW(p, lr=lr, eps=1e-3, weight_decay=0.1))
#: DmlAdam takes float32/float16 only (DirectML's ADAM_OPTIMIZER), so it is not cast to float64.
#: Momentum's twin is chosen for the dtype the model is cast to (both optimizers are built on its
#: float32 parameters): torch's fused SGD for float64, as our default backend runs torch's fused
#: kernel there; torch's default SGD for float16/bfloat16, where ours runs its eager chain.
CAST_CASES = [("double", BY_ID["momentum"].stepping_in(torch.float64)), ("double", BY_ID["adam"]),
              ("double", BY_ID["adamw"]), ("to-float64", BY_ID["adam"]),
              ("half", BY_ID["momentum"].stepping_in(torch.float16)),
              ("bfloat16", BY_ID["momentum"].stepping_in(torch.bfloat16)), ("bfloat16", ADAMW_LOW)]


@pytest.mark.parametrize("cast,pair", CAST_CASES, ids=[f"{c}-{p.id}" for c, p in CAST_CASES])
def test_optimizer_built_before_a_cast_follows_the_model(cast, pair):
    """``model.half()``/``.double()``/``.to(dtype)`` after the optimizer exists, then accelerate:
    the first step re-packs the flat buffer in the new dtype (torch.optim simply sees the new
    ``p.data``); the two train alike."""
    fn, dtype = CASTS[cast]
    ours, _ = _compare(pair, dtype=dtype, cast=fn)
    assert all(torch.isfinite(p).all() for p in ours["params"])


def test_cast_is_followed_by_the_flat_buffer_itself():
    """Not only equal results: the buffer really is float64 now, and the gradients are its views."""
    model = _model()
    opt = dml_optim.Momentum(model.parameters(), lr=LR, alpha=0.9)
    model.double()
    accelerator = Accelerator(cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, _loader())
    x, y = next(iter(loader))
    opt.zero_grad(set_to_none=False)  # keep p.grad as views of the flat gradient buffer
    accelerator.backward(F.cross_entropy(model(x.double()), y))
    opt.step()
    (buffer,) = opt.optimizer.flat_buffers()
    assert buffer.data.dtype == torch.float64 and buffer.numel == sum(p.numel() for p in model.parameters())
    opt.zero_grad(set_to_none=False)
    accelerator.backward(F.cross_entropy(model(x.double()), y))
    grads = buffer.grad
    assert all(p.grad.untyped_storage().data_ptr() == grads.untyped_storage().data_ptr() for p in model.parameters())


# -- torch schedulers through accelerator.prepare --------------------------------------------------

SCHEDULERS = {
    # defaults, so cycle_momentum=True: they cycle betas[0] (Adam family) or momentum (SGD family)
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=EPOCHS * 4),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2),
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_schedulers_cycle_momentum_with_defaults(pair, scheduler):
    """OneCycleLR/CyclicLR with cycle_momentum=True (the default) drive lr and betas/momentum
    of ours exactly as of torch.optim, and the cycled momentum is the one the update uses."""
    ours, theirs = _compare(pair, scheduler=SCHEDULERS[scheduler])
    assert ours["trace"] == theirs["trace"]
    cycled = {t[1] for t in ours["trace"]}
    assert len(cycled) > 2, f"the scheduler did not cycle the momentum: {cycled}"


def test_adam_accepts_torch_keywords_and_refuses_eps_with_the_reason():
    """``dml_optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)`` is accepted (with
    epsilon=0 it is torch's Adam with the same keywords); ``eps=`` is refused, naming why."""
    model = _model()
    opt = dml_optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    group = opt.param_groups[0]
    assert (group["alpha"], group["beta"], group["norm_coefficient"]) == (0.9, 0.999, 0.01)
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.999), 0.01)
    with pytest.raises(TypeError, match="epsilon") as refused:
        dml_optim.Adam(_model().parameters(), lr=1e-3, eps=1e-8)
    assert "bias correction" in str(refused.value)

    def ours(params, lr):
        return dml_optim.Adam(params, lr=lr, betas=(0.8, 0.99), weight_decay=0.01, epsilon=0.0)

    def theirs(params, lr):
        return torch.optim.Adam(params, lr=lr, betas=(0.8, 0.99), weight_decay=0.01, eps=0.0)

    _compare(Pair("adam-torch-keywords", ours, theirs))
