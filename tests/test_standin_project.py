"""The project on the stand-in DirectML device (issue 48): storage-less tensors, DirectML's fallbacks refused.

Every test runs on ``privateuseone:0`` as :mod:`dml_optim.standin` models torch-directml 0.2.5 (tensors without
storage, the recorded dispatch table's CPU fallbacks) with ``strict=True`` (an op DirectML would run on the CPU
raises) and ``float64=False`` (a GPU without FP64: a float64 tensor, or a Python float reaching an op through
float64, raises).  The oracle is the same run on the CPU with ``backend="eager"`` and DirectML's scratch layout
(``laid_out_as("privateuseone")``): the stand-in computes with the CPU's kernels, so the two are equal bit for
bit; torch.optim on the same device where the semantics are torch's.  Each test skips, saying why, where the
stand-in cannot be built (no C++ compiler).
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dml_optim
from dml_optim import standin
from dml_optim.backends.eager import laid_out_as
from dml_optim.optimizers.registry import OPTIMIZERS, build
from dml_optim.training.backward import step_in_backward

ROOT = Path(__file__).resolve().parent.parent
#: hyperparameters per optimizer: an epsilon float16 holds (2**-14 is its smallest normal value), lr large enough
#: that three steps move float16 parameters
HYPER = {"adam": dict(lr=1e-2, epsilon=1e-4), "dml-adam": dict(lr=1e-2, epsilon=1e-4), "adamw": dict(lr=1e-2, eps=1e-4),
         "adagrad": dict(lr=1e-2, epsilon=1e-4), "momentum": dict(lr=1e-2, alpha=0.9), "sgd": dict(lr=1e-2, momentum=0.9),
         "lion": dict(lr=1e-3, weight_decay=0.1)}
#: the precision modes DirectML has: (parameter dtype, options, whether the loss is scaled)
MODES = {
    "fp32": (torch.float32, {}, False),
    "fp16": (torch.float16, {}, False),
    "master-weights": (torch.float16, dict(master_weights=True), False),
    "kahan": (torch.float16, dict(kahan=True), False),
    "stochastic-rounding": (torch.float16, dict(rounding="stochastic"), False),
    "loss-scaling": (torch.float16, dict(master_weights=True), True),
}


@pytest.fixture(scope="module")
def dev():
    ok, why = standin.available(load=True)
    if not ok:
        pytest.skip(f"the stand-in DirectML device is unavailable here: {why}")
    return standin.device()


@pytest.fixture(autouse=True)
def _as_directml(request):
    """DirectML's strictest semantics around every test: a CPU fallback raises, and so does float64."""
    if "dev" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("dev")
    standin.reset()
    with standin.configured(strict=True, float64=False):
        yield
    standin.reset()


def _model(dtype, device, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.Tanh(), torch.nn.Linear(130, 40), torch.nn.Tanh(),
                            torch.nn.Linear(40, 4))
    return m.to(device=device, dtype=dtype)


def _batch(i, dtype, device):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 64, generator=g).to(device=device, dtype=dtype)


def _loss(m, x):
    return m(x).float().square().mean()


def _train(name, mode, bits, backend, set_to_none, device, steps=3):
    dtype, options, scaled = MODES[mode]
    m = _model(dtype, device)
    torch.manual_seed(5)  # (the stochastic rounding's seed)
    opt = build(name, m.parameters(), state_bits=bits, backend=backend, **HYPER[name], **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    scaler = dml_optim.DynamicLossScaler(init_scale=2.0**10) if scaled else None
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        loss = _loss(m, _batch(i, dtype, device))
        if scaler is None:
            loss.backward()
            if device.type == "privateuseone":
                standin.reset()  # (the step alone: 0 fallbacks; the model's ops were refused already under strict)
            opt.step()
        else:
            scaler.scale(loss).backward()
            standin.reset()
            scaler.step(opt)
            scaler.update()
        assert standin.fallbacks() == {} and standin.unknown() == {}
        sched.step()
    return [p.detach().to("cpu") for p in m.parameters()], opt


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name, mode, bits, backend, set_to_none", [
    pytest.param(*case, id="-".join(map(str, case)))
    for case in itertools.product(sorted(OPTIMIZERS), MODES, (None, 8, 4), ("auto", "eager"), (True, False))])
def test_every_optimizer_and_mode_equals_the_cpu_bit_for_bit(dev, name, mode, bits, backend, set_to_none):
    """Every optimizer x precision mode DirectML has x ``state_bits`` x backend x ``zero_grad`` style, a LambdaLR
    every step: 0 fallbacks in the step (and none in the model's forward and backward: ``strict``), no float64,
    and parameters equal to the CPU's eager run bit for bit."""
    ours, opt = _train(name, mode, bits, backend, set_to_none, dev)
    with laid_out_as("privateuseone"):
        cpu, _ = _train(name, mode, bits, "eager", set_to_none, torch.device("cpu"))
    assert all(bool(torch.isfinite(p).all()) for p in ours)
    assert _same(ours, cpu)
    assert all(info.backend == "eager" for info in opt.flat_buffers())  # (auto: DirectML's path)


# -- the loops people run -------------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    """A trunk, a head used every step and a side head used every other step (None gradients), the first layer
    frozen until step 2."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 8)
        self.side = torch.nn.Linear(64, 8)

    def forward(self, x, side: bool):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(h) + (self.side(h) if side else 0)


def _loop(device, *, inside: bool = False, nonfinite_at: int | None = None, steps: int = 5, **options):
    torch.manual_seed(0)
    net = _Net().to(device)
    net.a.requires_grad_(False)
    opt = build("adamw", net.parameters(), lr=1e-2, nonfinite="skip" if nonfinite_at is not None else "propagate",
                **options)
    handle = step_in_backward(opt) if inside else None
    for i in range(steps):
        if i == 2:  # unfrozen: taken in with fresh state
            net.a.requires_grad_(True)
            if handle is not None:
                handle.refresh()
        g = torch.Generator().manual_seed(200 + i)
        x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(net(x, side=i % 2 == 1), y)
        if i == nonfinite_at:
            loss = loss * float("inf")  # (every gradient non-finite: the step is skipped)
        loss.backward()
        if not inside:
            dml_optim.clip_grad_norm_(opt, 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().to("cpu") for p in net.parameters()], opt


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_frozen_unfrozen_none_gradients_and_clipping_equal_the_cpu(dev, backend):
    """A frozen layer unfrozen at step 2, a head without gradients every other step (its parameters must not
    move then), global-norm clipping: the CPU's run bit for bit, and torch's step counts."""
    ours, opt = _loop(dev, backend=backend)
    with laid_out_as("privateuseone"):
        cpu, _ = _loop(torch.device("cpu"), backend="eager")
    assert _same(ours, cpu)
    steps = {i: float(s["step"]) for i, s in opt.state_dict()["state"].items()}
    assert steps == {0: 3, 1: 3, 2: 5, 3: 5, 4: 5, 5: 5, 6: 2, 7: 2}, steps


def test_a_step_with_non_finite_gradients_is_skipped_exactly(dev):
    """``nonfinite="skip"``: the step whose gradients are inf leaves every parameter and state bit for bit as it
    was, and advances no count (decided on the device: no host sync).  The gated steps compute their coefficients
    on the device, in float32 on DirectML (some of its GPUs have no float64), as the CPU reference does under
    ``laid_out_as("privateuseone")``: the CPU's run bit for bit."""
    ours, opt = _loop(dev, nonfinite_at=3, steps=3)
    skipped, _ = _loop(dev, nonfinite_at=3, steps=4)
    assert _same(ours, skipped)
    assert opt.state_dict()["state"][2]["step"] == 3
    full, opt = _loop(dev, nonfinite_at=3, steps=5)
    with laid_out_as("privateuseone"):
        cpu, _ = _loop(torch.device("cpu"), nonfinite_at=3, steps=5, backend="eager")
    assert _same(full, cpu)
    steps = {i: float(s["step"]) for i, s in opt.state_dict()["state"].items()}
    assert steps == {0: 2, 1: 2, 2: 4, 3: 4, 4: 4, 5: 4, 6: 1, 7: 1}, steps  # (the skipped step counts none)


@pytest.mark.parametrize("state_bits", [None, 8])
def test_the_step_inside_backward_equals_the_plain_loop(dev, state_bits):
    """The step inside backward on DirectML's device: no data pointer read (its checks compare storage offsets),
    and the plain loop's parameters bit for bit (without clipping, which needs every gradient)."""
    def plain(device):
        torch.manual_seed(0)
        net = _Net().to(device)
        opt = build("adamw", net.parameters(), lr=1e-2, state_bits=state_bits, backend="eager")
        for i in range(4):
            g = torch.Generator().manual_seed(200 + i)
            x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
            torch.nn.functional.mse_loss(net(x, side=i % 2 == 1), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().to("cpu") for p in net.parameters()]

    torch.manual_seed(0)
    net = _Net().to(dev)
    opt = build("adamw", net.parameters(), lr=1e-2, state_bits=state_bits)
    handle = step_in_backward(opt, run_bytes=0)
    for i in range(4):
        g = torch.Generator().manual_seed(200 + i)
        x, y = torch.randn(16, 32, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
        torch.nn.functional.mse_loss(net(x, side=i % 2 == 1), y).backward()
        opt.zero_grad(set_to_none=True)
    assert handle.steps >= 4
    assert _same([p.detach().cpu() for p in net.parameters()], plain(dev))
    with laid_out_as("privateuseone"):
        assert _same(plain(dev), plain(torch.device("cpu")))


_RESUME = r"""
import sys, torch
from dml_optim import standin
from dml_optim.optimizers.registry import build
sys.path.insert(0, {tests!r})
import test_standin_project as t
dev = standin.device()
standin.configure(strict=True, float64=False)
m = t._model(torch.float16, dev)
m.load_state_dict(torch.load({model!r}, weights_only=False))
opt = build("adamw", m.parameters(), lr=1e-2, eps=1e-4, state_bits=8, rounding="stochastic")
opt.load_state_dict(torch.load({optim!r}, weights_only=False))
for i in range(2, 4):
    opt.zero_grad()
    t._loss(m, t._batch(i, torch.float16, dev)).backward()
    opt.step()
torch.save([p.detach().cpu() for p in m.parameters()], {out!r})
"""


@pytest.mark.slow
def test_a_checkpoint_resumes_in_a_fresh_process_bit_for_bit(dev, tmp_path):
    """float16, 8-bit state and stochastic rounding: ``state_dict`` -> ``torch.save`` -> a fresh process on the
    stand-in -> ``load_state_dict`` -> two more steps equal the uninterrupted run's (the rounding's seed travels in
    the checkpoint, the numbers are keyed on it)."""
    def steps(m, opt, rng):
        for i in rng:
            opt.zero_grad()
            _loss(m, _batch(i, torch.float16, dev)).backward()
            opt.step()

    m = _model(torch.float16, dev)
    torch.manual_seed(7)
    opt = build("adamw", m.parameters(), lr=1e-2, eps=1e-4, state_bits=8, rounding="stochastic")
    steps(m, opt, range(2))
    paths = {k: str(tmp_path / f"{k}.pt") for k in ("model", "optim", "out")}
    torch.save(m.state_dict(), paths["model"])
    torch.save(opt.state_dict(), paths["optim"])
    steps(m, opt, range(2, 4))
    code = _RESUME.format(tests=str(ROOT / "tests"), **paths)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _same([p.detach().cpu() for p in m.parameters()], torch.load(paths["out"]))


# -- no storage: the bindings (item 3) ------------------------------------------------------------------------


def _pair(device, twin: bool):
    """Ours (eager) and, with ``twin``, torch.optim's AdamW (for-loop: its one path without a DirectML fallback)
    over two equal models."""
    models = [_model(torch.float32, device) for _ in range(2 if twin else 1)]
    opts = [build("adamw", models[0].parameters(), lr=1e-2, backend="eager")]
    if twin:
        opts.append(torch.optim.AdamW(models[1].parameters(), lr=1e-2, foreach=False))
    return models, opts


def _iterate(models, opts, i, between=None):
    held = None
    for m, opt in zip(models, opts):
        opt.zero_grad(set_to_none=False)
        _loss(m, _batch(i, torch.float32, next(m.parameters()).device)).backward()
    if between is not None:
        held = [between(m) for m in models]
    opts[0].step()
    with standin.configured(strict=False):  # (torch's for-loop AdamW: DirectML runs its lerp_ on the CPU)
        for opt in opts[1:]:
            opt.step()
    return held


def _run_pair(device, between, twin: bool):
    models, opts = _pair(device, twin)
    _iterate(models, opts, 0)
    held = _iterate(models, opts, 1, between)  # noqa: F841 - (what the loop holds stays alive through the step)
    _iterate(models, opts, 2)
    return [[p.detach().cpu() for p in m.parameters()] for m in models]


def _fresh(m):
    w = m[0].weight
    w.data = w.detach().clone() * 0.5  # a weight loader: a tensor of its own (offset 0)


def _held_fresh(m):
    backup = m[0].weight.detach()  # the old weights kept ...
    m[0].weight.data = backup.clone() * 0.5  # ... while the parameter gets a tensor of its own
    return backup


def _alias(m):
    m[2].bias.data = m[0].bias.data[:40]  # a view of the buffer at another parameter's place (p1.data = p2.data)


def _other_buffer(m):
    other = _model(torch.float32, m[0].weight.device, seed=3)
    keep = build("adamw", other.parameters(), lr=1e-2)  # another optimizer's buffer, its first parameter ...
    m[0].weight.data = other[0].weight.data  # ... shared by .data, as EMA code does
    return keep, other


def _grads_kept(m):
    kept = [p.grad for p in m.parameters()]  # a logger keeps the gradients ...
    m[2].weight.grad = None  # ... and one parameter gets none this step
    return kept


def _grad_replaced(m):
    m[2].weight.grad = m[2].weight.grad * 0.25  # a masked gradient


@pytest.mark.parametrize("between", [_fresh, _held_fresh, _alias, _other_buffer, _grads_kept, _grad_replaced],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_rebinding_is_seen_and_followed(dev, between):
    """Each re-binding a training loop makes between steps, on a device without storage: ours sees it (the storage
    offsets, the gradients' identities and the views alive) and does what it does on the CPU, where data pointers
    and storage counts show it, bit for bit; and, where torch.optim's semantics are the same (every case but the
    alias, which the optimizer copies out of the place it shares), what torch.optim does on the device."""
    ours = _run_pair(dev, between, twin=between is not _alias)
    with laid_out_as("privateuseone"):
        cpu = _run_pair(torch.device("cpu"), between, twin=False)
    assert _same(ours[0], cpu[0])
    if between is not _alias:
        for p, q in zip(*ours):
            torch.testing.assert_close(p, q)


def test_a_dtype_change_is_followed(dev):
    """``model.half()`` (each parameter re-bound to a new tensor, at offset 0 of its own): the optimizer re-packs and
    steps the parameters the model holds, as after the same change on the CPU.  (``model.to("cpu")`` cannot be
    followed on DirectML: torch cannot re-point a DirectML parameter at CPU memory, so the module gets new
    Parameter objects, which neither torch.optim nor ours holds; docs/guide/directml-on-linux.md says so.)"""
    def run(device):
        m = _model(torch.float32, device)
        opt = build("adamw", m.parameters(), lr=1e-2, eps=1e-4, backend="eager")
        for i in range(3):
            if i == 1:
                m.half()
            opt.zero_grad()
            _loss(m, _batch(i, next(m.parameters()).dtype, device)).backward()
            opt.step()
        return m, opt

    m, opt = run(dev)
    with laid_out_as("privateuseone"):
        cpu, _ = run(torch.device("cpu"))
    assert {info.dtype for info in opt.flat_buffers()} == {torch.float16}
    assert _same([p.detach().cpu() for p in m.parameters()], [p.detach() for p in cpu.parameters()])


def test_a_bucket_view_that_cannot_be_told_apart_is_refused(dev):
    """Every parameter re-bound to consecutive slices of one tensor, as
    ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does (torch.distributed has no DirectML backend, so
    this is the layout alone): on a device without storage nothing shows whether they share memory, so neither
    adopting it nor copying back into the buffer is safe: refused, naming the way out, nothing written."""
    m = _model(torch.float32, dev)
    opt = build("adamw", m.parameters(), lr=1e-2)
    _loss(m, _batch(0, torch.float32, dev)).backward()
    opt.step()
    params = list(m.parameters())
    bucket = torch.cat([p.detach().reshape(-1) for p in params])
    start = 0
    for p in params:
        p.data = bucket[start:start + p.numel()].view(p.shape)
        start += p.numel()
    before = bucket.clone()
    with pytest.raises(RuntimeError, match="cannot tell whether they share memory"):
        opt.step()
    assert torch.equal(bucket.cpu(), before.cpu())


def test_a_deepcopy_is_a_working_optimizer_of_its_own(dev):
    """``copy.deepcopy`` of the optimizer (with its parameters): each copied parameter is a view of the copy's flat
    buffer again, and the two step independently, each as the original would."""
    m = _model(torch.float32, dev)
    opt = build("adamw", m.parameters(), lr=1e-2)
    _loss(m, _batch(0, torch.float32, dev)).backward()
    opt.step()
    m2, opt2 = copy.deepcopy((m, opt))
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        _loss(model, _batch(1, torch.float32, dev)).backward()
        o.step()
    assert _same([p.detach().cpu() for p in m.parameters()], [p.detach().cpu() for p in m2.parameters()])
    m2[0].weight.data.zero_()  # (a write through the copy's parameter reaches the copy's buffer, not the original's)
    assert bool((opt2.flat_buffers()[0].data[: m2[0].weight.numel()] == 0).all())
    assert not bool((opt.flat_buffers()[0].data[: m[0].weight.numel()] == 0).all())


def test_the_step_inside_backward_refuses_a_rebinding_it_did_not_see(dev):
    m = _model(torch.float32, dev)
    opt = build("adamw", m.parameters(), lr=1e-2)
    handle = step_in_backward(opt)
    _loss(m, _batch(0, torch.float32, dev)).backward()
    opt.zero_grad(set_to_none=True)
    _fresh(m)
    with pytest.raises(RuntimeError, match="re-bound"):
        _loss(m, _batch(1, torch.float32, dev)).backward()
    opt.zero_grad(set_to_none=True)
    handle.refresh()
    _loss(m, _batch(1, torch.float32, dev)).backward()
    assert handle.steps >= 2


# -- DirectML's other facts ------------------------------------------------------------------------------------


def test_bfloat16_states_are_refused_naming_float16(dev):
    p = torch.nn.Parameter(torch.zeros(8, device=dev))
    with pytest.raises(ValueError, match=r'state_dtype=torch.bfloat16: DirectML has no bfloat16.*rounding="stochastic"'):
        dml_optim.AdamW([p], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16: DirectML has no bfloat16"):
        dml_optim.AdamW([p], compute_dtype=torch.bfloat16)


def test_stochastic_rounding_needs_no_device_generator(dev):
    """A plugin without a device generator (before torch-directml 0.2.5): stochastic rounding's numbers are
    counter-based, so the run is the CPU's bit for bit."""
    with standin.configured(generator=False):
        with pytest.raises(RuntimeError, match="not supported for torch.Generator"):
            torch.Generator(device=dev)
        ours, _ = _train("adamw", "stochastic-rounding", 8, "auto", True, dev)
    with laid_out_as("privateuseone"):
        cpu, _ = _train("adamw", "stochastic-rounding", 8, "eager", True, torch.device("cpu"))
    assert _same(ours, cpu)


def test_the_main_job_trains_on_the_standin_as_on_the_cpu(dev):
    """``dml-optim train``'s job on the stand-in: the CPU's eager run bit for bit (the same accuracy), and the
    stand-in's count of fallbacks over the whole run (forward, backward, steps) is 0."""
    from dml_optim.job.train import TrainConfig, train

    config = TrainConfig(optimizer="adamw", steps=200)
    ours = train(config, device=dev, audit=False)
    assert ours.directml_fallbacks == {}
    cpu = train(config, device="cpu", audit=False)
    assert cpu.directml_fallbacks is None
    assert abs(ours.test_accuracy - cpu.test_accuracy) <= 0.01, (ours.test_accuracy, cpu.test_accuracy)


def test_the_environment_variable_picks_the_standin(dev):
    """``DML_OPTIM_STANDIN=1``: ``dml_optim.device()`` is the stand-in, and ``dml-optim train`` trains there."""
    env = {**os.environ, "DML_OPTIM_STANDIN": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "import dml_optim; print(dml_optim.device())"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "privateuseone:0", done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "dml_optim", "train", "--steps", "50", "--optimizer", "adamw"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device: privateuseone:0 (the stand-in DirectML device" in done.stdout
    assert "CPU fallbacks, whole run (stand-in)  0" in done.stdout
    done = subprocess.run([sys.executable, "-m", "dml_optim", "train", "--dtype", "bfloat16"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 2 and "--dtype float16 --rounding stochastic" in done.stderr


def test_the_audit_of_a_training_iteration_counts_forward_backward_and_step(dev, capsys, monkeypatch):
    """``DML_OPTIM_STANDIN=1 dml-optim audit --training``: the main job's forward, backward and step recorded on the
    stand-in, each resolved with the dispatch table, and the stand-in's own count of what ran on the CPU beside it:
    0 for ours, torch.optim's ``lerp_`` per parameter for its foreach AdamW (6 parameters)."""
    import json

    from dml_optim.cli import main

    monkeypatch.setenv("DML_OPTIM_STANDIN", "1")
    with standin.configured(strict=False):  # (torch.optim's foreach AdamW falls back: counted, not refused)
        assert main(["audit", "--optimizer", "adamw", "--training", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device"] == "privateuseone:0"
    assert d["ours"]["forward_backward"]["fallback_ops"] == 0 and d["ours"]["step"]["fallback_ops"] == 0
    assert d["ours"]["standin_fallbacks"] == {}
    assert d["torch"]["step"]["fallbacks"] == [{"op": "aten::lerp_.Scalar", "count": 6}]
    assert d["torch"]["standin_fallbacks"] == {"aten::lerp.Scalar_out": 6}
    assert d["ours"]["step"]["total_ops"] < d["torch"]["step"]["total_ops"]


def test_a_fallback_in_a_forward_is_counted_by_the_table_and_by_the_standin(dev):
    """A model whose forward uses an op DirectML runs on the CPU (``torch.lerp``): the audit's table resolution and
    the stand-in's count agree on it, forward and backward (``lerp``'s backward is native)."""
    from dml_optim.audit import audit_call

    w = torch.nn.Parameter(torch.randn(8, device=dev))
    x = torch.randn(8, device=dev)
    opt = build("adamw", [w], lr=1e-2)
    with standin.configured(strict=False):
        standin.reset()
        report = audit_call(opt, lambda: torch.lerp(x, w, 0.5).square().sum().backward())
        counted = standin.fallbacks()
    assert report.fallback_ops == 1 and counted == {"aten::lerp.Scalar_out": 1}, (report.fallbacks, counted)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_lean_configuration_runs_on_directml(dev, bits):
    """The lean configuration DirectML runs (issue 49): float16 parameters, stochastic rounding, 8-bit or 4-bit
    state, the step inside backward with dynamic loss scaling inside it.  Under ``strict`` and ``float64=False``:
    no fallback and no float64 in forward, backward and the runs' steps, and the CPU's run bit for bit."""
    def run(device):
        m = _model(torch.float16, device)
        torch.manual_seed(5)
        opt = build("adamw", m.parameters(), lr=1e-2, eps=1e-4, state_bits=bits, rounding="stochastic")
        scaler = dml_optim.DynamicLossScaler(init_scale=2.0**12)
        handle = step_in_backward(opt, run_bytes=0, scaler=scaler)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        for i in range(4):
            scaler.scale(_loss(m, _batch(i, torch.float16, device))).backward()
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
        assert handle.steps >= 4
        return [p.detach().to("cpu") for p in m.parameters()], scaler.get_scale()

    ours, scale = run(dev)
    assert standin.fallbacks() == {} and standin.unknown() == {}
    with laid_out_as("privateuseone"):
        cpu, cpu_scale = run(torch.device("cpu"))
    assert scale == cpu_scale and _same(ours, cpu)
