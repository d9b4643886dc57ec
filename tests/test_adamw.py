"""dml_optim.AdamW against torch.optim.AdamW: the same signature, defaults, update and checkpoints.

Oracle: torch.optim.AdamW itself (``foreach=False``: the single-tensor reference
implementation), over 50 steps, float64 and float32, two param groups with
different hyperparameters, weight decay on, AMSGrad on and off, maximize, and a
learning-rate scheduler.  ``weight_decay=0`` must equal torch.optim.Adam.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import dml_optim
from dml_optim.audit import audit_step
from tolerances import assert_close

SHAPES = [(6, 5), (5,), (3, 2, 2)]


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def _groups(params, **second):
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def _feed(pairs, gen, dtype):
    for p, q in pairs:
        g = torch.randn(p.shape, generator=gen, dtype=dtype)
        p.grad, q.grad = g.clone(), g.clone()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_matches_torch_adamw_every_step(dtype, amsgrad, maximize):
    ours_p, ref_p = _params(dtype), _params(dtype)
    second = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    ours = dml_optim.AdamW(_groups(ours_p, **second), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    ref = torch.optim.AdamW(_groups(ref_p, **second), lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize,
                            foreach=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) for o in (ours, ref)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        _feed(zip(ours_p, ref_p), gen, dtype)
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
        for p, q in zip(ours_p, ref_p):
            assert_close(p.detach(), q.detach())  # observed: 1.7e-16 (float64), 1.2e-7 (float32)
    sd, rsd = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in rsd:
        assert set(sd[i]) == set(rsd[i])  # exp_avg, exp_avg_sq (+ max_exp_avg_sq), step
        for key in rsd[i]:
            assert_close(sd[i][key].to(dtype), rsd[i][key].to(dtype))


def test_weight_decay_zero_is_torch_adam():
    ours_p, ref_p = _params(torch.float64), _params(torch.float64)
    ours = dml_optim.AdamW(ours_p, lr=1e-2, weight_decay=0.0)
    ref = torch.optim.Adam(ref_p, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        _feed(zip(ours_p, ref_p), gen, torch.float64)
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        assert_close(p.detach(), q.detach())


def test_signature_and_defaults_are_torchs():
    ours, theirs = inspect.signature(dml_optim.AdamW), inspect.signature(torch.optim.AdamW)
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                 "differentiable", "fused"):
        assert name in ours.parameters
        assert ours.parameters[name].default == theirs.parameters[name].default, name
        assert ours.parameters[name].kind == theirs.parameters[name].kind, name
    positional = [n for n, p in ours.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional[:6] == [n for n, p in theirs.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD][:6]
    p = _params(torch.float32)
    group = dml_optim.AdamW(p).param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8 and group["weight_decay"] == 1e-2


def test_differentiable_is_refused_and_foreach_fused_accepted():
    p = _params(torch.float32)
    with pytest.raises(TypeError, match="differentiable=True"):
        dml_optim.AdamW(p, differentiable=True)
    for kw in (dict(foreach=True), dict(fused=True), dict(foreach=False, fused=False)):
        dml_optim.AdamW(_params(torch.float32), **kw)
    with pytest.raises(TypeError, match="fused"):
        dml_optim.AdamW(_params(torch.float32), fused="yes")


@pytest.mark.parametrize("amsgrad", [False, True])
def test_checkpoints_move_both_ways_with_torch_adamw(amsgrad):
    """Train with one, continue with the other: the trajectory is torch's uninterrupted one."""
    def run(first, second, steps=(4, 4)):
        params = _params(torch.float64)
        opt = first(params)
        gen = torch.Generator().manual_seed(3)
        twin = _params(torch.float64)
        for _ in range(steps[0]):
            _feed(zip(params, twin), gen, torch.float64)
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        opt2 = second(params)
        opt2.load_state_dict(sd)
        for _ in range(steps[1]):
            _feed(zip(params, twin), gen, torch.float64)
            opt2.step()
        return params

    ours = lambda ps: dml_optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)  # noqa: E731
    torchs = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)  # noqa: E731
    reference = run(torchs, torchs)
    for a, b in ((ours, torchs), (torchs, ours), (ours, ours)):
        for p, q in zip(run(a, b), reference):
            assert_close(p.detach(), q.detach())


def test_torch_adam_checkpoint_with_l2_decay_is_refused_and_without_loads():
    p = _params(torch.float64)
    adam = torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)
    for q in p:
        q.grad = torch.ones_like(q)
    adam.step()
    sd = adam.state_dict()
    sd["param_groups"][0]["decoupled_weight_decay"] = False  # what torch >= 2.7 writes for Adam
    opt = dml_optim.AdamW(_params(torch.float64), weight_decay=0.1)
    with pytest.raises(ValueError, match="L2 term"):
        opt.load_state_dict(sd)
    sd["param_groups"][0]["weight_decay"] = 0.0  # then Adam and AdamW are the same rule
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("amsgrad", [False, True])
def test_step_is_flat_native_and_at_most_12_ops(amsgrad):
    """Every op native on DirectML (no lerp, no _foreach_*), no host sync, no allocation, <= 12 ops."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 32), (32,), (10, 64)]]
    opt = dml_optim.AdamW(params, lr=1e-3, amsgrad=amsgrad, maximize=True, backend="eager")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step packs gradients and allocates states
    report = audit_step(opt)
    assert report.total_ops <= 12, report.ops
    assert report.fallbacks == [] and report.all_native, report.non_native()
    assert report.host_syncs == 0 and report.allocations == 0
    assert report.flat_buffers == 1


def test_float16_with_master_weights_and_loss_scaling_tracks_float32():
    torch.manual_seed(0)
    init = [torch.randn(s).half() for s in SHAPES]
    runs = {}
    for name, dtype, kw in (("fp32", torch.float32, {}), ("fp16-master", torch.float16, dict(master_weights=True))):
        params = [torch.nn.Parameter(t.to(dtype)) for t in init]
        opt = dml_optim.AdamW(params, lr=1e-2, **kw)
        scaler = dml_optim.DynamicLossScaler(init_scale=2.0**10)
        gen = torch.Generator().manual_seed(4)
        for _ in range(20):
            grads = [torch.randn(p.shape, generator=gen).mul_(1e-2).half() for p in params]  # FP16-representable
            loss = sum((p * g.to(dtype)).sum() for p, g in zip(params, grads))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        runs[name] = [p.detach().float() for p in params]
    for a, b in zip(runs["fp16-master"], runs["fp32"]):
        assert torch.equal(a, b.half().float())  # the FP16 parameters are the FP32 run, rounded


def test_registry_and_torch_twin():
    from dml_optim.optimizers.registry import build, torch_equivalent

    opt = build("adamw", _params(torch.float32), lr=2e-3, beta1=0.8, weight_decay=0.2)
    assert isinstance(opt, dml_optim.AdamW) and opt.param_groups[0]["betas"] == (0.8, 0.999)
    twin = torch_equivalent("adamw", _params(torch.float32), exact=True, lr=2e-3, beta1=0.8, amsgrad=True)
    assert isinstance(twin, torch.optim.AdamW)
    g = twin.param_groups[0]
    assert g["betas"] == (0.8, 0.999) and g["amsgrad"] is True and g["eps"] == 1e-8 and g["weight_decay"] == 1e-2
