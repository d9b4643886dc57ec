"""Safe and portable checkpoints (issue 8, item 4).

* ``state_dict()`` holds only tensors and plain Python values (walked), so it
  round-trips through ``torch.save`` / ``torch.load(..., weights_only=True)``,
  for every optimizer and precision mode;
* ``state_dict()["dml_optim"]["format_version"] == 1``;
* a checkpoint saved with one dtype loads into an optimizer with another: the
  values are cast, the optimizer keeps its own dtypes (documented in
  ``dml_optim/optimizers/_state.py``); ``map_location`` works;
* the previous layout (version 0: torch.optim's own state dict) still loads,
  and continues like torch.optim;
* a checkpoint resumes training in lockstep (bit-identical) with an
  uninterrupted run, through ``weights_only=True``.

The optimizers, devices and torch.optim twins come from the test matrix
(``tests/matrix.py``); the precision modes (``MODES``) fix their own dtypes.
"""

from __future__ import annotations

import io

import pytest
import torch

from dml_optim import Adam, Momentum
from introspect import buffers
from matrix import Case, cases, classes
from dml_optim.optimizers import registry
from test_bad_inputs import WORLD_HYPER, assert_same, snapshot
from tolerances import assert_close

PLAIN = (str, int, float, bool, type(None))

SHAPES = ((3, 4), (7,), (2, 2, 2))

#: precision modes: (parameter dtype, optimizer options)
MODES = {
    "fp32": (torch.float32, {}),
    "fp16": (torch.float16, dict(epsilon=1e-4)),
    "fp16-state-fp32-compute": (torch.float16, dict(state_dtype=torch.float16, compute_dtype=torch.float32, epsilon=1e-4)),
    "fp16-master-weights": (torch.float16, dict(master_weights=True)),
    "fp32-state-fp16": (torch.float32, dict(state_dtype=torch.float16, epsilon=1e-4)),
    "fp32-skip": (torch.float32, dict(nonfinite="skip")),
}


def options(case: Case, mode):
    """The mode's parameter dtype and options; its epsilon under the optimizer's name for it (none for Momentum)."""
    dtype, kw = MODES[mode]
    kw = dict(kw)
    if "epsilon" in kw:
        kw.update(case.epsilon_kwargs(kw.pop("epsilon")))
    return dtype, kw


def init_values(dtype, seed=5, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in SHAPES]


def grads_at(t, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(1000 + t)
    out = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in SHAPES]
    if t % 3 == 1:
        out[1] = None  # a parameter without a gradient now and then: per-parameter step counts
    return out


def make(cls, values, groups=True, **kw):
    ps = [torch.nn.Parameter(v.clone()) for v in values]
    spec = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}] if groups else ps
    return ps, cls(spec, lr=0.01, **{**WORLD_HYPER.get(registry.name_of(cls), {}), **kw})


def run_steps(ps, opt, steps, dtype):
    for t in steps:
        for p, g in zip(ps, grads_at(t, dtype, ps[0].device)):
            p.grad = g
        opt.step()


def save_load(obj, **load_kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **load_kw)


def walk(obj, path="state_dict"):
    """Raise unless ``obj`` is made only of dict/list/tuple/plain values/tensors."""
    if isinstance(obj, torch.Tensor):
        assert type(obj) is torch.Tensor, f"{path}: a tensor subclass {type(obj).__name__}"
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, PLAIN), f"{path}: key {k!r} of type {type(k).__name__}"
            walk(v, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk(v, f"{path}[{i}]")
        return
    assert type(obj) in PLAIN, f"{path}: {obj!r} is a {type(obj).__name__}"


def test_walk_rejects_a_dtype():
    with pytest.raises(AssertionError, match="dtype"):
        walk({"state_dtype": torch.float16})


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", classes())
def test_state_dict_is_plain_and_loads_with_weights_only(case, mode):
    cls = case.cls
    dtype, kw = options(case, mode)
    ps, opt = make(cls, init_values(dtype, device=case.device), **kw)
    run_steps(ps, opt, range(3), dtype)
    sd = opt.state_dict()
    walk(sd)
    assert sd["dml_optim"] == {"format_version": 1, "optimizer": cls.__name__}
    assert set(sd) == {"state", "param_groups", "dml_optim"}
    loaded = save_load(sd)
    assert_same(sd, loaded)
    names = set(cls.state_names) | {"step"} | ({"master_param"} if kw.get("master_weights") else set())
    assert all(set(s) == names for s in sd["state"].values())
    expected_state_dtype = kw.get("state_dtype") or (torch.float32 if kw.get("master_weights") else dtype)
    assert all(s[n].dtype == expected_state_dtype for s in sd["state"].values() for n in cls.state_names)


# -- lockstep resume ------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", classes())
def test_resume_is_bit_identical_to_an_uninterrupted_run(case, mode):
    cls = case.cls
    dtype, kw = options(case, mode)
    values = init_values(dtype, device=case.device)
    ps, opt = make(cls, values, **kw)
    run_steps(ps, opt, range(8), dtype)
    expected = [p.detach().clone() for p in ps]
    expected_sd = save_load(opt.state_dict())

    ps, opt = make(cls, values, **kw)
    run_steps(ps, opt, range(4), dtype)
    ckpt = save_load({"params": [p.detach() for p in ps], "optimizer": opt.state_dict()})
    ps2, opt2 = make(cls, ckpt["params"], **kw)
    opt2.load_state_dict(ckpt["optimizer"])
    run_steps(ps2, opt2, range(4, 8), dtype)
    assert_same(expected, [p.detach() for p in ps2])
    assert_same(expected_sd, save_load(opt2.state_dict()))


def test_resume_with_a_nonfinite_step_in_both_halves():
    values = init_values(torch.float32)

    def run(ps, opt, steps):
        for t in steps:
            grads = grads_at(t, torch.float32)
            if t in (2, 5):
                grads[0][0, 0] = float("inf")
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()

    ps, opt = make(Adam, values, nonfinite="skip")
    run(ps, opt, range(8))
    ps1, opt1 = make(Adam, values, nonfinite="skip")
    run(ps1, opt1, range(4))
    ckpt = save_load({"params": [p.detach() for p in ps1], "optimizer": opt1.state_dict()})
    ps2, opt2 = make(Adam, ckpt["params"], nonfinite="skip")
    opt2.load_state_dict(ckpt["optimizer"])
    run(ps2, opt2, range(4, 8))
    assert_same([p.detach() for p in ps], [p.detach() for p in ps2])
    assert_same(save_load(opt.state_dict()), save_load(opt2.state_dict()))


def test_load_into_the_same_optimizer_restores_an_earlier_point():
    values = init_values(torch.float32)
    ps, opt = make(Adam, values)
    run_steps(ps, opt, range(3), torch.float32)
    ckpt = save_load({"params": [p.detach() for p in ps], "optimizer": opt.state_dict()})
    run_steps(ps, opt, range(3, 6), torch.float32)
    with torch.no_grad():
        for p, v in zip(ps, ckpt["params"]):
            p.copy_(v)
    opt.load_state_dict(ckpt["optimizer"])
    run_steps(ps, opt, range(3, 6), torch.float32)
    ref, ropt = make(Adam, values)
    run_steps(ref, ropt, range(6), torch.float32)
    assert_same([p.detach() for p in ref], [p.detach() for p in ps])


# -- dtype and device portability ----------------------------------------------------


def _feed(ps, opt, t, drop=(), bad=None):
    """Step ``t``'s gradients (``grads_at``), without those of ``drop``, with an inf in parameter ``bad``."""
    grads = grads_at(t, ps[0].dtype, ps[0].device)
    for i, (p, g) in enumerate(zip(ps, grads)):
        p.grad = None if g is None or i in drop else g
        if i == bad and p.grad is not None:
            p.grad.view(-1)[0] = float("inf")
    opt.step()


@pytest.mark.parametrize("case", classes())
def test_load_into_a_stepped_skip_optimizer_replaces_its_step_history(case):
    """``load_state_dict`` into an optimizer that already stepped with ``nonfinite="skip"`` (its
    counts then live on the device, its parameters in several step classes) must leave nothing of
    that history: it continues exactly like a fresh optimizer loading the same checkpoint.
    (Keeping the old classes and device counters was 0.04 off for Adam.)"""
    values = init_values(case.dtype, device=case.device)
    src_ps, src = make(case.cls, values, groups=False, nonfinite="skip")
    for t, drop in [(0, ()), (2, (1,)), (3, (1, 2)), (5, ())]:  # counts (4, 2, 3): three step classes
        _feed(src_ps, src, t, drop)
    ckpt = save_load({"params": [p.detach() for p in src_ps], "optimizer": src.state_dict()})

    ps, opt = make(case.cls, values, groups=False, nonfinite="skip")
    for t, drop in enumerate([(0,), (0,), (0, 2), ()], start=10):  # other counts, other classes
        _feed(ps, opt, t, drop)
    _feed(ps, opt, 20, bad=2)  # and a skipped step: the device decides, the host forgets the counts
    fresh_ps, fresh = make(case.cls, values, groups=False, nonfinite="skip")
    for o, pp in ((opt, ps), (fresh, fresh_ps)):
        with torch.no_grad():
            for p, v in zip(pp, ckpt["params"]):
                p.copy_(v)
        o.load_state_dict(ckpt["optimizer"])
    def counts(o):
        return [float(entry["step"]) for entry in o.state_dict()["state"].values()]

    assert counts(opt) == counts(fresh) == counts(src) == [4.0, 2.0, 3.0]
    for t, drop in enumerate([(), (1,), ()], start=30):
        _feed(ps, opt, t, drop)
        _feed(fresh_ps, fresh, t, drop)
    a, b = snapshot(ps, opt), snapshot(fresh_ps, fresh)
    for key in ("group_params", "steps", "states", "master"):  # ids and buffer order differ; the state dict
        del a[key], b[key]                                      # holds the same per parameter
    assert_same(a, b)


@pytest.mark.parametrize("src,dst", [
    (dict(dtype=torch.float32), dict(dtype=torch.float64)),
    (dict(dtype=torch.float64), dict(dtype=torch.float32)),
    (dict(dtype=torch.float32), dict(dtype=torch.float32, state_dtype=torch.float16)),
    (dict(dtype=torch.float32, state_dtype=torch.float16), dict(dtype=torch.float32)),
    (dict(dtype=torch.float16, master_weights=True), dict(dtype=torch.float32)),
    (dict(dtype=torch.float32), dict(dtype=torch.float16, master_weights=True)),
], ids=["f32->f64", "f64->f32", "f32->f16-state", "f16-state->f32", "f16-master->f32", "f32->f16-master"])
def test_checkpoint_loads_across_dtypes_with_documented_casting(src, dst):
    src, dst = dict(src), dict(dst)
    sdtype, ddtype = src.pop("dtype"), dst.pop("dtype")
    ps, opt = make(Adam, init_values(sdtype), epsilon=1e-4, **src)
    run_steps(ps, opt, range(3), sdtype)
    sd = save_load(opt.state_dict())
    ps2, opt2 = make(Adam, [p.detach().to(ddtype) for p in ps], epsilon=1e-4, **dst)
    opt2.load_state_dict(sd)
    own_state_dtype = dst.get("state_dtype") or (torch.float32 if dst.get("master_weights") else ddtype)
    out = opt2.state_dict()
    for pid, entry in sd["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            got = out["state"][pid][name]
            assert got.dtype == own_state_dtype  # the optimizer keeps its own dtype
            assert torch.equal(got, entry[name].to(own_state_dtype))  # values cast (round to nearest)
        assert float(out["state"][pid]["step"]) == float(entry["step"])
    for info in buffers(opt2):
        assert all(s.dtype == own_state_dtype for s in info.states.values())
    # the precision options stay the optimizer's own, whatever the checkpoint said
    for g in opt2.param_groups:
        assert g["master_weights"] == dst.get("master_weights", False)
        assert g["state_dtype"] == dst.get("state_dtype")
    run_steps(ps2, opt2, range(3, 5), ddtype)
    assert all(torch.isfinite(p).all() for p in ps2)


def test_master_param_is_restored_in_master_mode():
    ps, opt = make(Adam, init_values(torch.float16), master_weights=True)
    run_steps(ps, opt, range(3), torch.float16)
    sd = save_load(opt.state_dict())
    ps2, opt2 = make(Adam, [torch.zeros_like(p) for p in ps], master_weights=True)
    opt2.load_state_dict(sd)
    for pid, p in enumerate(ps2):
        assert torch.equal(opt2.state_dict()["state"][pid]["master_param"], sd["state"][pid]["master_param"])
        # the fp16 parameters are re-synchronised from the loaded master copy
        assert torch.equal(p.detach(), sd["state"][pid]["master_param"].to(torch.float16))


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), lambda storage, loc: storage],
                         ids=["str", "device", "callable"])
def test_map_location(map_location):
    ps, opt = make(Adam, init_values(torch.float32))
    run_steps(ps, opt, range(2), torch.float32)
    sd = save_load(opt.state_dict(), map_location=map_location)
    ps2, opt2 = make(Adam, [p.detach() for p in ps])
    opt2.load_state_dict(sd)
    assert_same(save_load(opt.state_dict()), save_load(opt2.state_dict()))


def test_meta_map_location_is_refused_without_damage():
    """Loading onto the meta device gives tensors with no values: refused, nothing changed."""
    ps, opt = make(Adam, init_values(torch.float32))
    run_steps(ps, opt, range(2), torch.float32)
    sd = save_load(opt.state_dict(), map_location="meta")
    before = save_load(opt.state_dict())
    with pytest.raises(ValueError, match="meta device"):
        opt.load_state_dict(sd)
    assert_same(before, save_load(opt.state_dict()))


# -- version 0: torch.optim's own layout --------------------------------------------------


@pytest.mark.parametrize("case", cases(variants="all", twin=True, dtypes="widest", low_precision=False))
def test_torch_optim_checkpoint_loads_and_continues_like_torch(case: Case):
    """Every matrix variant with an exact torch.optim twin (docs/design.md §2), in two groups with
    different hyperparameters: the twin's checkpoint loads into ours (built with another lr and
    the first group's hyperparameters everywhere) and both continue alike."""
    dtype = case.dtype
    values = init_values(dtype, device=case.device)
    tps = [torch.nn.Parameter(v.clone()) for v in values]
    topt = case.twin(case.groups(tps[:2], tps[2:]))
    run_steps(tps, topt, range(3), dtype)
    sd = save_load(topt.state_dict())
    assert "dml_optim" not in sd  # version 0
    ps = [torch.nn.Parameter(p.detach().clone()) for p in tps]
    opt = case.build([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.5)
    opt.load_state_dict(sd)  # lr and every mapped hyperparameter come from the checkpoint
    assert [g["lr"] for g in opt.param_groups] == [case.hyper["lr"], case.second["lr"]]
    run_steps(tps, topt, range(3, 7), dtype)
    run_steps(ps, opt, range(3, 7), dtype)
    for p, t in zip(ps, tps):
        assert_close(p.detach(), t.detach(), **case.torch_tolerance())


def test_torch_sgd_checkpoint_without_momentum_loads():
    """torch.optim.SGD(momentum=0) keeps no state at all: an empty state loads as 'not started'."""
    tps = [torch.nn.Parameter(v) for v in init_values(torch.float64)]
    topt = torch.optim.SGD(tps, lr=0.1)
    run_steps(tps, topt, range(2), torch.float64)
    opt = Momentum([torch.nn.Parameter(p.detach().clone()) for p in tps], lr=0.3, alpha=0.0)
    opt.load_state_dict(save_load(topt.state_dict()))
    assert opt.param_groups[0]["lr"] == 0.1 and opt.state_dict()["state"] == {}


@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_torch_checkpoint_with_a_flag_we_do_not_implement_is_refused(flag):
    tps = [torch.nn.Parameter(v) for v in init_values(torch.float64)]
    topt = torch.optim.Adam(tps, lr=0.01, **{flag: True})
    run_steps(tps, topt, range(2), torch.float64)
    opt = Adam([torch.nn.Parameter(p.detach().clone()) for p in tps], lr=0.5)
    before = save_load(opt.state_dict())
    with pytest.raises((ValueError, KeyError), match=flag if flag == "maximize" else "max_exp_avg_sq|amsgrad"):
        opt.load_state_dict(save_load(topt.state_dict()))
    assert_same(before, save_load(opt.state_dict()))


@pytest.mark.parametrize("case", cases(variants="all", twin=True, dtypes="widest", devices=("cpu",)))
def test_state_names_match_torch_optim(case: Case):
    """The torch names make version-0 loading a rename-free operation."""
    tps = [torch.nn.Parameter(torch.ones(2, dtype=case.dtype))]
    topt = case.twin(tps)
    tps[0].grad = torch.ones(2, dtype=case.dtype)
    topt.step()
    if not case.states:  # torch.optim.SGD without momentum keeps no state at all
        assert topt.state_dict()["state"] == {}
        return
    assert set(topt.state_dict()["state"][0]) - {"step"} == set(case.states)


def test_step_counts_above_2_to_the_24_survive_a_checkpoint():
    ps, opt = make(Adam, init_values(torch.float32), groups=False)
    run_steps(ps, opt, range(1), torch.float32)
    for p in opt.param_groups[0]["params"]:
        opt.state[p]["step"] = 2**24 + 1
    sd = save_load(opt.state_dict())
    assert int(sd["state"][0]["step"]) == 2**24 + 1
