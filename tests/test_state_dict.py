"""State dicts: mid-run checkpoints through ``torch.save``/``torch.load(weights_only=True)``
into a fresh model and optimizer, continued in lockstep; torch.optim checkpoints
loading into ours; loading onto another dtype.

The optimizers, their hyperparameters (every variant), dtypes, devices and
torch.optim twins come from the test matrix (``tests/matrix.py``)."""

from __future__ import annotations

import io

import pytest
import torch

from matrix import Case, case_of, cases
from tolerances import assert_close

F64 = torch.float64
ADAM = case_of("adam", variant="adam-norm-coefficients")


def _model(dtype, seed=0, device="cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(48, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype=dtype, device=device)


def _groups(model, second=None):
    """Two groups: the conv layer, and the linear layers with lr 0.003 (or the hyperparameters ``second``)."""
    layers = list(model.children())
    return [{"params": list(layers[0].parameters())},
            {"params": list(layers[2].parameters()) + list(layers[4].parameters()), **(second or {"lr": 0.003})}]


def _train(model, opt, steps, start=0):
    p = next(model.parameters())
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(900 + step)
        x = torch.randn(4, 2, 6, 6, generator=g).to(dtype=p.dtype, device=p.device)
        y = torch.randn(4, 2, generator=g).to(dtype=p.dtype, device=p.device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("case", cases(variants="all", dtypes="widest"))
def test_checkpoint_mid_run_into_fresh_model_and_optimizer_stays_identical(case: Case):
    def build(model):
        return case.build(_groups(model, case.second))

    model = _model(case.dtype, device=case.device)
    opt = build(model)
    _train(model, opt, 7)
    ckpt = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    fresh_model = _model(case.dtype, seed=99, device=case.device)  # different initial values: the load must overwrite them
    fresh_model.load_state_dict(ckpt["model"])
    fresh = build(fresh_model)
    fresh.load_state_dict(ckpt["optim"])
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for step in range(7, 13):
        _train(model, opt, 1, start=step)
        _train(fresh_model, fresh, 1, start=step)
        for p, q in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(p, q), f"{case.id}: diverged at step {step}"
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key in a["state"][k]:
            assert torch.equal(a["state"][k][key], b["state"][k][key])


def test_state_dict_has_torch_layout_and_metadata():
    model = _model(F64)
    opt = ADAM.build(_groups(model))
    _train(model, opt, 2)
    sd = opt.state_dict()
    assert sd["dml_optim"]["optimizer"] == "Adam" and sd["dml_optim"]["format_version"] >= 1
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4, 5]]
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].shape == model[0].weight.shape
    assert float(sd["state"][0]["step"]) == 2
    assert sd["param_groups"][1]["lr"] == 0.003


@pytest.mark.parametrize("case", cases(variants="all", twin=True, dtypes="widest", low_precision=False))
def test_torch_checkpoint_loads_into_ours_and_continues_like_torch(case: Case):
    """A checkpoint of the exact torch.optim twin (docs/design.md §2; the Adams with epsilon 0):
    exp_avg ↔ first moment, exp_avg_sq ↔ second moment, sum, momentum_buffer, step ↔ completed
    steps; lr and the mapped hyperparameters (betas, momentum/dampening, ...) come from the
    checkpoint, and the continued runs match torch.optim continuing."""
    ref_model = _model(case.dtype, device=case.device)
    ref = case.twin(_groups(ref_model, case.second))
    _train(ref_model, ref, 5)
    ckpt = _roundtrip({"model": ref_model.state_dict(), "optim": ref.state_dict()})
    model = _model(case.dtype, seed=5, device=case.device)
    model.load_state_dict(ckpt["model"])
    opt = case.build(_groups(model, {}), lr=0.5)  # lr and the second group's hyperparameters: from the checkpoint
    opt.load_state_dict(ckpt["optim"])
    for group, hyper in zip(opt.param_groups, (case.hyper, {**case.hyper, **case.second})):
        for name, value in hyper.items():  # in our names (betas -> alpha, beta; dampening -> beta; ...)
            assert group[name] == (pytest.approx(value, rel=1e-15) if isinstance(value, float) else value), name
    for step in range(5, 15):
        _train(ref_model, ref, 1, start=step)
        _train(model, opt, 1, start=step)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_close(p.detach(), q.detach(), **case.torch_tolerance())


@pytest.mark.parametrize("case", cases(dtypes=(F64,)))
def test_state_loads_onto_another_dtype(case: Case):
    """A float32 checkpoint loads into a float64 optimizer: states are cast to its dtype (documented)."""
    model = _model(torch.float32, device=case.device)
    opt = case.build(_groups(model))
    _train(model, opt, 3)
    ckpt = _roundtrip(opt.state_dict())
    model64 = _model(F64, seed=7, device=case.device)
    opt64 = case.build(_groups(model64))
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
    opt = ADAM.build(_groups(model))
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
