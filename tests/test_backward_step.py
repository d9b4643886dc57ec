"""The step inside backward (dml_optim/training/backward.py; EngineMixin.step_run).

Bit for bit against a plain loop (forward, backward, step, zero_grad(set_to_none=True)) for every optimizer,
on every backend (torch's fused kernels, the eager rule: DirectML's path, the compiled kernel) and precision
mode (low-bit states, float16/bfloat16 with Kahan summation or master weights), whatever the run size, with a
scheduler, unused and frozen parameters; state_dict equal; no flat gradient buffer, nothing re-packed;
stochastic rounding reproducible; the refusals at setup and the changes a backward refuses.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dml_optim.core.quant import BLOCK
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


def test_step_counts_of_several_runs_on_the_default_backend_follow_torch():
    """The step counts under the step inside backward, checked against counts kept by other code: the test's own
    (each parameter steps once per backward that reaches it) and torch.optim's.  The bit-for-bit tests above compare
    with a plain step that runs the same counting code, so a count both get wrong passes there.

    The CPU's default backend (``auto``: torch's fused kernel over each run), a model cut into two runs or more,
    a side head used every other backward (its run steps at the end of backward with what it has), a scheduler.
    A wrong count changes the bias correction (``1 - beta**t``), which moves a parameter by far more than the
    tolerance: torch's for-loop AdamW and the fused kernel round differently, by a few float32 ulps a step, which
    ``assert_close``'s float32 default (rtol 1.3e-6, atol 1e-5) holds over these 6 steps."""
    dtype, d = torch.float32, 128  # (weights of 16k elements: runs of their own, not merged as small ones)
    nets = []
    for _ in range(2):
        torch.manual_seed(0)
        nets.append(_Net(d))
    ours_net, torch_net = nets
    opt = build("adamw", list(ours_net.parameters()), lr=1e-2)
    twin = torch.optim.AdamW(list(torch_net.parameters()), lr=1e-2, foreach=False)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + s)) for o in (opt, twin)]
    handle = step_in_backward(opt, run_bytes=d * d * 4)
    assert len(handle.runs) >= 2, [len(r.params) for r in handle.runs]
    steps = 6
    expected = {}
    for i in range(steps):
        side = i % 2 == 1
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, d, generator=g), torch.randn(16, 8, generator=g)
        for net, o in ((ours_net, opt), (torch_net, twin)):
            torch.nn.functional.mse_loss(net(x, side=side), y).backward()
            if o is twin:
                o.step()
            o.zero_grad(set_to_none=True)
        for name, _ in ours_net.named_parameters():
            expected[name] = expected.get(name, 0) + (1 if side or not name.startswith("side.") else 0)
        for s in scheds:
            s.step()
    assert handle.steps >= 2 * steps
    names = [n for n, _ in ours_net.named_parameters()]
    ours_state, torch_state = opt.state_dict()["state"], twin.state_dict()["state"]
    for k, name in enumerate(names):
        assert float(ours_state[k]["step"]) == expected[name] == float(torch_state[k]["step"]), name
    for (name, p), q in zip(ours_net.named_parameters(), torch_net.parameters()):
        torch.testing.assert_close(p, q, msg=name)


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
    than SMALL_RUN_ELEMENTS joins its neighbour (a step of its own would cost a whole step's dispatches)."""
    from dml_optim.training.backward import SMALL_RUN_ELEMENTS

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
                              torch.nn.Linear(256, 8))
    opt = build("adamw", list(net.parameters()), lr=1e-3)
    handle = step_in_backward(opt, run_bytes=256 * 256 * 4)
    assert [p for run in handle.runs for p in run.params] == list(net.parameters())
    assert len(handle.runs) >= 2
    for run in handle.runs:  # no run of small parameters only; at most one parameter of run_bytes
        assert any(p.numel() >= SMALL_RUN_ELEMENTS for p in run.params)
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
    (dict(max_norm=1.0), r"global-norm clipping by this backward's norm .* clip_by=\"previous_norm\""),
    (dict(clip_by="previous_norm"), "needs max_norm"),
    (dict(max_norm=1.0, clip_by="current_norm"), "clip_by must be None or one of"),
    (dict(max_norm=-1.0, clip_by="previous_norm"), "max_norm must be >= 0"),
    (dict(max_norm=float("inf"), clip_by="previous_norm"), "max_norm must be finite"),
    (dict(accumulation_steps=4), "every backward steps"),
    (dict(scaler=object()), "pass a dml_optim.DynamicLossScaler"),
    (dict(scaler=torch.amp.GradScaler("cpu")), r"scaler=GradScaler: .* pass a dml_optim.DynamicLossScaler"),
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


def _wide_net(dtype):
    torch.manual_seed(0)
    return _Net(128).to(dtype)


def _wide_batch(i: int, dtype):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 128, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)


def _train_wide(net, opt, steps: int, dtype, *, inside: bool, scheduler=None):
    for i in range(steps):
        x, y = _wide_batch(i, dtype)
        # (the loss in float32: torch 2.4's CPU mse_loss has no float16/bfloat16 kernel)
        torch.nn.functional.mse_loss(net(x, side=i % 2 == 1).float(), y.float()).backward()
        opt.step()  # (inside backward: nothing is left to step)
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


_BACKENDS = [
    ("adamw", torch.float32, dict(backend="eager")),
    ("adam", torch.float32, dict(backend="eager")),
    ("dml-adam", torch.float32, dict(backend="eager")),
    ("adagrad", torch.float32, dict(backend="eager")),
    ("momentum", torch.float32, dict(backend="eager")),
    ("sgd", torch.float32, dict(backend="eager")),
    ("adamw", torch.float32, dict(backend="eager", state_bits=8)),
    ("adamw", torch.float32, dict(backend="eager", state_bits=4)),
    ("adam", torch.float32, dict(backend="eager", state_bits=8)),
    ("adagrad", torch.float32, dict(backend="eager", state_bits=4)),
    ("momentum", torch.float32, dict(backend="eager", state_bits=8)),
    ("dml-adam", torch.float32, dict(backend="eager", state_bits=4)),
    ("adamw", torch.float32, dict(state_bits=8)),
    ("adamw", torch.bfloat16, dict(backend="eager", kahan=True, state_bits=8)),
    ("adamw", torch.bfloat16, dict(backend="eager", master_weights=True)),
    ("adamw", torch.float16, dict(backend="eager", kahan=True)),
    ("adamw", torch.float64, dict(backend="eager")),
    pytest.param("adamw", torch.float32, dict(backend="compiled"), marks=pytest.mark.slow),
    pytest.param("adamw", torch.float32, dict(backend="compiled", state_bits=8), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, dtype, options", _BACKENDS,
                         ids=[f"{p.values[0] if hasattr(p, 'values') else p[0]}-"
                              f"{str((p.values if hasattr(p, 'values') else p)[1]).replace('torch.', '')}-"
                              + "-".join(f"{k}={v}" for k, v in (p.values if hasattr(p, "values") else p)[2].items())
                              for p in _BACKENDS])
@pytest.mark.parametrize("run_bytes", [0, 1 << 30], ids=["runs", "one-run"])
def test_every_backend_equals_the_plain_step_bit_for_bit(name, dtype, options, run_bytes):
    """The eager rule (DirectML's path), the compiled kernel and low-bit states step a run in place, reading
    its gradients from a window the size of the run, under a scheduler changing lr every step: parameters and
    state_dict equal the plain loop's bit for bit; no flat gradient buffer exists, no parameter moved, the
    window holds the largest run only."""
    plain, inside = _wide_net(dtype), _wide_net(dtype)
    opt_a = build(name, list(plain.parameters()), lr=1e-3, **options)
    opt_b = build(name, list(inside.parameters()), lr=1e-3, **options)
    warmup = lambda step: (step + 1) / 4  # noqa: E731  (a new lr every step)
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, warmup)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, warmup)
    handle = step_in_backward(opt_b, run_bytes=run_bytes)
    before = [p.data_ptr() for p in inside.parameters()]
    _train_wide(plain, opt_a, 4, dtype, inside=False, scheduler=sched_a)
    _train_wide(inside, opt_b, 4, dtype, inside=True, scheduler=sched_b)
    assert handle.steps >= 4
    assert [p.data_ptr() for p in inside.parameters()] == before  # (nothing re-packed)
    for p, q in zip(plain.parameters(), inside.parameters()):
        assert _equal(p, q)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for k, st in sa["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                assert _equal(v, sb["state"][k][key]), (k, key)
    infos = opt_b.flat_buffers()
    assert all(info.grad is None for info in infos)  # (no gradient buffer of the model's size)
    for k, info in enumerate(infos):
        if info.backend == "fused":
            assert info.window is None  # (torch's kernel reads the gradients where autograd left them)
            continue
        # (the largest run's elements, each parameter's block padding, the zero element)
        largest = max(sum(p.numel() + max(BLOCK.values()) - 1 for p in run.params) for run in handle.runs if run.buffer == k)
        assert info.window is not None and info.window.numel() <= largest + 1
    if run_bytes == 0:
        assert len(handle.runs) > len(infos)  # (several runs per buffer: the window is a run's, not the model's)
    handle.remove()
    assert all(info.window is None for info in opt_b.flat_buffers())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_steps_inside_backward_bit_for_bit(dtype):
    """float16 (DirectML's half format) and bfloat16 parameters, rounding="stochastic" and 8-bit states: the
    rounding's numbers are keyed on (seed, step count, element), not drawn in the order the runs step in, so the
    step inside backward equals the plain loop bit for bit, and runs under one seed are equal."""
    def trained(seed: int, inside: bool = True):
        net = _wide_net(dtype)
        torch.manual_seed(seed)  # (the optimizer's seed: torch.initial_seed() when it is built)
        opt = build("adamw", list(net.parameters()), lr=1e-3, rounding="stochastic", state_bits=8)
        if inside:
            handle = step_in_backward(opt, run_bytes=0)
            assert len(handle.runs) >= 2
        _train_wide(net, opt, 4, dtype, inside=inside)
        return net

    a, b, plain, other = trained(1), trained(1), trained(1, inside=False), trained(2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), a.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(other.parameters(), a.parameters()))


@pytest.mark.parametrize("options, match", [
    (dict(nonfinite="raise"), 'nonfinite="raise"'),
    (dict(atomic=True), "atomic=True"),
    (dict(capturable=True), "capturable=True"),
])
def test_whole_step_options_are_refused_at_setup(options, match):
    with pytest.raises(ValueError, match=match):
        step_in_backward(_opt(backend="eager", **options))


def test_a_backward_after_freezing_or_re_binding_without_refresh_raises():
    """Frozen after setup, or re-bound: the runs no longer match the model; the next backward raises, naming
    refresh(), and after refresh() the loop goes on equal to the plain one."""
    plain, inside = _wide_net(torch.float32), _wide_net(torch.float32)
    opt_a = build("adamw", list(plain.parameters()), lr=1e-3, backend="eager")
    opt_b = build("adamw", list(inside.parameters()), lr=1e-3, backend="eager")
    handle = step_in_backward(opt_b, run_bytes=0)
    _train_wide(plain, opt_a, 2, torch.float32, inside=False)
    _train_wide(inside, opt_b, 2, torch.float32, inside=True)
    for net in (plain, inside):
        net.side.requires_grad_(False)
    x, y = _wide_batch(5, torch.float32)
    with pytest.raises(RuntimeError, match="refresh"):
        torch.nn.functional.mse_loss(inside(x, side=False), y).backward()
    opt_b.zero_grad(set_to_none=True)
    handle.refresh()
    _train_wide(plain, opt_a, 2, torch.float32, inside=False)
    _train_wide(inside, opt_b, 2, torch.float32, inside=True)
    assert _same(plain, inside)
    inside.head.weight.data = inside.head.weight.data.clone()  # re-bound away from the flat buffer
    with pytest.raises(RuntimeError, match="re-bound.*refresh"):
        torch.nn.functional.mse_loss(inside(x, side=False), y).backward()


def test_handle_is_a_context_manager():
    opt = _opt()
    with step_in_backward(opt) as handle:
        assert isinstance(handle, StepInBackward) and handle.installed
    assert not handle.installed


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_main_job_in_half_precision_with_stochastic_rounding_8_bit_state_and_the_step_inside_backward(dtype):
    """The lean configuration on the main job (``dml-optim train --optimizer adamw --dtype float16 --rounding
    stochastic --state-bits 8 --step-in-backward``; float16 scales its loss inside backward, what DirectML runs;
    bfloat16 for reference, not on DirectML): within 1.0 point of FP32's held-out accuracy."""
    from dml_optim.job.train import TrainConfig, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = train(TrainConfig(optimizer="adamw"), audit=False).test_accuracy
        lean = train(TrainConfig(optimizer="adamw", dtype=dtype, rounding="stochastic", state_bits=8,
                                 step_in_backward=True), audit=False)
    finally:
        torch.set_num_threads(threads)
    assert lean.param_dtype == dtype and lean.state_dtype.startswith("8-bit")
    assert (lean.loss_scale is not None) == (dtype == "float16")  # (float16: scaled inside backward)
    assert 100 * (fp32 - lean.test_accuracy) <= 1.0, (fp32, lean.test_accuracy)


def test_the_main_job_refuses_what_the_step_inside_backward_cannot_do():
    from dml_optim.job.train import TrainConfig

    with pytest.raises(ValueError, match="step_in_backward with dtype='mixed'"):
        TrainConfig(dtype="mixed", step_in_backward=True).validated()
    with pytest.raises(ValueError, match="rounding='stochastic'"):
        TrainConfig(rounding="stochastic").validated()


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_a_gradient_unlike_its_parameter_raises_before_anything_is_written(backend):
    """A run handed a gradient of another shape: TypeError naming both shapes, on torch's kernel's path and on
    the window's; the parameters and states are as they were."""
    net = _wide_net(torch.float32)
    opt = build("adamw", list(net.parameters()), lr=1e-3, backend=backend)
    handle = step_in_backward(opt, run_bytes=0)
    _train_wide(net, opt, 1, torch.float32, inside=True)
    before = [p.detach().clone() for p in net.parameters()]
    states = {k: {n: v.clone() for n, v in st.items() if isinstance(v, torch.Tensor)}
              for k, st in opt.state_dict()["state"].items()}
    buffer, position = handle.position_of(net.head.weight)
    with pytest.raises(TypeError, match=r"\(8, 64\).*unlike the parameter \(\(8, 128\)"):
        opt.step_run(buffer, {position: torch.zeros(8, 64)})
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    for k, st in opt.state_dict()["state"].items():
        for n, v in states[k].items():
            assert torch.equal(st[n], v)


def test_a_backward_whose_step_raises_leaves_the_next_backward_a_fresh_start():
    """A run's step raising (an lr that does not validate) ends that backward with the error; after the setting
    is fixed, the next backward checks, steps every run and flushes the incomplete one, as a fresh one does."""
    net = _wide_net(torch.float32)
    opt = build("adamw", list(net.parameters()), lr=1e-3, backend="eager")
    handle = step_in_backward(opt, run_bytes=0)
    opt.param_groups[0]["lr"] = -1.0
    x, y = _wide_batch(0, torch.float32)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="lr"):
        torch.nn.functional.mse_loss(net(x, side=True), y).backward()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))  # (the first run raised: none stepped)
    assert all(not run.pending for run in handle.runs)
    opt.param_groups[0]["lr"] = 1e-3
    opt.zero_grad(set_to_none=True)
    steps = handle.steps
    torch.nn.functional.mse_loss(net(x, side=False), y).backward()  # (the side head's run stays incomplete)
    assert handle.steps - steps == len(handle.runs) - sum(all(p in set(net.side.parameters()) for p in run.params)
                                                          for run in handle.runs)
    assert all(p.grad is None for p in net.parameters())
    assert not torch.equal(net.head.weight, before[6])


# -- loss scaling inside backward (issue 49) -------------------------------------------------------------------


def _scaled_loop(dtype, *, inside: bool, steps: int = 5, init_scale: float = 2.0**10, state_bits=None,
                 rounding: str = "nearest", batches=None):
    """The wide net, AdamW (eager: DirectML's path), a LambdaLR, and a DynamicLossScaler: stepped inside backward
    (the scaler told to the handle) or after it (``scaler.step``); ``(net, optimizer, scaler, handle, warnings)``."""
    import warnings

    import dml_optim

    net = _wide_net(dtype)
    torch.manual_seed(3)
    opt = build("adamw", list(net.parameters()), lr=1e-3, eps=1e-4, backend="eager", state_bits=state_bits,
                rounding=rounding)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    scaler = dml_optim.DynamicLossScaler(init_scale=init_scale)
    handle = step_in_backward(opt, run_bytes=0, scaler=scaler) if inside else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            x, y = batches(i) if batches is not None else _wide_batch(i, dtype)
            loss = torch.nn.functional.mse_loss(net(x, side=i % 2 == 1).float(), y.float())
            scaler.scale(loss).backward()
            if not inside:
                scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
    return net, opt, scaler, handle, [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_loss_scaling_inside_backward_equals_the_plain_scaled_loop(dtype):
    """``step_in_backward(opt, scaler=DynamicLossScaler())``: each run unscaled, checked and gated on the device as
    its gradients arrive.  Without an overflow every run steps: the parameters equal the plain loop's
    (``scaler.step(opt)``, the same gated rule) bit for bit, and a LambdaLR stepping after each backward gets no
    torch warning that it came before the optimizer's step."""
    plain, _, _, _, _ = _scaled_loop(dtype, inside=False)
    inside, opt, scaler, handle, caught = _scaled_loop(dtype, inside=True)
    assert len(handle.runs) >= 2 and handle.steps >= 10
    assert _same(plain, inside)
    assert not [w for w in caught if "lr_scheduler.step()" in w], caught
    assert scaler.get_scale() == 2.0**10


def test_a_run_that_overflows_is_skipped_alone_and_the_scale_backs_off():
    """float16, one parameter's gradient overflowed (inf, as a too-large scale makes it; set by a gradient hook so
    that exactly one run holds it): that run changes nothing (its parameters, states and step counts as they were),
    the other runs step, the scaler is told, and ``update()`` halves the scale; no host sync and no CPU fallback
    during backward (each run's flag stays on the device until the scaler's update reads it)."""
    import dml_optim
    from dml_optim.audit import audit_call

    net = _wide_net(torch.float16)
    opt = build("adamw", list(net.parameters()), lr=1e-3, eps=1e-4, backend="eager")
    scaler = dml_optim.DynamicLossScaler(init_scale=2.0**10)
    handle = step_in_backward(opt, run_bytes=0, scaler=scaler)
    assert len(handle.runs) >= 2
    overflowed = net.b.weight
    overflowed.register_hook(lambda g: torch.full_like(g, float("inf")))
    skipped_run = next(run for run in handle.runs if any(p is overflowed for p in run.params))
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _wide_batch(0, torch.float16)
    loss = torch.nn.functional.mse_loss(net(x, side=True).float(), y.float())
    report = audit_call(opt, lambda: scaler.scale(loss).backward())
    assert report.host_syncs == 0 and report.fallback_ops == 0
    for k, (p, b) in enumerate(zip(net.parameters(), before)):
        in_skipped = any(p is q for q in skipped_run.params)
        assert torch.equal(p, b) == in_skipped, k
        state = opt.state_dict()["state"].get(k, {})
        assert float(state.get("step", 0)) == (0.0 if in_skipped else 1.0), (k, state.get("step"))
    assert float(scaler.step(opt)) == 1.0  # (one run skipped, as the scaler was told; nothing stepped again)
    scaler.update()
    assert scaler.get_scale() == 2.0**9


def test_loss_scaling_inside_backward_keeps_gradients_float16_cannot_hold():
    """Gradients below float16's smallest subnormal (about 6e-8): without a scaler they are 0 and float16
    parameters do not move; scaled by 2**20 they are held, and unscaled in float32 inside the rule (a precision
    mode that computes in float32: master weights here, stochastic rounding in the lean configuration), AdamW's
    first step moves each parameter by lr against its gradient's sign, as the float64 reference does (to
    float16's rounding of the result)."""
    import dml_optim

    def run(scaled: bool):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.full((64,), 1.0, dtype=torch.float16))
        opt = build("adamw", [w], lr=1e-2, eps=1e-30, weight_decay=0.0, backend="eager", master_weights=True)
        scaler = dml_optim.DynamicLossScaler(init_scale=2.0**20) if scaled else None
        step_in_backward(opt, scaler=scaler)
        target = torch.linspace(-1, 1, 64)
        loss = (w.float() * target).sum() * 1e-9  # (d loss / d w = 1e-9 * target: below float16's range)
        (scaler.scale(loss) if scaled else loss).backward()
        return w.detach().double()

    assert torch.equal(run(False), torch.ones(64, dtype=torch.float64))
    target = torch.linspace(-1, 1, 64, dtype=torch.float64)
    expected = (1.0 - 1e-2 * torch.sign(target)).half().double()  # (AdamW step 1: m / sqrt(v) = sign(g))
    assert torch.equal(run(True), expected)


# -- clipping by the previous backward's norm (issue 49) ----------------------------------------------------------


class _Exact(torch.nn.Module):
    """Four 64 x 64 weights and the loss ``sum_i <w_i, X_i>``: the gradient of ``w_i`` is ``X_i`` (times the loss
    scale), exactly, in float32 and float16, whatever the weights.  Each ``X_i`` is ``+-a_i`` at random signs, so
    ``w_i``'s gradient norm is ``64 a_i`` and the total ``64 sqrt(sum a_i^2)``: exact in float32 in any order of
    summation when ``sum a_i^2`` is a perfect square (the reference and the runs then agree on the norm bit for
    bit, whatever order each adds in).  With ``run_bytes=0`` each weight is a run of its own."""

    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList(torch.nn.Parameter((0.1 * torch.randn(64, 64, generator=gen)).to(dtype))
                                        for _ in range(4))

    def forward(self, xs):
        return sum((w.float() * x).sum() for w, x in zip(self.w, xs))


def _exact_batch(i: int, magnitudes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + i)
    return [a * (2 * torch.randint(0, 2, (64, 64), generator=gen) - 1).float() for a in magnitudes]


def _reference_norm(grads, inv_scale: float = 1.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s total norm (the norm of the per-tensor norms, torch.nn.utils.get_total_norm),
    of float32 copies, unscaled."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) * inv_scale


def _reference_coef(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient (clip_grads_with_norm_)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


#: float32: per weight (a_1, ..., a_4), each step's sum of squares a perfect square: totals 5, 9, 0.5, 2.5, 18, 2
#: under max_norm 1: coefficients 1/5, 1/9, 1 (clamped), 2/5, 1/18, each with torch's 1e-6 (a few float32 ulps).
_F32_STEPS = [tuple(a / 64 for a in (1, 2, 2, 4)), tuple(a / 64 for a in (2, 4, 5, 6)), (1 / 256,) * 4,
              tuple(a / 128 for a in (1, 2, 2, 4)), tuple(a / 32 for a in (2, 4, 5, 6)), (1 / 64,) * 4]
#: float16 with loss scale 2**10: totals 128 a, powers of two of 32 and more (torch's 1e-6 is below half their
#: float32 ulp), under max_norm 64: each coefficient a power of two (1/2, 1/4, 1 clamped, 1/2, 1/8), so the
#: reference's float16 multiply by it is exact, as the rule's float32 one is.
_F16_STEPS = [(1.0,) * 4, (2.0,) * 4, (0.25,) * 4, (1.0,) * 4, (4.0,) * 4, (0.5,) * 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16-scaled"])
def test_clipping_by_the_previous_norm_equals_a_plain_loop_bit_for_bit(dtype):
    """``step_in_backward(opt, max_norm=..., clip_by="previous_norm")`` against a plain loop written here: after
    each backward it takes the total norm as torch.nn.utils.clip_grad_norm_ does, multiplies the gradients by
    torch's coefficient of the *previous* backward's norm and steps; the first backward steps nothing (no norm to
    clip it by).  float32 (the gradients multiplied before the step, torch's fused kernel's path) and the lean
    configuration (float16 parameters, stochastic rounding, 8-bit state, eager: DirectML's path, a
    DynamicLossScaler whose ``1 / S`` carries the coefficient into the rule): parameters and states bit for bit,
    ``handle.total_norm`` the reference's each step, the coefficients varying (clamped at 1 in one step)."""
    import dml_optim

    scaled = dtype == torch.float16
    steps, max_norm = (_F16_STEPS, 64.0) if scaled else (_F32_STEPS, 1.0)
    options = dict(backend="eager", state_bits=8, rounding="stochastic") if scaled else {}
    scale = 2.0**10
    nets, opts = [], []
    for _ in range(2):
        nets.append(_Exact(dtype))
        torch.manual_seed(3)  # (the seed of stochastic rounding)
        opts.append(build("adamw", list(nets[-1].parameters()), lr=1e-2, eps=1e-4, **options))
    (plain, inside), (opt_a, opt_b) = nets, opts
    scaler = dml_optim.DynamicLossScaler(init_scale=scale, growth_interval=1000) if scaled else None
    handle = step_in_backward(opt_b, run_bytes=0, max_norm=max_norm, clip_by="previous_norm", scaler=scaler)
    assert len(handle.runs) == 4
    coef, totals = None, []
    for i, magnitudes in enumerate(steps):
        xs = _exact_batch(i, magnitudes)
        # the plain loop: torch's norm, the previous backward's coefficient, a plain (scaled) step
        loss = plain(xs)
        (loss * scale if scaled else loss).backward()
        grads = [p.grad for p in plain.parameters()]
        total = _reference_norm(grads, 1 / scale if scaled else 1.0)
        if coef is not None:
            for g in grads:
                g.mul_(coef.to(g.dtype))
            if scaled:
                opt_a.step_scaled(torch.tensor(1 / scale))
            else:
                opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        coef = _reference_coef(max_norm, total)
        totals.append(float(total))
        # the step inside backward
        loss = inside(xs)
        (scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            scaler.update()
        opt_b.zero_grad(set_to_none=True)
        assert torch.equal(handle.total_norm, total), (i, handle.total_norm, total)
    assert len(set(totals)) >= 4 and min(totals) < max_norm < max(totals)
    assert handle.steps == 4 * (len(steps) - 1)  # (the first backward measured, stepping nothing)
    assert _same(plain, inside)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for k, st in sa.items():
        for key, v in st.items():
            assert _equal(torch.as_tensor(v), torch.as_tensor(sb[k][key])), (k, key)
    if scaled:
        assert scaler.get_scale() == scale  # (nothing overflowed)


def test_the_total_norm_of_a_network_follows_torch_and_leaves_out_runs_without_a_gradient():
    """A network with real gradients (the wide net, eager, runs of one or two parameters, a side head used every
    other backward: its run gets no gradient then and is left out of that backward's norm, as torch leaves out a
    parameter without one): ``handle.total_norm`` is torch.nn.utils.clip_grad_norm_'s total of the same
    gradients to float32's summation order (rtol 1e-6: the runs add in another order than torch's one stack),
    and the parameters follow the plain loop clipped by the previous norm (assert_close's float32 default:
    coefficients apart by an ulp or two)."""
    dtype = torch.float32

    def net():
        torch.manual_seed(0)
        return _Net(128)

    plain, inside = net(), net()
    inside.side = torch.nn.Linear(128, 8 * 64).to(dtype)  # (a run of its own: 32k elements)
    inside.head = torch.nn.Linear(128, 8 * 64).to(dtype)
    plain.side, plain.head = copy.deepcopy(inside.side), copy.deepcopy(inside.head)
    opt_a = build("adamw", list(plain.parameters()), lr=1e-2, backend="eager")
    opt_b = build("adamw", list(inside.parameters()), lr=1e-2, backend="eager")
    handle = step_in_backward(opt_b, run_bytes=0, max_norm=0.2, clip_by="previous_norm")
    side = list(inside.side.parameters())
    assert sum(all(any(p is q for q in side) for p in run.params) for run in handle.runs) == 1
    coef, totals = None, []
    for i in range(6):
        x, y = _wide_batch(i, dtype)
        y = y.repeat(1, 64)
        torch.nn.functional.mse_loss(plain(x, side=i % 2 == 1), y).backward()
        with_grad = [p for p in plain.parameters() if p.grad is not None]
        grads = [p.grad for p in with_grad]
        total = torch.nn.utils.clip_grad_norm_(with_grad, float("inf"))  # (max_norm inf: the norm, nothing clipped)
        if coef is not None:
            for g in grads:
                g.mul_(coef)
            opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        coef = _reference_coef(0.2, total)
        totals.append(float(total))
        torch.nn.functional.mse_loss(inside(x, side=i % 2 == 1), y).backward()
        opt_b.zero_grad(set_to_none=True)
        torch.testing.assert_close(handle.total_norm, total, rtol=1e-6, atol=0)
    assert min(totals) < 0.2 < max(totals)
    for p, q in zip(plain.parameters(), inside.parameters()):
        torch.testing.assert_close(p, q)


def test_a_run_that_overflows_keeps_its_previous_norm_in_the_next_coefficient():
    """float32 parameters and a DynamicLossScaler; in the third backward one weight's gradient overflows (inf, set
    by a gradient hook): its run is skipped, and the total norm of that backward, which clips the next, holds that
    run's norm of the backward before (not inf or NaN, which would poison the coefficient, nor 0, which would drop
    the run).  Against a plain loop of one optimizer per weight (the skipped one not stepped), torch's norm over
    the norms each weight last had, the coefficient folded into the unscaling; the scale backs off to 2**9, and
    the next backward clips by that norm: parameters bit for bit."""
    import dml_optim

    dtype, scale, max_norm = torch.float32, 2.0**10, 1.0
    steps = [(1 / 32,) * 4, (1 / 16,) * 4, (1 / 64,) * 4, (1 / 16,) * 4]  # totals 4, 8, (see below), 8
    overflow_at, overflowed = 2, 1
    plain, inside = _Exact(dtype), _Exact(dtype)
    opts_a = [build("adamw", [w], lr=1e-2, eps=1e-4, backend="eager") for w in plain.w]
    opt_b = build("adamw", list(inside.parameters()), lr=1e-2, eps=1e-4, backend="eager")
    scaler = dml_optim.DynamicLossScaler(init_scale=scale, growth_interval=1000)
    handle = step_in_backward(opt_b, run_bytes=0, max_norm=max_norm, clip_by="previous_norm", scaler=scaler)
    last = [None] * 4  # each weight's last finite norm (unscaled)
    coef, s = None, scale
    for i, magnitudes in enumerate(steps):
        xs = _exact_batch(i, magnitudes)
        (plain(xs) * s).backward()
        for k, (w, opt) in enumerate(zip(plain.w, opts_a)):
            if not (i == overflow_at and k == overflowed):
                last[k] = _reference_norm([w.grad], 1 / s)
                if coef is not None:
                    opt.step_scaled(torch.tensor(1 / s) * coef)
            opt.zero_grad(set_to_none=True)
        total = _reference_norm(last)
        coef = _reference_coef(max_norm, total)
        hook = inside.w[overflowed].register_hook(lambda g: torch.full_like(g, float("inf"))) if i == overflow_at else None
        scaler.scale(inside(xs)).backward()
        scaler.update()
        opt_b.zero_grad(set_to_none=True)
        if hook is not None:
            hook.remove()
            s /= 2  # (the scaler backed off)
            # the overflowed weight's norm of the backward before (64 / 16) beside the others' of this one (64 / 64)
            torch.testing.assert_close(handle.total_norm, torch.linalg.vector_norm(torch.tensor([1.0, 4.0, 1.0, 1.0])),
                                       rtol=1e-6, atol=0)
        assert torch.equal(handle.total_norm, total), (i, handle.total_norm, total)
    assert scaler.get_scale() == scale / 2
    assert _same(plain, inside)


@pytest.mark.parametrize("scaled", [True, False], ids=["float16-scaled", "float16-unscaled"])
def test_clipping_by_the_previous_norm_reads_nothing_back_during_backward(scaled):
    """The lean configuration (float16, stochastic rounding, 8-bit state, eager) clipped by the previous norm, with
    and without a scaler: a backward that measures (the first) and backward passes that clip run no host sync and
    no op DirectML would run on the CPU, whatever the number of runs (0 per run); the norm and the coefficient stay
    on the device until the caller reads ``handle.total_norm``."""
    import dml_optim
    from dml_optim.audit import audit_call

    net = _wide_net(torch.float16)
    torch.manual_seed(3)
    opt = build("adamw", list(net.parameters()), lr=1e-3, eps=1e-4, backend="eager", state_bits=8,
                rounding="stochastic")
    scaler = dml_optim.DynamicLossScaler(init_scale=2.0**10) if scaled else None
    handle = step_in_backward(opt, run_bytes=0, max_norm=0.5, clip_by="previous_norm", scaler=scaler)
    assert len(handle.runs) >= 3
    before = [p.detach().clone() for p in net.parameters()]
    for i in range(3):
        x, y = _wide_batch(i, torch.float16)
        loss = torch.nn.functional.mse_loss(net(x, side=True).float(), y.float())
        report = audit_call(opt, lambda: (scaler.scale(loss) if scaled else loss).backward())
        assert report.host_syncs == 0 and report.fallback_ops == 0, (i, report.host_syncs, report.fallbacks)
        assert any(name == "aten::linalg_vector_norm" for name, _, _ in report.ops), i
        if scaled:
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if i == 0:  # (the first backward measured: nothing moved)
            assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert handle.steps == 2 * len(handle.runs)
    assert handle.total_norm.dim() == 0 and handle.total_norm.dtype == torch.float32
    assert 0 < float(handle.total_norm) < float("inf")
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


@pytest.fixture
def directml():
    """The stand-in DirectML device (dml_optim.standin) under DirectML's strictest semantics: a CPU fallback
    raises, and so does float64."""
    from dml_optim import standin

    ok, why = standin.available(load=True)
    if not ok:
        pytest.skip(f"the stand-in DirectML device is unavailable here: {why}")
    standin.reset()
    with standin.configured(strict=True, float64=False):
        yield standin.device()
    standin.reset()


@pytest.mark.parametrize("bits", [8, 4])
def test_clipping_by_the_previous_norm_in_the_lean_configuration_on_directml(directml, bits):
    """The lean configuration DirectML runs (float16, stochastic rounding, 8-bit or 4-bit state, the step inside
    backward with a DynamicLossScaler) clipped by the previous norm, on the stand-in device: no fallback, no
    float64 (the Python floats of torch's coefficient reach only ops that take them natively), and the CPU's run
    bit for bit (parameters, total norms, the scale)."""
    from dml_optim import standin
    from dml_optim.backends.eager import laid_out_as
    import dml_optim

    def run(device):
        # (tests/test_standin_project.py's model: its float16 forward is the CPU's bit for bit on the stand-in,
        # where LayerNorm's is not)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.Tanh(), torch.nn.Linear(130, 40), torch.nn.Tanh(),
                                  torch.nn.Linear(40, 4)).to(device=device, dtype=torch.float16)
        torch.manual_seed(5)
        opt = build("adamw", list(net.parameters()), lr=1e-2, eps=1e-4, state_bits=bits, rounding="stochastic")
        scaler = dml_optim.DynamicLossScaler(init_scale=2.0**12)
        handle = step_in_backward(opt, run_bytes=0, max_norm=0.2, clip_by="previous_norm", scaler=scaler)
        norms = []
        for i in range(4):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + i)).to(device, torch.float16)
            scaler.scale(net(x).float().square().mean()).backward()
            scaler.update()
            opt.zero_grad(set_to_none=True)
            norms.append(handle.total_norm.to("cpu"))
        assert handle.steps >= 3 * 2
        return [p.detach().to("cpu") for p in net.parameters()], norms, scaler.get_scale()

    ours, norms, scale = run(directml)
    assert standin.fallbacks() == {} and standin.unknown() == {}
    with laid_out_as("privateuseone"):
        cpu, cpu_norms, cpu_scale = run(torch.device("cpu"))
    assert scale == cpu_scale
    assert all(torch.equal(a, b) for a, b in zip(norms, cpu_norms))
    assert min(float(n) for n in norms) < 0.2 < max(float(n) for n in norms), norms
    assert all(torch.equal(a, b) for a, b in zip(ours, cpu))
