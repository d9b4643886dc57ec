"""``optimizer.state`` behaves like torch.optim's, backed by the flat buffers."""

import pytest
import torch

import dml_optim
from introspect import buffers


def _model_and_opts():
    torch.manual_seed(0)
    ours_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    torch_model.load_state_dict(ours_model.state_dict())
    ours = dml_optim.Adam(ours_model.parameters(), lr=0.01, epsilon=0.0)
    theirs = torch.optim.Adam(torch_model.parameters(), lr=0.01, eps=0.0)
    return ours_model, ours, torch_model, theirs


def _step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_state_reads_like_torch_optim():
    ours_model, ours, torch_model, theirs = _model_and_opts()
    assert len(ours.state) == 0 and dict(ours.state) == {}
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        _step(ours_model, ours, x)
        _step(torch_model, theirs, x)
    assert len(ours.state) == len(theirs.state) == 4
    for p, q in zip(ours_model.parameters(), torch_model.parameters()):
        mine, ref = ours.state[p], theirs.state[q]
        assert set(mine) == set(ref) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(mine["step"]) == float(ref["step"]) == 3.0
        torch.testing.assert_close(mine["exp_avg"], ref["exp_avg"])
        torch.testing.assert_close(mine["exp_avg_sq"], ref["exp_avg_sq"])


def test_state_tensors_are_views_of_the_flat_buffers():
    model, opt, _, _ = _model_and_opts()
    _step(model, opt, torch.randn(2, 4, dtype=torch.float64))
    w = model[0].weight
    opt.state[w]["exp_avg"].fill_(7.0)  # in place on the view
    flat = buffers(opt)[0]
    assert flat.param_indices[0] == 0  # w is the group's first parameter and the buffer's
    assert torch.equal(flat.states["exp_avg"][: w.numel()].view_as(w), torch.full_like(w, 7.0))


def test_assigning_state_loads_into_the_buffers_and_drives_the_next_step():
    """opt.state[p] = torch's entry (what ZeroRedundancyOptimizer.load_state_dict does)
    makes the next step continue exactly as torch.optim does."""
    ours_model, ours, torch_model, theirs = _model_and_opts()
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        _step(torch_model, theirs, x)
    with torch.no_grad():
        for p, q in zip(ours_model.parameters(), torch_model.parameters()):
            p.copy_(q)
    for p, q in zip(ours_model.parameters(), torch_model.parameters()):
        ours.state[p] = {k: v.clone() for k, v in theirs.state[q].items()}
    _step(ours_model, ours, x)
    _step(torch_model, theirs, x)
    for p, q in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
        assert float(ours.state[p]["step"]) == 3.0


def test_state_assignment_errors_name_the_key_and_change_nothing():
    model, opt, _, _ = _model_and_opts()
    _step(model, opt, torch.randn(2, 4, dtype=torch.float64))
    w = model[0].weight
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with pytest.raises(KeyError, match="no state 'momentum_buffer'"):
        opt.state[w]["momentum_buffer"] = torch.zeros_like(w)
    with pytest.raises(ValueError, match="shape"):
        opt.state[w]["exp_avg"] = torch.zeros(2)
    with pytest.raises(ValueError, match="step"):
        opt.state[w]["step"] = -1
    with pytest.raises(TypeError, match="cannot be deleted"):
        del opt.state[w]
    with pytest.raises(KeyError, match="not a parameter"):
        opt.state[torch.zeros(1)]
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_parameters_rebound_into_a_foreign_buffer_in_another_layout_are_refused():
    """Copying back would leave the foreign buffer stale: refuse, change nothing."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = dml_optim.Adam(params, lr=0.1)
    bucket = torch.zeros(20)
    with torch.no_grad():
        for i, p in enumerate(reversed(params)):  # another order than the optimizer's
            bucket[5 * i : 5 * i + 4].copy_(p)
            p.data = bucket[5 * i : 5 * i + 4]
    for p in params:
        p.grad = torch.ones(4)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="shared buffer"):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))


def test_parameters_rebound_into_a_foreign_buffer_in_our_layout_are_adopted():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = dml_optim.Momentum(params, lr=0.5, alpha=0.0)
    bucket = torch.zeros(12)
    with torch.no_grad():
        for i, p in enumerate(params):
            bucket[4 * i : 4 * i + 4].copy_(p)
            p.data = bucket[4 * i : 4 * i + 4]
    expected = torch.cat([p.detach().reshape(-1) for p in params]) - 0.5
    for p in params:
        p.grad = torch.ones(4)
    opt.step()
    assert torch.equal(bucket, expected)  # the foreign buffer itself was updated
    assert buffers(opt)[0].data.data_ptr() == bucket.data_ptr()


def test_unmarked_state_dict_with_our_names_keeps_our_hyperparameters():
    """A dict without the dml_optim marker but with our hyperparameter names (what
    torch.optim.Optimizer.state_dict writes over our groups, e.g. a bare ZeRO
    state_dict) must not silently fall back to the constructor's values."""
    src = [torch.nn.Parameter(torch.randn(3))]
    opt = dml_optim.Adam(src, lr=0.01, alpha=0.8, beta=0.95, norm_coefficient=0.1)
    src[0].grad = torch.ones(3)
    opt.step()
    sd = torch.optim.Optimizer.state_dict(opt)  # torch's own writer: no "dml_optim" key
    assert "dml_optim" not in sd
    fresh = dml_optim.Adam([torch.nn.Parameter(torch.randn(3))], lr=1.0)
    fresh.load_state_dict(sd)
    group = fresh.param_groups[0]
    assert (group["lr"], group["alpha"], group["beta"], group["norm_coefficient"]) == (0.01, 0.8, 0.95, 0.1)
