"""dml_optim.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the same parameters.

Same total norm (returned as a 0-d tensor on the device), same clipped
gradients, for norm types 2, 1 and inf, with zero, huge and non-finite
gradients; a number of ops that does not depend on the number of parameter
tensors; correct after unscaling (DynamicLossScaler, GradScaler) and around
skipped steps.
"""

from __future__ import annotations

import math

import pytest
import torch

import dml_optim
from dml_optim.core.opcount import count_ops
from tolerances import assert_close

NORMS = [2.0, 1.0, math.inf]


def _twins(shapes, scale=1.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        g = torch.randn(p.shape, generator=gen, dtype=dtype) * scale
        p.grad, q.grad = g.clone(), g.clone()
    return ours, ref


SHAPES = [(17, 5), (33,), (4, 3, 2), (1,)]


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("scale,max_norm", [(1.0, 1.0), (1.0, 1e6), (0.0, 1.0), (1e30, 1.0), (1e-30, 1e-40)],
                         ids=["clips", "no-clip", "zero", "huge", "tiny"])
def test_same_norm_and_gradients_as_torch(norm_type, scale, max_norm):
    ours, ref = _twins(SHAPES, scale)
    opt = dml_optim.Adam(ours)
    total = dml_optim.clip_grad_norm_(opt, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    assert total.dim() == 0 and total.device == ours[0].device
    assert_close(total, expected)
    for p, q in zip(ours, ref):
        assert_close(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_gradients_behave_like_torch(norm_type, bad):
    ours, ref = _twins(SHAPES)
    for ps in (ours, ref):
        ps[1].grad[3] = bad
    opt = dml_optim.Adam(ours)
    total = dml_optim.clip_grad_norm_(opt, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
    assert_close(total, expected, equal_nan=True)
    for p, q in zip(ours, ref):
        assert_close(p.grad, q.grad, equal_nan=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        dml_optim.clip_grad_norm_(opt, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type, error_if_nonfinite=True)


def test_parameters_without_gradients_are_left_out_as_in_torch():
    ours, ref = _twins(SHAPES)
    opt = dml_optim.Adam(ours)
    opt.step()  # gradients are now views of the flat buffer
    ours[1].grad = ref[1].grad = None  # its stale slot must not count
    total = dml_optim.clip_grad_norm_(opt, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert_close(total, expected)
    assert ours[1].grad is None


def test_two_buffers_and_two_groups():
    gen = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(8, generator=gen, dtype=dt)) for dt in (torch.float32, torch.float64)] * 1
    ours += [torch.nn.Parameter(torch.randn(5, generator=gen))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        p.grad, q.grad = g.clone(), g.clone()
    opt = dml_optim.Adam([{"params": ours[:2]}, {"params": ours[2:]}])
    assert len(opt.flat_buffers()) == 3
    for norm_type in NORMS:
        assert_close(dml_optim.clip_grad_norm_(opt, 0.3, norm_type).double(),
                     torch.nn.utils.clip_grad_norm_(ref, 0.3, norm_type).double())
        for p, q in zip(ours, ref):
            assert_close(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", NORMS)
def test_op_count_does_not_grow_with_the_number_of_tensors(norm_type):
    counts = []
    for n in (10, 1000):
        ours, _ = _twins([(4,)] * n)
        opt = dml_optim.Adam(ours)
        opt.step()  # gradients gathered into the flat buffer
        counts.append(count_ops(lambda: dml_optim.clip_grad_norm_(opt, 0.1, norm_type)))
    assert counts[0] == counts[1] <= 6, counts


def test_after_dynamic_loss_scaler_unscale_and_with_a_skipped_step():
    """unscale_ then clip then step: the clipped gradients are the unscaled ones; an overflowing
    iteration is skipped and the next clips correctly."""
    gen = torch.Generator().manual_seed(2)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = dml_optim.Momentum(ours, lr=0.1, alpha=0.5)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.5)
    scaler = dml_optim.DynamicLossScaler(init_scale=2.0**8, growth_interval=100)
    for it in range(5):
        x = [torch.randn(s, generator=gen) for s in SHAPES]
        overflow = it == 2
        opt.zero_grad()
        loss = sum((p * xi).sum() for p, xi in zip(ours, x)) * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        total = dml_optim.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if overflow:
            assert not torch.isfinite(total)
            continue
        for q, xi in zip(ref, x):
            q.grad = xi.clone()
        assert_close(total, torch.nn.utils.clip_grad_norm_(ref, 1.0))
        ref_opt.step()
        for p, q in zip(ours, ref):
            assert_close(p.detach(), q.detach())


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler('cpu') needs torch >= 2.3")
def test_after_grad_scaler_unscale():
    ours, ref = _twins(SHAPES)
    opt = dml_optim.Adam(ours, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for p in ours:
        p.grad.mul_(4.0)  # as if the loss had been scaled
    scaler.scale(torch.zeros(()))  # GradScaler creates its scale lazily
    scaler.unscale_(opt)
    assert_close(dml_optim.clip_grad_norm_(opt, 1.0), torch.nn.utils.clip_grad_norm_(ref, 1.0))
    for p, q in zip(ours, ref):
        assert_close(p.grad, q.grad)


def test_bad_arguments_name_the_argument():
    ours, _ = _twins(SHAPES)
    opt = dml_optim.Adam(ours)
    before = [p.grad.clone() for p in ours]
    with pytest.raises(ValueError, match="max_norm"):
        dml_optim.clip_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        dml_optim.clip_grad_norm_(opt, 1.0, norm_type=0)
    with pytest.raises(TypeError, match="error_if_nonfinite"):
        dml_optim.clip_grad_norm_(opt, 1.0, error_if_nonfinite="yes")
    with pytest.raises(TypeError, match="dml_optim optimizer"):
        dml_optim.clip_grad_norm_(torch.optim.SGD(ours, lr=0.1), 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(ours, before))


def test_audit_beside_torch_on_resnet50_shapes():
    """As torch-directml would run them: ours is a handful of native ops; torch's is two per tensor."""
    from dml_optim.audit import audit_call
    from dml_optim.inventory import resolve_model

    inv = resolve_model("resnet50")
    shapes = [s for _, s in inv.parameters]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in ours:
        p.grad = torch.ones_like(p)
    opt = dml_optim.Adam(ours, backend="eager")
    opt.step()
    report = audit_call(opt, lambda: dml_optim.clip_grad_norm_(opt, 1.0))
    assert report.total_ops <= 9 and report.fallbacks == [] and report.host_syncs == 0, report.ops
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for q in ref:
        q.grad = torch.ones_like(q)
    torch_report = audit_call(opt, lambda: torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=True))
    assert torch_report.total_ops >= 2 * len(shapes)  # _foreach_norm and _foreach_mul_: one op per tensor each


def test_cli_audit_clip_beside_torch(capsys):
    """``dml-optim audit --clip``: ours a handful of ops for any number of tensors; torch's two per tensor."""
    import json

    from dml_optim.cli import main

    assert main(["audit", "--optimizer", "adamw", "--model", "many-small-300", "--clip", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["audited"] == "clip_grad_norm_" and doc["tensors"] == 300
    assert doc["ours"]["optimizer"] == "dml_optim.clip_grad_norm_"
    assert doc["ours"]["total_ops"] <= 9 and doc["ours"]["host_syncs"] == 0 and doc["ours"]["fallbacks"] == []
    assert doc["torch"]["optimizer"] == "torch.nn.utils.clip_grad_norm_"
    assert doc["torch"]["total_ops"] >= 2 * 300


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
def test_the_total_norm_is_as_accurate_as_torchs(norm_type):
    """One float32 reduction over a whole flat buffer loses what small gradients add after large ones; the norm
    is taken per block of ``NORM_BLOCK`` elements and then over the blocks', so it stays within a float32
    reduction's error of the float64 norm wherever torch's norm of per-tensor norms does (a single reduction
    over these 1.3M elements: 2.4e-5 relative for the 2-norm), small elements after the last whole block too."""
    gen = torch.Generator().manual_seed(0)
    sizes_scales = [(1 << 20, 1.0), (16_000, 4e-3), (300_000, 1e-3), (7, 10.0), (4000, 1e-2)]
    ps = [torch.nn.Parameter(torch.zeros(n)) for n, _ in sizes_scales]
    for p, (n, scale) in zip(ps, sizes_scales):
        p.grad = torch.randn(n, generator=gen) * scale
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in ps]), norm_type).item()
    theirs = torch.nn.utils.clip_grad_norm_(ps, 1e12, norm_type).item()
    ours = dml_optim.clip_grad_norm_(dml_optim.Momentum(ps, lr=0.1), 1e12, norm_type).item()
    bound = max(abs(theirs / exact - 1), 1e-6)
    assert abs(ours / exact - 1) <= bound, (ours, theirs, exact)
