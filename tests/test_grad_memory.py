"""Gradients never held twice (issue 32, item 2): fresh gradients move into the flat gradient buffer as autograd
produces them (dml_optim/core/grads.py, the post-accumulate-grad hooks).

In-process: under ``zero_grad(set_to_none=True)`` every gradient is a view of one storage right after
backward, with torch's values; accumulation over several backward passes, parameters without a gradient,
double backward's graph-holding gradients, torch's fused kernel (which reads fresh gradients where they are)
and a copied optimizer behave as before.  In a subprocess (the whole-training counter,
dml_optim/benchmark/wholemem.py): the peak of a ``set_to_none=True`` loop holds one gradient per parameter.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import dml_optim
from dml_optim.core.grads import HOOKS_AVAILABLE, GradientsMixin

needs_hooks = pytest.mark.skipif(not HOOKS_AVAILABLE, reason="torch < 2.1 has no post-accumulate-grad hooks")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8))


def _loss(model, i: int, skip_last: bool = False):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
    h = model[2](model[1](model[0](x)))
    return (h if skip_last else model[3](h)).pow(2).mean()


def _shared(params) -> bool:
    """Every present gradient is a view of one storage (the flat gradient buffer)."""
    storages = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    return len(storages) == 1 and all(p.grad._base is not None for p in params if p.grad is not None)


@needs_hooks
@pytest.mark.parametrize("backend", ["eager"])  # (compiled: the same hooks, a compile too many for CI)
def test_fresh_gradients_become_views_during_backward(backend):
    """After the first step, each backward under set_to_none=True leaves every gradient in its view of the flat
    buffer, with autograd's values; a parameter without a gradient stays None (torch.optim's skip)."""
    model = _model()
    params = list(model.parameters())
    opt = dml_optim.AdamW(params, lr=1e-2, backend=backend)
    for i in range(4):
        skip = i == 2
        expected = torch.autograd.grad(_loss(model, i, skip), params, allow_unused=True)
        _loss(model, i, skip).backward()
        assert _shared(params)
        for p, e in zip(params, expected):
            assert (p.grad is None) == (e is None)
            if e is not None:
                assert torch.equal(p.grad, e)
        opt.step()
        opt.zero_grad(set_to_none=True)


@needs_hooks
@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_adds_into_the_view(set_to_none, monkeypatch):
    """Three backward passes per step: the first fresh gradient is moved in, the next ones accumulate into
    the view in place; bit for bit the same parameters as without the hooks (gathered at the step)."""
    def train():
        model = _model()
        opt = dml_optim.AdamW(model.parameters(), lr=1e-2, backend="eager")
        for s in range(3):
            for a in range(3):
                _loss(model, 10 * s + a, skip_last=s == 1 and a == 0).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return [p.detach().clone() for p in model.parameters()]

    hooked = train()
    monkeypatch.setattr(GradientsMixin, "adopt_grad", lambda self, p: False)  # (gathered at the step, as before)
    for a, b in zip(hooked, train()):
        assert torch.equal(a, b)


@needs_hooks
def test_graph_holding_and_fused_gradients_stay_where_they_are():
    """A gradient with a graph (create_graph=True) is left to the step; torch's fused kernel reads fresh
    gradients where they are, so its buffer moves nothing in (no flat gradient buffer allocated for it)."""
    model = _model()
    opt = dml_optim.AdamW(model.parameters(), lr=1e-2, backend="eager")
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _loss(model, 1).backward(create_graph=True)
    assert all(p.grad.requires_grad and p.grad._base is None for p in model.parameters())
    opt.step()
    opt.zero_grad(set_to_none=True)

    fused_model = _model()
    fused = dml_optim.AdamW(fused_model.parameters(), lr=1e-2, backend="fused")
    for i in range(2):
        _loss(fused_model, i).backward()
        assert all(p.grad._base is None for p in fused_model.parameters())
        fused.step()
        fused.zero_grad(set_to_none=True)


@needs_hooks
def test_the_hook_moves_a_fresh_gradient_with_one_view_and_one_copy():
    """What DirectML dispatches for the hooks under set_to_none=True: the same backward as torch.optim's
    (which has no hooks), plus one view (the slot's) and one copy per parameter, nothing else."""
    from collections import Counter

    from dml_optim.core.opcount import OpRecorder

    def backward_events(opt, model) -> Counter:
        for i in range(2):  # (the first step makes the flat gradient buffer; the second backward is the steady one)
            _loss(model, i).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = _loss(model, 2)
        recorder = OpRecorder(compiled=False)
        with recorder:
            loss.backward()
        return Counter(e.name for e in recorder.events)

    ours_model, theirs_model = _model(), _model()
    ours = backward_events(dml_optim.AdamW(ours_model.parameters(), lr=1e-2, backend="eager"), ours_model)
    theirs = backward_events(torch.optim.AdamW(theirs_model.parameters(), lr=1e-2, foreach=False), theirs_model)
    assert _shared(ours_model.parameters())
    n = len(list(ours_model.parameters()))
    assert ours - theirs == Counter({"aten::as_strided": n, "aten::copy_": n})
    assert not theirs - ours


@needs_hooks
def test_a_copied_optimizer_hooks_its_own_parameters():
    model = _model()
    opt = dml_optim.AdamW(model.parameters(), lr=1e-2, backend="eager")
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model2 = copy.deepcopy(model)
    opt2 = dml_optim.AdamW(model2.parameters(), lr=1e-2, backend="eager")
    opt2.load_state_dict(opt.state_dict())
    twin = copy.deepcopy(opt)  # (its parameters are copies: hooked at its first step)
    for i in range(1, 3):
        _loss(model, i).backward()
        _loss(model2, i).backward()
        assert _shared(model.parameters())
        opt.step()
        opt2.step()
        opt.zero_grad(set_to_none=True)
        opt2.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    del twin


linux_only = pytest.mark.skipif(not (sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")),
                                reason="the CPU's peak is read from /proc/self/status and reset through clear_refs (Linux)")


@needs_hooks
@linux_only
@pytest.mark.slow
def test_a_set_to_none_loop_holds_one_gradient_per_parameter():
    """The measured peak (a subprocess each, the whole-training counter) of dml_optim's FP32 eager AdamW under
    zero_grad(set_to_none=True) is within a quarter of a gradient of the set_to_none=False loop's, whose
    gradients never leave the flat buffer: a second gradient per parameter would add 4 bytes per parameter."""
    from dml_optim.benchmark.wholemem import measure_one

    peaks = {}
    for style in (True, False):
        res = measure_one(dict(config="ours-fp32-eager", set_to_none=style, model="mlp-small", device="cpu",
                               warmup=1, steps=1), timeout=300)
        assert "error" not in res, res.get("error")
        peaks[style] = res["peak_bytes"] / res["params"]
    assert peaks[True] <= peaks[False] + 1.0, peaks
