"""Kahan-compensated low-precision parameters (``kahan=True``).

The parameters stay FP16 (or BF16) and a compensation buffer of the same dtype
carries what each rounding lost (2 bytes per parameter, against master
weights' 4).  Reference: the same run in FP32 (and in float64 for the
synthetic stream).  Plain FP16 parameters lose every update smaller than half
an ULP; Kahan summation keeps them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dml_optim
from dml_optim.optimizers.registry import NAMES, build

LOW = [torch.float16, torch.bfloat16]


#: learning rates that move every parameter by ~1e-4 per step (well under half an FP16 ULP near 1)
_LR = {"adam": 1e-4, "dml-adam": 1e-4, "adamw": 1e-4, "adagrad": 2e-3, "momentum": 1e-4, "sgd": 1e-4, "lion": 1e-4}


def _run(name, dtype, steps, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    init = torch.rand(512, generator=gen) * 0.5 + 1.0  # values in [1, 1.5): an FP16 ULP is ~1e-3
    p = torch.nn.Parameter(init.to(dtype))
    hyper = dict(lr=_LR[name]) if name != "momentum" else dict(lr=_LR[name], alpha=0.0)
    opt = build(name, [p], state_dtype=torch.float32, **hyper, **kw) if kw.get("kahan") or kw.get("master_weights") \
        else build(name, [p], state_dtype=torch.float32, compute_dtype=torch.float32, **hyper, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):  # a steady drift (every update the same sign) plus noise
        p.grad = (1.0 + 0.1 * torch.randn(512, generator=gen)).to(dtype)
        opt.step()
    return p.detach().float(), opt


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_kahan_tracks_float32_far_better_than_plain_low_precision(name, dtype):
    """600 steps of ~1e-4 each on values in [1, 1.5) (FP16 ULP 1e-3, BF16 8e-3): plain low-precision
    parameters drop every update; with Kahan the result is the FP32 run rounded once."""
    if name == "dml-adam" and dtype == torch.bfloat16:
        pytest.skip("DmlAdam refuses bfloat16: DirectML's ADAM_OPTIMIZER has no BF16 (tested in test_optimizers)")
    ref, _ = _run(name, torch.float32, 600)
    plain, _ = _run(name, dtype, 600)
    kahan, _ = _run(name, dtype, 600, kahan=True)
    err_plain = (plain - ref).abs().max().item()
    err_kahan = (kahan - ref).abs().max().item()
    ulp = torch.finfo(dtype).eps  # values are in [0.5, 2): one ULP is at most 2 * eps
    assert err_kahan <= ulp, (err_kahan, ulp)  # observed: 0.7-0.97 ULP (x + c is exact; x alone is rounded)
    assert err_plain > 4 * ulp, (err_plain, ulp)  # observed: 8-100 ULPs (the whole drift was lost)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_kahan_equals_master_weights_after_the_final_rounding(dtype):
    kahan, _ = _run("adam", dtype, 200, kahan=True)
    master, _ = _run("adam", dtype, 200, master_weights=True)
    ulp = torch.finfo(dtype).eps
    assert (kahan - master).abs().max().item() <= 2 * ulp  # observed: identical or one ULP apart


def test_compensation_is_state_that_checkpoints_carry():
    p1, opt = _run("adamw", torch.float16, 50, kahan=True)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "kahan_comp"}
    assert sd["state"][0]["kahan_comp"].dtype == torch.float16
    assert sd["state"][0]["kahan_comp"].abs().max() > 0  # something was carried
    q = torch.nn.Parameter(opt.param_groups[0]["params"][0].detach().clone())
    opt2 = dml_optim.AdamW([q], lr=1e-4, state_dtype=torch.float32, kahan=True)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state_dict()["state"][0]["kahan_comp"], sd["state"][0]["kahan_comp"])


def test_kahan_memory_is_two_bytes_per_parameter():
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = dml_optim.Adam([p], kahan=True, state_dtype=torch.float16)
    p.grad = torch.zeros_like(p)
    opt.step()
    (info,) = opt.flat_buffers()
    assert info.master is None and info.kahan.dtype == torch.float16 and info.kahan.numel() == 1000


def test_kahan_refuses_float32_parameters_and_master_weights():
    with pytest.raises(ValueError, match="kahan=True needs float16 or bfloat16 parameters"):
        dml_optim.Adam([torch.nn.Parameter(torch.zeros(3))], kahan=True)
    with pytest.raises(ValueError, match="alternatives"):
        dml_optim.Adam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], kahan=True, master_weights=True)
    with pytest.raises(ValueError, match="wider compute dtype"):
        dml_optim.Adam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], kahan=True,
                       compute_dtype=torch.float16)


@given(st.lists(st.floats(min_value=-1e-3, max_value=1e-3, allow_nan=False, allow_subnormal=False),
                min_size=1, max_size=200),
       st.floats(min_value=0.25, max_value=4.0))
def test_kahan_sum_of_a_synthetic_stream_is_within_one_rounding(updates, start):
    """Property: after any stream of updates u_t (applied with SGD, lr 1, no momentum), the FP16
    parameter with Kahan compensation is within one FP16 ULP (plus what FP32 arithmetic loses) of
    the exact float64 sum start + sum(u_t), rounded to FP16; without compensation the error grows
    with the number of small updates."""
    p = torch.nn.Parameter(torch.tensor([start], dtype=torch.float16))
    opt = dml_optim.Momentum([p], lr=1.0, alpha=0.0, kahan=True)
    exact = float(torch.tensor(start, dtype=torch.float16))
    for u in updates:
        p.grad = torch.tensor([-u], dtype=torch.float16)  # x -= lr * g
        exact += float(torch.tensor(u, dtype=torch.float16))  # the update as FP16 hands it over
        opt.step()
    ulp = abs(exact) * 2.0**-10 + 2.0**-24  # FP16: 10 fraction bits
    fp32_loss = len(updates) * abs(exact) * 2.0**-23  # each FP32 add rounds
    assert abs(float(p.detach()) - exact) <= ulp + fp32_loss
