"""The step inside backward (dml_optim/training/backward.py, a prototype on the optimizer's public API).

Bit for bit against a plain loop (forward, backward, step, zero_grad(set_to_none=True)) for every optimizer
on the backend the prototype takes (torch's fused kernels: the CPU's default for float32/float64), whatever
the run size, with a scheduler, unused and frozen parameters; state_dict equal; the refusals at setup.
"""

from __future__ import annotations

import pytest
import torch

from dml_optim.optimizers.registry import OPTIMIZERS, build
from dml_optim.training.backward import StepInBackward, step_in_backward


class _Net(torch.nn.Module):
    """Two linear layers, a LayerNorm, a head used every step and a side head used every other step."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.b = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, 8)
        self.side = torch.nn.Linear(d, 8)

    def forward(self, x, side: bool):
        h = torch.relu(self.b(torch.relu(self.norm(self.a(x)))))
        return self.head(h) + (self.side(h) if side else 0)


def _net(dtype=torch.float32, freeze: bool = False) -> _Net:
    torch.manual_seed(0)
    net = _Net().to(dtype)
    if freeze:
        net.a.requires_grad_(False)
    return net


def _batch(i: int, dtype):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 64, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)


def _train(net, opt, steps: int, dtype, *, inside: bool, scheduler=None):
    for i in range(steps):
        x, y = _batch(i, dtype)
        loss = torch.nn.functional.mse_loss(net(x, side=i % 2 == 1), y)
        loss.backward()
        if not inside:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name, run_bytes", [(name, 0) for name in OPTIMIZERS] + [("adamw", None), ("adamw", 1 << 30)],
                         ids=[f"{name}-one-parameter-runs" for name in OPTIMIZERS] + ["adamw-default-runs", "adamw-one-run"])
def test_equals_the_plain_step_bit_for_bit(name, run_bytes):
    """Every optimizer, float32, with a scheduler and a head used every other step (a run left incomplete steps
    at the end of backward): the parameters and the state_dict equal the plain loop's, bit for bit."""
    dtype = torch.float32
    plain, inside = _net(dtype), _net(dtype)
    opt_a = build(name, list(plain.parameters()), lr=1e-2)
    opt_b = build(name, list(inside.parameters()), lr=1e-2)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    handle = step_in_backward(opt_b, run_bytes=run_bytes)
    _train(plain, opt_a, 5, dtype, inside=False, scheduler=sched_a)
    _train(inside, opt_b, 5, dtype, inside=True, scheduler=sched_b)
    assert handle.steps >= 5
    assert _same(plain, inside)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][k][key])), (k, key)
    assert all(p.grad is None for p in inside.parameters())


def test_float64_frozen_parameters_and_runs():
    """float64 and a frozen first layer (no hook, never stepped); the runs cover the trainable parameters in
    the buffer's order, a bias joining the weight after it."""
    dtype = torch.float64
    plain, inside = _net(dtype, freeze=True), _net(dtype, freeze=True)
    opt_a = build("adamw", [p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    opt_b = build("adamw", [p for p in inside.parameters() if p.requires_grad], lr=1e-2)
    handle = step_in_backward(opt_b, run_bytes=64 * 64 * 8)
    frozen = inside.a.weight.detach().clone()
    _train(plain, opt_a, 4, dtype, inside=False)
    _train(inside, opt_b, 4, dtype, inside=True)
    assert _same(plain, inside)
    assert torch.equal(inside.a.weight, frozen)
    ordered = [p for run in handle.runs for p in run.params]
    assert ordered == [p for p in inside.parameters() if p.requires_grad]  # the buffer's order, every one once


def test_runs_are_cut_by_bytes_and_small_runs_join_a_neighbour():
    """A run closes once half full when the next parameter would overflow it; a run averaging fewer elements
    than the fused backend reads in place joins its neighbour (gathered, it would allocate the flat gradient
    buffer)."""
    from dml_optim.backends.fused import LIST_MIN_ELEMENTS

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
                              torch.nn.Linear(256, 8))
    opt = build("adamw", list(net.parameters()), lr=1e-3)
    handle = step_in_backward(opt, run_bytes=256 * 256 * 4)
    assert [p for run in handle.runs for p in run.params] == list(net.parameters())
    assert len(handle.runs) >= 2
    for run in handle.runs:  # no run of small parameters only; at most one parameter of run_bytes
        assert any(p.numel() >= LIST_MIN_ELEMENTS for p in run.params)
        assert sum(p.numel() * 4 >= handle.run_bytes for p in run.params) <= 1
    assert handle.runs[0].params == [net[0].weight]


def test_step_after_backward_is_a_no_op_and_remove_restores_the_plain_loop():
    net = _net()
    opt = build("adamw", list(net.parameters()), lr=1e-2)
    handle = step_in_backward(opt)
    x, y = _batch(0, torch.float32)
    torch.nn.functional.mse_loss(net(x, side=False), y).backward()
    after = [p.detach().clone() for p in net.parameters()]
    opt.step()  # no gradient is left: nothing steps
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), after))
    handle.remove()
    torch.nn.functional.mse_loss(net(x, side=False), y).backward()
    assert net.head.weight.grad is not None  # no hook took it
    opt.step()
    assert not torch.equal(net.head.weight, after[4])


def test_gradients_of_a_large_model_never_reach_a_flat_gradient_buffer():
    """Parameters of 64k elements: the fused backend reads each run's gradients where they are, so the flat
    gradient buffer is never allocated (gradient memory: the runs), and the parameters still equal the plain
    loop's."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))

    plain, inside = make(), make()
    opt_a = build("adamw", list(plain.parameters()), lr=1e-3)
    opt_b = build("adamw", list(inside.parameters()), lr=1e-3)
    step_in_backward(opt_b)
    x = torch.randn(8, 256)
    for _ in range(3):
        plain(x).square().mean().backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        inside(x).square().mean().backward()
        opt_b.zero_grad(set_to_none=False)  # None gradients stay None: nothing allocated
    assert _same(plain, inside)
    assert all(info.grad is None for info in opt_b.flat_buffers())


def _opt(**options):
    return build("adamw", list(_net().parameters()), lr=1e-2, **options)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_norm=1.0), "global-norm clipping"),
    (dict(accumulation_steps=4), "every backward steps"),
    (dict(scaler=object()), "loss scaler"),
])
def test_refused_at_setup(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_in_backward(_opt(), **kwargs)


def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match='nonfinite="skip"'):
        step_in_backward(_opt(nonfinite="skip"))
    with pytest.raises(TypeError, match="dml_optim optimizer"):
        step_in_backward(torch.optim.AdamW(_net().parameters()))
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        step_in_backward(_opt(), model=ddp)
    with pytest.raises(ValueError, match="run_bytes"):
        step_in_backward(_opt(), run_bytes=-1)


@pytest.mark.parametrize("options", [dict(backend="eager"), dict(state_bits=8), dict(backend="compiled")],
                         ids=["eager", "8-bit", "compiled"])
def test_backends_that_re_pack_are_refused_until_the_planner_steps_ranges(options):
    """The eager and compiled backends re-pack a buffer whose stepping parameters are in pieces (every run's
    case), moving parameters backward still reads: refused at setup, naming the backend and what to do."""
    with pytest.raises(ValueError, match="re-pack.*optimizer.step\\(\\) after backward"):
        step_in_backward(_opt(**options))


def test_handle_is_a_context_manager():
    opt = _opt()
    with step_in_backward(opt) as handle:
        assert isinstance(handle, StepInBackward) and handle._handles
    assert not handle._handles
