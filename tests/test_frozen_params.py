"""Frozen and intermittently trained parameters (LoRA-style fine-tuning).

Required behaviour (issue "Frozen and intermittently trained parameters"):

* parameters with ``requires_grad=False`` are not packed, get no state and cost
  no ops, as in torch.optim; once unfrozen, the next step takes them in with
  fresh state (as torch.optim creates it) and leaves the others' state alone;
* the ops per step do not grow with how trainable and frozen parameters
  interleave, nor with a pattern of ``None`` gradients.  For the eager op
  chain (what DirectML runs: ``backend="eager"``) the bound checked
  (:func:`op_bound`): per distinct step count among the parameters that have
  a gradient, the rule's ops (counted by hand, ``Pair.rule_ops``; 6 for Adam
  with epsilon 0) + 1 (the gather of that class's fresh gradients): Adam's
  "about 7 per class"; plus, once, 2 ops per flat tensor of the buffer + 2 for
  re-packing classes that ``None`` gradients left in pieces (one ``cat`` and
  one copy per flat tensor; one gather and one zeroing of the slots of
  ``None`` gradients).  The CPU's default (``auto``: torch's fused kernel on
  the flat buffer, ``dml_optim/backends/fused.py``) has its own count,
  :data:`FUSED_STEP_OPS` a step whatever the runs of ``None`` gradients;
* torch.optim's semantics stay exact: a parameter without a gradient keeps its
  state and its step count.

Every reference is torch.optim itself (``foreach=False``; the fused backend's:
``fused=True``, equal bit for bit), built by hand with torch's own keyword
names, or a count kept by the test.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from tolerances import TORCH_ADAM_FLOAT32, assert_close
from torch import nn

import dml_optim
from dml_optim.backends import choose as backends
from dml_optim.backends.fused import LIST_MIN_ELEMENTS
from dml_optim.core.opcount import OpRecorder, count_ops
from introspect import buffers

# -- optimizer pairs (ours, torch.optim twin written by hand) ---------------------------------


#: torch.optim's implementations the twins run: the single-tensor reference (the default), or torch's fused
#: kernels (the twin of our fused backend, which runs the same kernels: equal bit for bit)
SINGLE_TENSOR = dict(foreach=False)
FUSED = dict(fused=True)
#: Ops of a step of a buffer that runs torch's fused kernel with one step count (``dml_optim.backends.fused.run``):
#: one kernel call, whatever the runs of ``None`` gradients (the step numbers are read from tensors made
#: once per 256 counts, outside the step's work: nothing is written but the kernel's outputs).
FUSED_STEP_OPS = 1
FUSED_STEP_OPS_SGD = 1


@dataclass(frozen=True)
class Pair:
    id: str
    #: ours(params, **options) (options: ``backend=...``); theirs(params, **implementation) (SINGLE_TENSOR by default)
    ours: Callable[..., torch.optim.Optimizer]
    theirs: Callable[..., torch.optim.Optimizer]
    state_names: tuple[str, ...]
    #: Work ops of the eager rule over one class, counted by hand from the rule:
    #: Adam (norm_coefficient 0, epsilon 0): V*=a, V+=(1-a)G, H*=b, H+=(1-b)G*G, sqrt, X+=-s*V/den = 6
    #: (a nonzero epsilon adds +eps: 7); AdamW: X*=(1-lr*wd), the six, +eps' = 8;
    #: Momentum (norm_coefficient 0): V*=a, V+=b*G, X+=-lr*V = 3.
    rule_ops: int
    #: torch.optim.SGD keeps no ``step``; ours keeps it (ONNX Momentum's T) beside the same states.
    torch_has_step: bool = True

    def f32_tol(self) -> dict:
        # torch.optim.Adam/AdamW vs ours in float32: the bias correction is computed in another
        # order (tests/tolerances.py: observed max 4e-7 relative over 50 steps)
        return TORCH_ADAM_FLOAT32 if self.id in ("adam", "adamw") else {}


ADAM = Pair(
    "adam",
    lambda ps, **kw: dml_optim.Adam(ps, lr=1e-3, alpha=0.8, beta=0.99, epsilon=0.0, **kw),
    lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, betas=(0.8, 0.99), eps=0.0, **(kw or SINGLE_TENSOR)),
    ("exp_avg", "exp_avg_sq"),
    rule_ops=6,
)
ADAMW = Pair(
    "adamw",
    lambda ps, **kw: dml_optim.AdamW(ps, lr=1e-3, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.05, **kw),
    lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.05,
                                       **(kw or SINGLE_TENSOR)),
    ("exp_avg", "exp_avg_sq"),
    rule_ops=8,
)
MOMENTUM = Pair(
    "momentum",
    lambda ps, **kw: dml_optim.Momentum(ps, lr=5e-2, alpha=0.9, beta=0.8, **kw),
    lambda ps, **kw: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, dampening=0.2, **(kw or SINGLE_TENSOR)),
    ("momentum_buffer",),
    rule_ops=3,
    torch_has_step=False,
)
PAIRS = [ADAM, ADAMW, MOMENTUM]
# (lr 1e-3 for the Adams: with 1e-2 the 16-layer model is chaotic enough that rounding-level
# differences of the first step (1e-17) grow tenfold every three steps, for any two Adam
# implementations that round differently; at 1e-3 they stay at 2e-16 over 30 steps.)
PAIR_IDS = [p.id for p in PAIRS]

#: Flat tensors of one buffer that a re-pack moves: parameters, gradients and the rule's states.
def _flat_tensors(pair: Pair) -> int:
    return 2 + len(pair.state_names)


def repack_ops(pair: Pair) -> int:
    """The constant the bound allows for one re-pack: 2 ops per flat tensor of the buffer + 2
    (one gather of the new gradients and one zeroing of the slots of ``None`` gradients)."""
    return 2 * _flat_tensors(pair) + 2


def op_bound(pair: Pair, distinct_counts: int) -> int:
    """Most ops a step may take: (rule + 1 gather) per distinct step count + the re-pack constant."""
    return (pair.rule_ops + 1) * distinct_counts + repack_ops(pair)


def tol(pair: Pair, dtype: torch.dtype) -> dict:
    return pair.f32_tol() if dtype == torch.float32 else {}


# -- the LoRA-shaped model ----------------------------------------------------------------------


class LoRABlock(nn.Module):
    """A frozen ``d x d`` Linear followed by a trainable rank-``r`` adapter (down ``r x d``, up ``d x r``)."""

    def __init__(self, d: int, r: int):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


#: Width of the LoRA tests that train (the full 512 is kept for the memory test, which steps once).
D = 64


def lora_model(d: int = D, r: int = 8, layers: int = 16, dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(*[LoRABlock(d, r) for _ in range(layers)]).to(dtype)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _batches(n: int, d: int, dtype, seed: int = 2, batch: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g, dtype=dtype), torch.randn(batch, d, generator=g, dtype=dtype))
            for _ in range(n)]


def _step_both(opt, topt, ps, ts, grads):
    """One step of both optimizers with the same gradients; frozen parameters get none (as after backward)."""
    for p, t, gr in zip(ps, ts, grads):
        p.grad = gr.clone() if p.requires_grad else None
        t.grad = gr.clone() if t.requires_grad else None
    opt.step()
    topt.step()


def _train_step(model, opt, x, y, *, zero_to_none: bool = False):
    opt.zero_grad(set_to_none=zero_to_none) if zero_to_none else opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()


def _assert_models_close(ours: nn.Module, theirs: nn.Module, **override):
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert a.requires_grad == b.requires_grad, name
        assert_close(a.detach(), b.detach(), **override)


def _assert_states_like_torch(opt, topt, pair: Pair, **override):
    """Our state dict holds exactly the entries torch.optim's holds, with the same names, shapes and values."""
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for k, t in theirs.items():
        o = ours[k]
        expected_keys = set(t) if pair.torch_has_step else set(t) | {"step"}
        assert set(o) == expected_keys, (k, sorted(o), sorted(t))
        for name in pair.state_names:
            assert o[name].shape == t[name].shape
            assert_close(o[name], t[name], **override)
        if pair.torch_has_step:
            assert float(o["step"]) == float(t["step"])


# -- LoRA: state, ops and updates ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_lora_model_equals_torch_with_trainable_state_and_ops_only(pair, dtype, backend):
    """16 frozen Linear layers each followed by a trainable adapter; ``model.parameters()`` (all of
    them) given to both optimizers; 30 steps.  A step costs what the same optimizer over the trainable
    parameters alone costs: ``eager`` (the op chain DirectML runs) the rule's hand-counted ops, against
    torch's single-tensor twin; ``auto`` (on the CPU, torch's fused kernel over the flat buffer)
    ``FUSED_STEP_OPS``, bit for bit equal to torch's ``fused=True`` twin (the adapters' sizes are whole
    units of the kernel, matrix.FUSED_UNIT_ELEMENTS)."""
    fused = backend == "auto"
    model = lora_model(dtype=dtype)
    twin = copy.deepcopy(model)
    trainable_only = copy.deepcopy(model)
    frozen_before = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
    opt = pair.ours(list(model.parameters()), backend=backend)
    topt = pair.theirs(list(twin.parameters()), **(FUSED if fused else SINGLE_TENSOR))
    only = pair.ours([p for p in trainable_only.parameters() if p.requires_grad], backend=backend)
    exact = dict(rtol=0, atol=0) if fused else tol(pair, dtype)

    ops = {}
    for step, (x, y) in enumerate(_batches(30, D, dtype)):
        opt.zero_grad()
        _loss(model, x, y).backward()
        only.zero_grad()
        _loss(trainable_only, x, y).backward()
        if step == 3:  # a steady step (states allocated at the first)
            ops["lora"] = count_ops(opt.step)
            ops["only"] = count_ops(only.step)
        else:
            opt.step()
            only.step()
        topt.zero_grad()
        _loss(twin, x, y).backward()
        topt.step()
        _assert_models_close(model, twin, **exact)

    assert ops["lora"] == ops["only"], ops
    # one buffer, one step class: the rule's ops (one fused kernel call), nothing else
    fused_ops = FUSED_STEP_OPS_SGD if pair.id == "momentum" else FUSED_STEP_OPS
    assert ops["lora"] == (fused_ops if fused else pair.rule_ops), ops
    assert opt.resolved_backends() == only.resolved_backends() == [["fused" if fused else "eager"]]
    for p, before in zip([p for p in model.parameters() if not p.requires_grad], frozen_before):
        assert torch.equal(p, before)
        assert p.grad is None
    _assert_states_like_torch(opt, topt, pair, **exact)
    trainable = {i for i, p in enumerate(model.parameters()) if p.requires_grad}
    assert set(opt.state_dict()["state"]) == trainable


def test_lora_flat_buffers_hold_only_trainable_parameters():
    """Full-size LoRA model (16 x 512x512 frozen, 512x8 adapters): the flat buffer's memory and
    state cover exactly the trainable parameters; frozen ones get no state, no grad, no copy."""
    model = lora_model(d=512, r=8, layers=16, dtype=torch.float32)
    params = list(model.parameters())
    frozen_ptrs = [p.data_ptr() for p in params if not p.requires_grad]
    opt = dml_optim.Adam(params, lr=1e-3)
    x, y = _batches(1, 512, torch.float32)[0]
    _train_step(model, opt, x, y)

    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    trainable_numel = sum(params[i].numel() for i in trainable)
    assert trainable_numel == 16 * 2 * 512 * 8
    (info,) = opt.flat_buffers()
    assert info.numel == trainable_numel
    assert sorted(info.param_indices) == trainable
    assert info.data.numel() == trainable_numel
    # the adapters' gradients (4,096 elements each: LIST_MIN_ELEMENTS) are read where autograd put them by
    # torch's fused kernel, so no flat gradient buffer exists; any other backend gathers exactly the trainable ones
    assert info.backend == "fused" and 512 * 8 >= LIST_MIN_ELEMENTS and info.grad is None
    eager = dml_optim.Adam(params, lr=1e-3, backend="eager")
    _train_step(model, eager, x, y)
    assert eager.flat_buffers()[0].grad.numel() == trainable_numel
    assert set(info.states) == {"exp_avg", "exp_avg_sq"}
    assert all(s.numel() == trainable_numel for s in info.states.values())
    assert sorted(opt.state_dict()["state"]) == trainable
    # frozen parameters were not copied anywhere and got no gradient
    assert [p.data_ptr() for p in params if not p.requires_grad] == frozen_ptrs
    assert all(p.grad is None for p in params if not p.requires_grad)


# -- gradual unfreezing -------------------------------------------------------------------------------


def _unfreeze(models, block_indices):
    for m in models:
        for b in block_indices:
            m[b].base.requires_grad_(True)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_gradual_unfreezing_equals_torch_at_every_step(pair):
    """Adapters only -> half of the bases unfrozen -> everything unfrozen: equal to torch.optim at
    every step; newly trainable parameters start with fresh state, the others keep theirs."""
    d, layers = 32, 8
    model = lora_model(d=d, layers=layers)
    twin = copy.deepcopy(model)
    opt, topt = pair.ours(list(model.parameters())), pair.theirs(list(twin.parameters()))
    batches = iter(_batches(18, d, torch.float64))
    phases = [[], list(range(0, layers, 2)), list(range(1, layers, 2))]
    for phase in phases:
        _unfreeze((model, twin), phase)
        for _ in range(6):
            x, y = next(batches)
            _train_step(model, opt, x, y)
            _train_step(twin, topt, x, y)
            _assert_models_close(model, twin)
            _assert_states_like_torch(opt, topt, pair)
    assert all(p.requires_grad for p in model.parameters())
    (info,) = opt.flat_buffers()
    assert info.numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_freezing_after_construction_zero_grad_writes_only_the_gradients_that_exist(pair, backend):
    """A backbone frozen after the optimizer was built stays in its flat buffer without gradients; ``zero_grad()``
    then zeroes only the runs of the parameters that have one (a frozen backbone's slots are not written every
    step; torch.optim zeroes the gradients that exist), the old values left in the frozen slots reach no step or
    clipping, and every step equals torch.optim's."""
    d, layers = 32, 8
    model = lora_model(d=d, layers=layers)
    model.requires_grad_(True)
    twin = copy.deepcopy(model)
    opt, topt = pair.ours(list(model.parameters()), backend=backend), pair.theirs(list(twin.parameters()))
    batches = iter(_batches(12, d, torch.float64))
    for _ in range(2):
        x, y = next(batches)
        _train_step(model, opt, x, y)
        _train_step(twin, topt, x, y)
    for m in (model, twin):  # the backbone: every layer but the last two
        for block in list(m)[:-2]:
            block.requires_grad_(False)
            for p in block.parameters():
                p.grad = None
    (info,) = buffers(opt)
    order = [list(model.parameters())[i] for i in info.param_indices]
    first = next(k for k, p in enumerate(order) if p.requires_grad)
    assert all(p.requires_grad for p in order[first:])  # (the last two layers: one run at the end of the buffer)
    lo = sum(p.numel() for p in order[:first])
    assert 2 * lo > info.numel
    for step in range(6):
        grad = buffers(opt)[0].grad
        grad[:lo].fill_(float("inf"))  # old values in the frozen slots: no step or norm may read them
        with OpRecorder() as ops:
            opt.zero_grad()
        assert ops.counts() == {"aten::zero_": 1}, dict(ops.counts())
        assert torch.isinf(grad[:lo]).all() and not grad[lo:].any()
        topt.zero_grad()
        x, y = next(batches)
        for m in (model, twin):
            _loss(m, x, y).backward()
        norm = dml_optim.clip_grad_norm_(opt, 10.0) if step % 2 else None
        if norm is not None:
            assert_close(norm, torch.nn.utils.clip_grad_norm_(twin.parameters(), 10.0))
        opt.step()
        topt.step()
        _assert_models_close(model, twin)
        _assert_states_like_torch(opt, topt, pair)


def test_unfrozen_parameter_gets_fresh_state_and_others_keep_theirs():
    """Unfreezing one parameter after 4 steps: it starts at step 0 with zero moments (checked against
    torch.optim's state), the others' states and counts are exactly what they were."""
    torch.manual_seed(3)
    ps = [nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(4)]
    ps[1].requires_grad_(False)
    ts = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in ps]
    opt, topt = ADAM.ours(ps), ADAM.theirs(ts)
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in ps] for _ in range(8)]

    def step(k):
        _step_both(opt, topt, ps, ts, grads[k])

    for k in range(4):
        step(k)
    assert 1 not in opt.state_dict()["state"]
    before = {i: {n: v.clone() for n, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    ps[1].requires_grad_(True)
    ts[1].requires_grad_(True)
    # a zero_grad/state_dict between the unfreezing and the step changes nothing of the others
    after_unfreeze = opt.state_dict()["state"]
    for i, s in before.items():
        for n, v in s.items():
            assert torch.equal(after_unfreeze[i][n], v), (i, n)
    step(4)
    sd, tsd = opt.state_dict()["state"], topt.state_dict()["state"]
    assert float(sd[1]["step"]) == float(tsd[1]["step"]) == 1.0
    assert [float(sd[i]["step"]) for i in (0, 2, 3)] == [5.0, 5.0, 5.0]
    for k in range(5, 8):
        step(k)
    for p, t in zip(ps, ts):
        assert_close(p.detach(), t.detach())
    _assert_states_like_torch(opt, topt, ADAM)


# -- None-gradient patterns ----------------------------------------------------------------------------


def _mask_on_cpu(monkeypatch) -> None:
    """Make the CPU take masked updates, as DirectML and CUDA do (on the CPU one update per run is faster)."""
    from dml_optim.backends import choose as backends
    from dml_optim.backends import eager as engine

    monkeypatch.setattr(engine, "MASKED_DEVICES", (*engine.MASKED_DEVICES, "cpu"))
    monkeypatch.setitem(backends.AUTO_COMPILE_MIN_ELEMENTS_MASKED, "cpu", 1 << 16)



SHAPES = [(7,), (3, 4), (), (2, 3, 2), (9,), (4, 4), (1,), (5, 2), (6,), (2, 2, 2), (3,), (8,)]


def _none_pattern_run(pair: Pair, backend: str, steps: int = 50, seed: int = 5, check_every_step=None):
    """Random None-gradient patterns over ``steps`` steps, ours (``backend``) and torch side by side.

    Two ways to hand gradients over, alternating: ``zero_grad(set_to_none=True)`` then fresh
    tensors for a random subset; or ``zero_grad()`` (views kept, None stays None), writing into
    the existing gradient views, fresh tensors for parameters without one, and ``None`` for the
    ones left out this step.  Yields per step ``(k, recorder, distinct_active_counts, ...)``, the
    recorder of the step's ops.
    """
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    ts = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = pair.ours(ps, backend=backend), pair.theirs(ts)
    counts = [0] * len(ps)  # our own count of the steps each parameter took (torch.optim's semantics)
    for k in range(steps):
        active = (torch.rand(len(ps), generator=gen) < 0.5).tolist()
        if k == 0:
            active[0] = True
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        if k % 2 == 0:
            opt.zero_grad(set_to_none=True)
            for p, a, gr in zip(ps, active, grads):
                if a:
                    p.grad = gr.clone()
        else:
            opt.zero_grad()
            for p, a, gr in zip(ps, active, grads):
                if not a:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.copy_(gr)
                else:
                    p.grad = gr.clone()
        topt.zero_grad(set_to_none=True)
        for t, a, gr in zip(ts, active, grads):
            if a:
                t.grad = gr.clone()
        distinct = len({counts[i] for i, a in enumerate(active) if a})
        recorder = OpRecorder(compiled=True)
        with recorder:
            opt.step()
        topt.step()
        for i, a in enumerate(active):
            counts[i] += a
        yield k, recorder, distinct, (opt, topt, ps, ts, counts)


def _assert_counts_like_torch(pair: Pair, opt, topt, ps, counts, k) -> None:
    """Each parameter's step count is the test's own count, and torch.optim's."""
    if pair.torch_has_step:
        tstate = topt.state_dict()["state"]
        assert [float(tstate[i]["step"]) if i in tstate else 0.0 for i in range(len(ps))] == [float(c) for c in counts]
    (info,) = opt.flat_buffers()
    ours_counts = dict(zip(info.param_indices, info.step_counts))
    assert [ours_counts[i] for i in range(len(ps))] == counts, k


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_random_none_gradients_equal_torch_and_ops_stay_bounded(pair, monkeypatch):
    """50 seeded steps of random None-gradient patterns: parameters, states and step counts equal
    torch.optim's; ops per step <= ``op_bound`` of the distinct step counts among the parameters
    with a gradient (from the test's own count, which torch's ``step`` confirms).  The first step
    (which allocates the states) is not bounded.  The bound is DirectML's (ops are what a step costs
    there): the eager op chain, and the CPU takes DirectML's policy (masked updates) for this test; its
    own, one update per run, is tested for equality in ``test_changing_none_patterns_step_in_place_per_run...``,
    and its default, torch's fused kernel, in ``test_random_none_gradients_on_the_fused_path...``."""
    _mask_on_cpu(monkeypatch)
    bound_used = []
    for k, recorder, distinct, (opt, topt, ps, ts, counts) in _none_pattern_run(pair, "eager"):
        ops = recorder.ops
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
        _assert_counts_like_torch(pair, opt, topt, ps, counts, k)
        if k > 0:
            bound = op_bound(pair, distinct)
            assert ops <= bound, (k, ops, distinct, bound)
            bound_used.append((ops, distinct))
    _assert_states_like_torch(opt, topt, pair)
    assert opt.resolved_backends() == [["eager"]]
    # the pattern really did produce several step counts at once (the bound is not vacuous)
    assert max(d for _, d in bound_used) >= 3


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_random_none_gradients_on_the_fused_path_equal_torch(pair):
    """The CPU's default (``auto``: torch's fused kernel over runs of the flat buffer, no re-pack, no masked
    update) under the same 50 random None-gradient patterns: parameters, states and step counts equal
    torch.optim's, and a step calls the kernel at most once per distinct step count among the parameters
    with a gradient (AdamW once whatever the counts: each tensor carries its own)."""
    most = 0
    for k, recorder, distinct, (opt, topt, ps, ts, counts) in _none_pattern_run(pair, "auto"):
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
        _assert_counts_like_torch(pair, opt, topt, ps, counts, k)
        calls = sum(n for name, n in recorder.counts().items() if name.startswith("aten::_fused_"))
        assert 1 <= calls <= (1 if pair is ADAMW else distinct), (k, dict(recorder.counts()), distinct)
        most = max(most, distinct)
    assert opt.resolved_backends() == [["fused"]]
    _assert_states_like_torch(opt, topt, pair)
    assert most >= 3


#: Which of 20 parameters have a gradient, step after step: 1, 2, 5 and 10 runs of them.
RUN_PATTERNS = {1: lambda i: i < 10, 2: lambda i: i < 5 or 10 <= i < 15, 5: lambda i: i % 4 < 2,
                10: lambda i: i % 2 == 0}


def _steady_ops(backend: str, runs: int, size: int = 4) -> tuple[list[OpRecorder], list, torch.optim.Optimizer]:
    """20 parameters of ``size`` elements, the ones of ``RUN_PATTERNS[runs]`` with a fresh gradient every step
    (the others None, from the first step on: one step count among those with a gradient); the recorders of
    4 steps after the first, the gradients of the last, and the optimizer."""
    torch.manual_seed(6)
    ps = [nn.Parameter(torch.randn(size, dtype=torch.float64)) for _ in range(20)]
    opt = dml_optim.Adam(ps, lr=1e-2, epsilon=1e-6, backend=backend)
    active = [RUN_PATTERNS[runs](i) for i in range(20)]
    grads = [torch.randn(size, dtype=torch.float64) if a else None for a in active]
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()  # allocates
    recorders = []
    for _ in range(4):
        # (the last step's gradients stay alive while the new ones are made, as in a training loop that
        # keeps them until backward: Python ids are not reused)
        grads = [torch.randn(size, dtype=torch.float64) if a else None for a in active]
        for p, g in zip(ps, grads):
            p.grad = g
        recorders.append(OpRecorder(compiled=True))
        with recorders[-1]:
            opt.step()
    return recorders, list(zip(ps, grads)), opt


def test_ops_per_step_do_not_grow_with_none_gradient_runs():
    """The eager op chain (DirectML's): once the counts are equal again, the same None pattern costs the same
    as one class: with every other parameter None for many steps in a row, a steady step runs the rule once
    (plus the fixed gather/zero of the re-pack constant at most), whatever the number of runs."""
    ops = [r.ops for r in _steady_ops("eager", 10)[0]]
    # 10 interleaved runs of parameters with a gradient, one step count among them: Adam's 7 rule
    # ops (epsilon > 0), one gather of the fresh gradients, one zeroing of the None slots at most
    assert max(ops) <= 7 + 1 + repack_ops(ADAM), ops
    assert ops[-1] <= 7 + 2, ops
    steady = {runs: _steady_ops("eager", runs)[0][-1].ops for runs in RUN_PATTERNS}
    assert len(set(steady.values())) == 1, steady  # the same whatever the number of runs


@pytest.mark.parametrize("size", [4, "in-place"])
def test_fused_ops_per_step_do_not_grow_with_none_gradient_runs(size):
    """The CPU's default (``auto``: torch's fused kernel over runs of the flat buffer, no re-pack): with 1, 2, 5
    or 10 runs of parameters with a gradient at one step count, every step is one kernel call, plus, for small parameters, the gather of the fresh gradients (one ``cat`` and the
    zero it reads for the None slots); parameters of ``LIST_MIN_ELEMENTS`` elements have their fresh
    gradients read where they are (no gather: ``p.grad`` stays the caller's tensor)."""
    from dml_optim.backends.fused import LIST_MIN_ELEMENTS

    in_place = size == "in-place"
    counts = {}
    for runs in RUN_PATTERNS:
        recorders, last, opt = _steady_ops("auto", runs, LIST_MIN_ELEMENTS if in_place else size)
        assert opt.resolved_backends() == [["fused"]]
        for r in recorders:
            kernels = {name: n for name, n in r.counts().items() if name.startswith("aten::_fused_")}
            assert kernels == {"aten::_fused_adam_": 1}, (runs, dict(r.counts()))
        counts[runs] = [r.ops for r in recorders]
        if in_place:
            assert all(p.grad is g for p, g in last)
    every = {ops for per_pattern in counts.values() for ops in per_pattern}
    assert len(every) == 1, counts  # the same every step, whatever the number of runs
    assert (every == {FUSED_STEP_OPS}) if in_place else (max(every) <= FUSED_STEP_OPS + 2), counts


# -- interleaving ---------------------------------------------------------------------------------------


def test_interleaved_frozen_and_trainable_layers_cost_one_rule():
    """20 alternating frozen/trainable parameters: a step is Adam's 7 ops (hand count: V*=a,
    V+=(1-a)G, H*=b, H+=(1-b)G^2, sqrt, +eps, X+=-s*V/den), not 7 per run of trainable ones."""
    torch.manual_seed(7)
    ps = [nn.Parameter(torch.randn(6, 5), requires_grad=(i % 2 == 1)) for i in range(20)]
    opt = dml_optim.Adam(ps, lr=1e-3, epsilon=1e-6, backend="eager")
    for _ in range(3):
        opt.zero_grad()
        sum((p * p).sum() for p in ps if p.requires_grad).backward()
        ops = count_ops(opt.step)
    assert ops == 7
    (info,) = opt.flat_buffers()
    assert info.numel == 10 * 30 and info.step_classes == 1


# -- checkpoints through each state --------------------------------------------------------------------


@dataclass
class World:
    """Ours and torch.optim trained side by side up to some state, and how to go on from it."""

    ours: nn.Module
    twin: nn.Module
    opt: torch.optim.Optimizer
    topt: torch.optim.Optimizer
    feed: Callable[[nn.Module, torch.optim.Optimizer, int], None]  # training step k
    resume: Callable[[list], None]  # applied to every model when training goes on (unfreezing)
    next_k: int
    more: int


def _model_feed(d: int, n: int):
    batches = _batches(n, d, torch.float64)

    def feed(model, opt, k):
        _train_step(model, opt, *batches[k])

    return feed


def _world_lora(pair: Pair) -> World:
    model = lora_model(d=32, layers=6)
    twin = copy.deepcopy(model)
    w = World(model, twin, pair.ours(list(model.parameters())), pair.theirs(list(twin.parameters())),
              _model_feed(32, 8), lambda models: None, 4, 4)
    for k in range(4):
        w.feed(w.ours, w.opt, k)
        w.feed(w.twin, w.topt, k)
    return w


def _world_mid_unfreeze(pair: Pair) -> World:
    """Some bases unfrozen two steps ago (fresh state), adapters older, the other bases frozen;
    the rest is unfrozen when training goes on."""
    model = lora_model(d=32, layers=6)
    twin = copy.deepcopy(model)
    w = World(model, twin, pair.ours(list(model.parameters())), pair.theirs(list(twin.parameters())),
              _model_feed(32, 10), lambda models: _unfreeze(models, [1, 3, 5]), 5, 5)
    for k in range(5):
        if k == 3:
            _unfreeze((w.ours, w.twin), [0, 2, 4])
        w.feed(w.ours, w.opt, k)
        w.feed(w.twin, w.topt, k)
    return w


def _world_random_none(pair: Pair) -> World:
    """25 steps of random None-gradient patterns (several distinct step counts); 10 more after."""
    gen = torch.Generator().manual_seed(8)
    ours = nn.ParameterList([nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES])
    twin = copy.deepcopy(ours)
    plan = []
    for k in range(35):
        active = (torch.rand(len(SHAPES), generator=gen) < 0.5).tolist()
        plan.append((active, [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]))

    def feed(params, opt, k):
        opt.zero_grad(set_to_none=True)
        for p, a, g in zip(params, *plan[k]):
            if a:
                p.grad = g.clone()
        opt.step()

    w = World(ours, twin, pair.ours(list(ours.parameters())), pair.theirs(list(twin.parameters())),
              feed, lambda models: None, 25, 10)
    for k in range(25):
        w.feed(w.ours, w.opt, k)
        w.feed(w.twin, w.topt, k)
    (info,) = w.opt.flat_buffers()
    assert len(set(info.step_counts)) >= 3  # the state under test really has several step counts
    return w


WORLDS = {"lora": _world_lora, "mid-unfreeze": _world_mid_unfreeze, "random-none": _world_random_none}


def _assert_torch_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sb:
        assert set(sa[k]) >= set(sb[k]) and set(sa[k]) - set(sb[k]) <= {"step"}, (k, sorted(sa[k]), sorted(sb[k]))
        for name, t in sb[k].items():
            assert_close(sa[k][name].double(), t.double())


@pytest.mark.parametrize("direction", ["ours->ours", "ours->torch", "torch->ours"])
@pytest.mark.parametrize("state", list(WORLDS))
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_checkpoint_roundtrip(pair, state, direction):
    """From each state (LoRA, mid-unfreeze, random None patterns), a state dict saved by ``source``
    and loaded into a fresh ``target`` over a copy of the model continues exactly like the
    uninterrupted runs (ours and torch.optim): parameters at every step, then the states."""
    w = WORLDS[state](pair)
    source, target = direction.split("->")
    sd = copy.deepcopy((w.opt if source == "ours" else w.topt).state_dict())
    model = copy.deepcopy(w.ours if source == "ours" else w.twin)
    resumed = (pair.ours if target == "ours" else pair.theirs)(list(model.parameters()))
    if source == "ours" and target == "torch" and "epsilon" in sd["param_groups"][0] and "eps" not in sd["param_groups"][0]:
        # ONNX Adam's epsilon is not torch's eps (added before vs after the bias correction,
        # docs/design.md §2), so our groups do not carry an `eps`; with epsilon 0 the rules agree
        for g in sd["param_groups"]:
            assert g["epsilon"] == 0.0
            g["eps"] = 0.0
    resumed.load_state_dict(sd)
    w.resume([w.ours, w.twin, model])
    for k in range(w.next_k, w.next_k + w.more):
        for m, o in ((w.ours, w.opt), (w.twin, w.topt), (model, resumed)):
            w.feed(m, o, k)
        _assert_models_close(w.ours, w.twin)
        _assert_models_close(model, w.twin)
    _assert_states_like_torch(w.opt, w.topt, pair)
    if target == "ours":
        _assert_states_like_torch(resumed, w.topt, pair)
    else:
        _assert_torch_states_equal(resumed, w.topt)


# -- a frozen parameter with saved state ------------------------------------------------------------------


@pytest.mark.parametrize("source", ["torch", "ours"])
def test_frozen_parameter_with_saved_state_keeps_it(source):
    """A parameter that has state in the loaded state dict but is frozen now keeps that state (as
    torch.optim does): it is saved again unchanged, frozen steps leave it alone, and once unfrozen it
    continues from it exactly like torch.optim."""
    torch.manual_seed(10)
    ps = [nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(3)]
    ts = [nn.Parameter(p.detach().clone()) for p in ps]
    src_params = [nn.Parameter(p.detach().clone()) for p in ps]
    src = (ADAM.theirs if source == "torch" else ADAM.ours)(src_params)
    g = torch.Generator().manual_seed(11)
    grads = [[torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in ps] for _ in range(9)]
    topt = ADAM.theirs(ts)
    for k in range(3):
        for sp, t, gr in zip(src_params, ts, grads[k]):
            sp.grad, t.grad = gr.clone(), gr.clone()
        src.step()
        topt.step()
    for p, sp in zip(ps, src_params):
        p.data.copy_(sp.detach())
    saved = copy.deepcopy(src.state_dict())
    ps[1].requires_grad_(False)
    ts[1].requires_grad_(False)
    opt = ADAM.ours(ps)
    opt.load_state_dict(saved)
    st = opt.state_dict()["state"]
    assert 1 in st, "the frozen parameter's saved state was dropped"
    assert float(st[1]["step"]) == 3.0
    assert_close(st[1]["exp_avg"], topt.state_dict()["state"][1]["exp_avg"])
    frozen_state = {n: v.clone() for n, v in st[1].items()}

    def step(k):
        _step_both(opt, topt, ps, ts, grads[k])

    for k in range(3, 6):
        step(k)
    st = opt.state_dict()["state"]
    for n, v in frozen_state.items():
        assert torch.equal(st[1][n], v), n
    ps[1].requires_grad_(True)
    ts[1].requires_grad_(True)
    for k in range(6, 9):
        step(k)
    for p, t in zip(ps, ts):
        assert_close(p.detach(), t.detach())
    _assert_states_like_torch(opt, topt, ADAM)


# -- requires_grad=False with a gradient --------------------------------------------------------------


@pytest.mark.parametrize("how", ["frozen-from-the-start", "frozen-after-training"])
def test_frozen_parameter_that_has_a_gradient_steps_like_torch(how):
    """torch.optim steps every parameter whose ``.grad`` is not None, whatever its
    ``requires_grad`` (``Optimizer._init_group`` looks at ``p.grad`` only): a parameter frozen with
    a gradient still attached (set by hand, or left by ``zero_grad(set_to_none=False)`` before the
    freeze) is updated.  Ours must do the same, for one that was never packed too."""
    torch.manual_seed(12)
    ps = [nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(3)]
    ts = [nn.Parameter(p.detach().clone()) for p in ps]
    if how == "frozen-from-the-start":
        ps[1].requires_grad_(False)
        ts[1].requires_grad_(False)
    opt, topt = ADAM.ours(ps), ADAM.theirs(ts)
    g = torch.Generator().manual_seed(13)
    for k in range(6):
        if how == "frozen-after-training" and k == 3:
            ps[1].requires_grad_(False)
            ts[1].requires_grad_(False)
        opt.zero_grad(set_to_none=False)
        topt.zero_grad(set_to_none=False)
        for p, t in zip(ps, ts):
            gr = torch.randn(4, generator=g, dtype=torch.float64)
            if p.grad is None:
                p.grad, t.grad = gr.clone(), gr.clone()
            elif p.requires_grad:
                p.grad.add_(gr)
                t.grad.add_(gr)
            # (a frozen parameter's existing gradient is left as zero_grad left it)
        opt.step()
        topt.step()
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
    _assert_states_like_torch(opt, topt, ADAM)


# -- device memory at construction ------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the device's peak at construction is read with torch.cuda.max_memory_allocated (needs CUDA)")
@pytest.mark.parametrize("pack_via", ["auto", "host", "device"])
def test_construction_peak_on_cuda(pack_via):
    """Building the optimizer over a LoRA model on CUDA: with ``pack_via`` "auto" (host staging off the CPU) or
    "host" the device holds at most 1.25x the trainable parameters' bytes at the peak (the parameters
    themselves and nothing else); "device" copies straight into the flat buffer, a second copy at the peak."""
    model = lora_model(d=512, r=64, layers=16, dtype=torch.float32).cuda()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt = dml_optim.Adam(model.parameters(), lr=1e-3, pack_via=pack_via)
    torch.cuda.synchronize()
    peak_ratio = (torch.cuda.max_memory_allocated() - before + trainable) / trainable
    after_ratio = (torch.cuda.memory_allocated() - before + trainable) / trainable
    assert after_ratio <= 1.05, after_ratio  # the flat buffer replaces the parameters' storage
    if pack_via == "device":
        assert peak_ratio >= 1.9, peak_ratio
    else:
        assert peak_ratio <= 1.25, peak_ratio
    x = torch.randn(4, 512, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- changing None patterns: one masked update, no re-pack ---------------------------------------------


def _changing_patterns(pair: Pair, backend: str, *, n: int = 24, size: int = 96, steps: int = 14, seed: int = 12):
    """``n`` parameters with a gradient for a seeded random 70% of them each step (fresh tensors, as after
    ``zero_grad(set_to_none=True)``), ours (``backend``) and torch side by side.  Yields per step
    ``(k, ops, distinct, order, ps, ts, opt, topt)``: ``order`` is the buffer's parameter order after the
    step, ``distinct`` the step counts among the parameters with a gradient (the test's own count)."""
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(size, generator=gen, dtype=torch.float64)) for _ in range(n)]
    ts = [nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = pair.ours(ps), pair.theirs(ts)
    for group in opt.param_groups:
        group["backend"] = backend
    counts = [0] * n
    for k in range(steps):
        active = (torch.rand(n, generator=gen) < 0.7).tolist()
        grads = [torch.randn(size, generator=gen, dtype=torch.float64) for _ in range(n)]
        for p, t, a, g in zip(ps, ts, active, grads):
            p.grad = g.clone() if a else None
            t.grad = g.clone() if a else None
        distinct = len({counts[i] for i, a in enumerate(active) if a})
        ops = count_ops(opt.step)
        topt.step()
        counts = [c + a for c, a in zip(counts, active)]
        (info,) = opt.flat_buffers()
        yield k, ops, distinct, list(info.param_indices), ps, ts, opt, topt


@pytest.mark.parametrize("backend", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_changing_none_patterns_step_in_place_per_run_on_the_cpu_and_equal_torch(pair, backend):
    """On the CPU, parameters at several step counts under a pattern of ``None`` gradients that changes
    every step take one update per run of parameters at one count, in the buffer's order (no re-pack),
    within the op bound of the distinct counts, and equal torch.optim at every step."""
    from dml_optim.backends.compiled import compile_available

    if backend == "compiled" and not compile_available("cpu")[0]:
        pytest.skip(f"torch.compile unavailable on this CPU: {compile_available('cpu')[1]}")
    order_before, several = None, 0
    for k, ops, distinct, order, ps, ts, opt, topt in _changing_patterns(pair, backend):
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
        if distinct >= 2:
            several += 1
            assert order == order_before, (k, "re-packed")
        order_before = order
    assert several, "the pattern never left parameters at several step counts: the test is vacuous"
    _assert_states_like_torch(opt, topt, pair)


@pytest.mark.parametrize("backend", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_changing_none_patterns_step_once_in_place_and_equal_torch(pair, backend, monkeypatch):
    """Where masked updates are used (DirectML, CUDA; here the CPU made to), parameters at several step
    counts under a pattern of ``None`` gradients that changes every step step in one masked update:
    the buffer keeps its parameter order (no re-pack), the op count of a step is the same whatever the
    pattern (eager; compiled: the rule is one kernel), and parameters and states equal torch.optim's
    at every step."""
    from dml_optim.backends.compiled import compile_available

    if backend == "compiled" and not compile_available("cpu")[0]:
        pytest.skip(f"torch.compile unavailable on this CPU: {compile_available('cpu')[1]}")
    _mask_on_cpu(monkeypatch)
    masked_ops = []
    order_before = None
    for k, ops, distinct, order, ps, ts, opt, topt in _changing_patterns(pair, backend):
        for p, t in zip(ps, ts):
            assert_close(p.detach(), t.detach())
        if distinct >= 2:
            assert order == order_before, (k, "re-packed")
            masked_ops.append(ops)
        order_before = order
    masked_ops = set(masked_ops[1:])  # (the first masked step also builds the buffer's owner index, once)
    assert masked_ops, "the pattern never left parameters at several step counts: the test is vacuous"
    if backend == "eager":
        assert len(masked_ops) == 1, masked_ops
        (ops,) = masked_ops
        # one gather (a cat, None slots zeroed in it), the per-parameter table (its fill, and a
        # gather to the elements), and the rule with tensor scalars: within the bound of 2 counts
        assert ops <= op_bound(pair, 2), (ops, op_bound(pair, 2))
    else:
        # the gather (a cat; with None gradients, of zeros too: one fill), the table, the kernel
        assert max(masked_ops) <= 4, masked_ops
    _assert_states_like_torch(opt, topt, pair)


@pytest.mark.slow
def test_auto_compiles_the_masked_update_of_a_large_buffer(monkeypatch):
    """``backend="auto"`` runs the masked update of a buffer (one torch's fused kernel cannot run) from
    ``AUTO_COMPILE_MIN_ELEMENTS_MASKED`` on as one compiled kernel (CUDA's policy, given to the CPU here),
    equal to the eager masked update."""
    from dml_optim.backends import compiled
    from dml_optim.backends.choose import AUTO_COMPILE_MIN_ELEMENTS_MASKED

    if not compiled.compile_available("cpu")[0]:
        pytest.skip(f"torch.compile unavailable on this CPU: {compiled.compile_available('cpu')[1]}")
    _mask_on_cpu(monkeypatch)
    size = AUTO_COMPILE_MIN_ELEMENTS_MASKED["cpu"] // 8
    runs = {}
    for backend in ("auto", "eager"):
        torch.manual_seed(3)
        ps = [nn.Parameter(torch.randn(size)) for _ in range(8)]
        # (a rule torch's fused kernel does not compute, the post-update decay: auto's fused backend, which
        # steps runs of the buffer without a masked update, would take a plain buffer)
        opt = dml_optim.Adam(ps, lr=1e-2, norm_coefficient_post=1e-3, backend=backend)
        for k in range(4):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (i + 1)) if (i + k) % 3 else None
            opt.step()
        runs[backend] = [p.detach().clone() for p in ps]
    assert any("masked" in name for name in compiled.cache_info()["compiled"])
    for a, b in zip(runs["auto"], runs["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_zero_grad_zeroes_a_frozen_parameters_view_gradient_in_place_like_torch():
    """A frozen parameter's gradient that is a view (a slice of a bucket the caller keeps, as DDP's
    ``gradient_as_bucket_view``) cannot be detached in place: torch.optim's ``zero_grad(set_to_none=False)``
    zeroes it (no longer requiring grad), and so does ours, instead of raising.  (``checks="fast"`` leaves a
    parameter frozen at construction out even with a gradient: the unpacked parameters' own zeroing.)"""
    results = []
    for make in (lambda ps: dml_optim.AdamW(ps, lr=1e-2, checks="fast"), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        trained, frozen = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(4), requires_grad=False)
        opt = make([trained, frozen])
        bucket = torch.arange(1.0, 9.0)
        frozen.grad = bucket[2:6]
        opt.zero_grad(set_to_none=False)
        assert frozen.grad._base is bucket
        results.append(bucket.clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0][2:6], torch.zeros(4))
