"""State dicts: mid-run checkpoints through ``torch.save``/``torch.load(weights_only=True)``
into a fresh model and optimizer, continued in lockstep; torch.optim checkpoints
loading into ours; loading onto another dtype."""

from __future__ import annotations

import io

import pytest
import torch

import dml_optim
from tolerances import TORCH_ADAM_FLOAT32, assert_close

F64 = torch.float64

OURS = {
    "Adam": lambda params: dml_optim.Adam(params, lr=0.01, norm_coefficient=0.01, norm_coefficient_post=0.001),
    "DmlAdam": lambda params: dml_optim.DmlAdam(params, lr=0.01, beta1=0.8),
    "Adagrad": lambda params: dml_optim.Adagrad(params, lr=0.1, decay_factor=0.01, norm_coefficient=0.01),
    "Momentum": lambda params: dml_optim.Momentum(params, lr=0.05, alpha=0.9, beta=0.7, norm_coefficient=0.01),
}


def _model(dtype, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(48, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


def _groups(model):
    layers = list(model.children())
    return [{"params": list(layers[0].parameters())},
            {"params": list(layers[2].parameters()) + list(layers[4].parameters()), "lr": 0.003}]


def _train(model, opt, steps, start=0):
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(900 + step)
        x, y = torch.randn(4, 2, 6, 6, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", list(OURS))
def test_checkpoint_mid_run_into_fresh_model_and_optimizer_stays_identical(name):
    dtype = torch.float32 if name == "DmlAdam" else F64
    model = _model(dtype)
    opt = OURS[name](_groups(model))
    _train(model, opt, 7)
    ckpt = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    fresh_model = _model(dtype, seed=99)  # different initial values: the load must overwrite them
    fresh_model.load_state_dict(ckpt["model"])
    fresh = OURS[name](_groups(fresh_model))
    fresh.load_state_dict(ckpt["optim"])
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for step in range(7, 13):
        _train(model, opt, 1, start=step)
        _train(fresh_model, fresh, 1, start=step)
        for p, q in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(p, q), f"{name}: diverged at step {step}"
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key in a["state"][k]:
            assert torch.equal(a["state"][k][key], b["state"][k][key])


def test_state_dict_has_torch_layout_and_metadata():
    model = _model(F64)
    opt = OURS["Adam"](_groups(model))
    _train(model, opt, 2)
    sd = opt.state_dict()
    assert sd["dml_optim"]["optimizer"] == "Adam" and sd["dml_optim"]["format_version"] >= 1
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4, 5]]
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].shape == model[0].weight.shape
    assert float(sd["state"][0]["step"]) == 2
    assert sd["param_groups"][1]["lr"] == 0.003


@pytest.mark.parametrize("ours_name", ["Adam", "DmlAdam"])
def test_torch_adam_checkpoint_loads_and_continues_like_torch(ours_name):
    """exp_avg ↔ first moment, exp_avg_sq ↔ second moment, step ↔ completed steps;
    with epsilon 0 the continued runs match torch.optim continuing."""
    dtype = torch.float32 if ours_name == "DmlAdam" else F64
    ref_model = _model(dtype)
    ref = torch.optim.Adam(_groups(ref_model), lr=0.01, betas=(0.85, 0.99), eps=0.0, foreach=False)
    _train(ref_model, ref, 5)
    ckpt = _roundtrip({"model": ref_model.state_dict(), "optim": ref.state_dict()})
    model = _model(dtype, seed=5)
    model.load_state_dict(ckpt["model"])
    cls = dml_optim.Adam if ours_name == "Adam" else dml_optim.DmlAdam
    opt = cls(_groups(model), lr=0.5, epsilon=0.0)  # lr and betas come from the checkpoint
    opt.load_state_dict(ckpt["optim"])
    group = opt.param_groups[0]
    betas = (group["alpha"], group["beta"]) if ours_name == "Adam" else (group["beta1"], group["beta2"])
    assert betas == (0.85, 0.99) and opt.param_groups[1]["lr"] == 0.003
    tol = {} if dtype == F64 else TORCH_ADAM_FLOAT32
    for step in range(5, 15):
        _train(ref_model, ref, 1, start=step)
        _train(model, opt, 1, start=step)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close(p.detach(), q.detach(), **tol)


@pytest.mark.parametrize("kind", ["Adagrad", "SGD", "SGD-nesterov"])
def test_torch_adagrad_and_sgd_checkpoints_load_into_ours(kind):
    ref_model = _model(F64)
    if kind == "Adagrad":
        ref = torch.optim.Adagrad(_groups(ref_model), lr=0.1, lr_decay=0.01, eps=1e-10, weight_decay=0.01, foreach=False)
        make = lambda params: dml_optim.Adagrad(params, lr=1.0)  # noqa: E731
    else:
        nesterov = kind == "SGD-nesterov"
        ref = torch.optim.SGD(_groups(ref_model), lr=0.05, momentum=0.8, dampening=0.0 if nesterov else 0.3,
                              nesterov=nesterov, weight_decay=0.01, foreach=False)
        make = lambda params: dml_optim.Momentum(params, lr=1.0)  # noqa: E731
    _train(ref_model, ref, 4)
    ckpt = _roundtrip({"model": ref_model.state_dict(), "optim": ref.state_dict()})
    model = _model(F64, seed=3)
    model.load_state_dict(ckpt["model"])
    opt = make(_groups(model))
    opt.load_state_dict(ckpt["optim"])
    for step in range(4, 10):
        _train(ref_model, ref, 1, start=step)
        _train(model, opt, 1, start=step)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close(p.detach(), q.detach())


@pytest.mark.parametrize("name", ["Adam", "Adagrad", "Momentum"])
def test_state_loads_onto_another_dtype(name):
    """A float32 checkpoint loads into a float64 optimizer: states are cast to its dtype (documented)."""
    model = _model(torch.float32)
    opt = OURS[name](_groups(model))
    _train(model, opt, 3)
    ckpt = _roundtrip(opt.state_dict())
    model64 = _model(F64, seed=7)
    opt64 = OURS[name](_groups(model64))
    opt64.load_state_dict(ckpt)
    sd64 = opt64.state_dict()
    assert sd64["state"].keys() == ckpt["state"].keys()
    for k, entry in ckpt["state"].items():
        for key, value in entry.items():
            if key == "step":
                assert float(sd64["state"][k]["step"]) == float(value) == 3
                continue
            assert sd64["state"][k][key].dtype == F64
            assert torch.equal(sd64["state"][k][key], value.to(F64))
    _train(model64, opt64, 2, start=3)  # and it keeps training
    assert float(opt64.state_dict()["state"][0]["step"]) == 5


def test_bad_state_dict_is_rejected_and_changes_nothing():
    model = _model(F64)
    opt = OURS["Adam"](_groups(model))
    _train(model, opt, 2)
    good = _roundtrip(opt.state_dict())
    bad = _roundtrip(opt.state_dict())
    bad["state"][3]["exp_avg"] = torch.zeros(7, dtype=F64)  # wrong shape, on the last entry
    bad["state"][0]["exp_avg"].fill_(123.0)  # would be visible if written before the check
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k in good["state"]:
        for key in good["state"][k]:
            assert torch.equal(after["state"][k][key], good["state"][k][key])
