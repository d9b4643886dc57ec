"""Non-finite gradients (issue 8, item 3): ``nonfinite="propagate" | "skip" | "raise"``.

* ``propagate`` (default) behaves like torch.optim: an inf/NaN gradient turns
  into NaN/inf parameters and states in the same places (compared with
  torch.optim in float64 through the docs/design.md §2 equivalences).
* ``skip``: a step with any non-finite gradient leaves parameters, states and
  step counters bit-exactly unchanged (one flag per step: every "skip" buffer
  skips together), the next finite step continues exactly as a run that never
  saw the bad step, and no host sync happens (``aten::_local_scalar_dense``
  calls counted with a TorchDispatchMode).
* ``raise``: FloatingPointError naming the offending parameter(s), nothing
  changed; it costs host syncs (counted: one per flat buffer).

All three with None-grad parameters mixed in, several groups, and in chunked
precision mode (float16 storage, float32 compute, the inf in the first,
a middle or the last chunk).

The optimizers, their dtypes, devices and torch.optim twins come from the test
matrix (``tests/matrix.py``): each optimizer's default variant, which has an
exact twin, in its widest dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dml_optim.backends.eager as engine
from introspect import buffers, runs_in_chunks
from matrix import Case, case_of, classes
from test_bad_inputs import assert_same, snapshot
from tolerances import assert_close

ADAM = case_of("adam")
INF, NAN = float("inf"), float("nan")


class HostSyncCounter(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``): host syncs."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_host_sync_counter_counts():
    with HostSyncCounter() as c:
        t = torch.ones(3)
        t.sum().item()
        bool(t.max() > 0)
    assert c.syncs == 2


# -- a small scripted run ----------------------------------------------------------

SHAPES = ((3, 2), (5,), (4,))


def init_params(dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in SHAPES]


def grad_stream(n, dtype=torch.float64, seed=4, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in SHAPES]
            for _ in range(n)]


def with_bad(grads, which=2, value=INF, index=1):
    """A copy of one step's gradients with ``grads[which].view(-1)[index] = value``."""
    out = [None if g is None else g.clone() for g in grads]
    out[which].view(-1)[index] = value
    return out


def drop(grads, which):
    out = list(grads)
    out[which] = None
    return out


def build(case: Case, dtype=None, groups=False, **kw):
    """Our optimizer with the case's (default-variant) hyperparameters, which have an exact torch.optim
    twin (docs/design.md §2: epsilon 0 for the Adams), over :func:`init_params`."""
    ps = [torch.nn.Parameter(x) for x in init_params(dtype or case.dtype, case.device)]
    spec = [{"params": ps[:2]}, {"params": ps[2:]}] if groups else ps
    return ps, case.build(spec, **kw)


def feed(ps, opt, grads):
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()
    opt.step()


# -- propagate ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("case", classes())
def test_propagate_matches_torch_optim(case, bad):
    stream = grad_stream(3, case.dtype, device=case.device)
    stream[1] = with_bad(stream[1], which=1, value=bad, index=2)
    ps, opt = build(case)
    ref = [torch.nn.Parameter(x) for x in init_params(case.dtype, case.device)]
    topt = case.twin_or_reference(ref)  # (Lion: torch.optim has none; the float64 reference of the paper's update)
    for grads in stream:
        feed(ps, opt, grads)
        feed(ref, topt, grads)
        for p, r in zip(ps, ref):
            assert torch.equal(torch.isnan(p), torch.isnan(r)) and torch.equal(torch.isinf(p), torch.isinf(r))
            assert_close(p.detach(), r.detach(), equal_nan=True)
    if case.name == "lion" and not math.isnan(bad):  # sign(c) of an infinite c is ±1: the step stays lr, the momentum holds it
        assert torch.isfinite(ps[1]).all() and not torch.isfinite(opt.state[ps[1]]["exp_avg"]).all()
        return
    assert not torch.isfinite(ps[1]).all()  # the bad gradient did reach the parameter
    assert torch.isfinite(ps[0]).all() and torch.isfinite(ps[2]).all()  # and nothing else


# -- skip ------------------------------------------------------------------------------


def _world_state(ps, opt):
    s = snapshot(ps, opt)
    del s["grads"], s["group_params"]  # grads are zeroed on a skipped step (documented); ids differ between runs
    return s


SKIP_SCENARIOS = {
    # name: (list of step gradients for the run WITH the bad step, index of the bad step)
    "all-grads": lambda s: ([s[0], with_bad(s[1]), s[2], s[3]], 1),
    "nan": lambda s: ([s[0], with_bad(s[1], which=0, value=NAN), s[2], s[3]], 1),
    "first-step-bad": lambda s: ([with_bad(s[0]), s[1], s[2], s[3]], 0),
    "none-grads-mixed": lambda s: ([drop(s[0], 1), with_bad(drop(s[1], 0), which=2), drop(s[2], 0), s[3]], 1),
    "two-bad-in-a-row": lambda s: ([s[0], with_bad(s[1]), with_bad(s[1], which=0, value=-INF), s[2], s[3]], 1),
}


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("scenario", sorted(SKIP_SCENARIOS))
@pytest.mark.parametrize("case", classes())
def test_skip_leaves_everything_and_continues_as_if_never_seen(case, scenario, groups):
    stream = grad_stream(4, case.dtype, device=case.device)
    with_bad_steps, first_bad = SKIP_SCENARIOS[scenario](stream)
    bad = [i for i, gs in enumerate(with_bad_steps)
           if any(g is not None and not torch.isfinite(g).all() for g in gs)]
    clean = [gs for i, gs in enumerate(with_bad_steps) if i not in bad]

    ps, opt = build(case, groups=groups, nonfinite="skip")
    for i, grads in enumerate(with_bad_steps):
        before = _world_state(ps, opt)
        with HostSyncCounter() as counter:
            feed(ps, opt, grads)
        assert counter.syncs == 0, f"step {i}: {counter.syncs} host syncs"
        if i in bad:
            assert_same(before, _world_state(ps, opt))
            # documented: a skipped step zeroes the gradients (the flat buffer, in place: no inf stays behind)
            assert all(p.grad is None or not p.grad.any() for p in ps), f"step {i}"

    ref_ps, ref = build(case, groups=groups, nonfinite="skip")
    for grads in clean:
        feed(ref_ps, ref, grads)
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))

    # and the finite part agrees with torch.optim (which never saw the bad steps; Lion: the float64 reference)
    tps = [torch.nn.Parameter(x) for x in init_params(case.dtype, case.device)]
    topt = case.twin_or_reference(tps)
    for grads in clean:
        feed(tps, topt, grads)
    for p, t in zip(ps, tps):
        assert_close(p.detach(), t.detach())


def _epsilon_cases():
    """Each optimizer with epsilon 0 and with its default epsilon (Momentum has none)."""
    out = []
    for param in classes(devices=("cpu",)):
        c = param.values[0]
        if c.entry.epsilon is None:
            out.append(pytest.param(c, {}, id=c.cls.__name__))
            continue
        default = c.cls.spec.defaults()[c.entry.epsilon]
        out += [pytest.param(c, c.epsilon_kwargs(0.0), id=f"{c.cls.__name__}-eps0"),
                pytest.param(c, c.epsilon_kwargs(default), id=f"{c.cls.__name__}-eps{default:g}")]
    return out


@pytest.mark.parametrize("case,kw", _epsilon_cases())
def test_skipped_first_step_with_zero_second_moment(case, kw):
    """A skipped first step (zero second moment) is exact even with epsilon 0: no 0 * (0/0) = NaN.

    (Found by this file: skip_identity now gates epsilon to 1 on a skipped step.)
    """
    p = torch.nn.Parameter(torch.ones(3))
    opt = case.cls([p], lr=0.1, nonfinite="skip", **kw)
    p.grad = torch.tensor([1.0, INF, 1.0])
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("name,hyper", [
    ("adam", dict(epsilon=1.0)), ("dml-adam", dict(epsilon=1.0)), ("adagrad", dict(epsilon=1.0)),
    ("momentum", dict(alpha=1.0, norm_coefficient=0.01)),
], ids=["adam-epsilon-1", "dml-adam-epsilon-1", "adagrad-epsilon-1", "momentum-alpha-1"])
def test_skip_gates_every_coefficient_when_one_already_has_its_no_op_value(name, hyper):
    """A hyperparameter equal to its no-op value on a skipped step (epsilon 1, alpha 1) stays a number;
    every later coefficient must still be gated (the step must still change nothing)."""
    c = case_of(name)
    ps, opt = build(c, nonfinite="skip", **hyper)
    feed(ps, opt, grad_stream(1, c.dtype)[0])
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(grad_stream(1, c.dtype, seed=9)[0], which=1))
    assert_same(before, _world_state(ps, opt))


@pytest.mark.parametrize("which", [0, 2], ids=["inf-in-group-0", "inf-in-group-1"])
def test_skip_is_one_decision_for_every_skip_buffer(which):
    """An inf in either group skips the other group's update too (a step is skipped as a whole;
    the verdict of every buffer counts, not only the last one's)."""
    ps, opt = build(ADAM, groups=True, nonfinite="skip")
    feed(ps, opt, grad_stream(1)[0])
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(grad_stream(1, seed=9)[0], which=which))
    assert_same(before, _world_state(ps, opt))


#: where the inf goes in the chunked tests: (parameter, index) and which chunk that is (SHAPES
#: (3, 2), (5,), (4,) packed in order = 15 elements, chunks of 4: [0, 4) [4, 8) [8, 12) [12, 15))
CHUNK_POSITIONS = {"first-chunk": (0, 1), "middle-chunk": (1, 1), "last-chunk": (2, 3)}
CHUNK = 4


def _chunk_of(opt, ps, which, index) -> int:
    """The chunk holding element ``index`` of ``ps[which]`` in the flat buffer (public layout)."""
    (info,) = buffers(opt)
    offset = (ps[which].data_ptr() - info.data.data_ptr()) // info.data.element_size() + index
    return offset // CHUNK


def _assert_chunk(opt, ps, position):
    which, index = CHUNK_POSITIONS[position]
    (info,) = buffers(opt)
    last = (info.numel - 1) // CHUNK
    got = _chunk_of(opt, ps, which, index)
    assert {"first-chunk": got == 0, "middle-chunk": 0 < got < last, "last-chunk": got == last}[position], (got, last)


@pytest.mark.parametrize("position", sorted(CHUNK_POSITIONS))
@pytest.mark.parametrize("case", classes())
def test_skip_in_chunked_precision_mode(case, position, monkeypatch):
    """float16 storage, float32 compute over 4-element chunks; the inf in the first, a middle or
    the last chunk (a verdict taken per chunk, or kept from the last chunk only, would fail)."""
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", CHUNK)
    which, index = CHUNK_POSITIONS[position]
    stream = grad_stream(4, torch.float16, device=case.device)
    bad_stream = [stream[0], with_bad(stream[1], which=which, index=index), stream[2], stream[3]]
    kw = dict(nonfinite="skip", compute_dtype=torch.float32, state_dtype=torch.float32)
    ps, opt = build(case, torch.float16, **kw)
    _assert_chunk(opt, ps, position)
    for i, grads in enumerate(bad_stream):
        before = _world_state(ps, opt)
        with HostSyncCounter() as counter:
            feed(ps, opt, grads)
        assert counter.syncs == 0
        if i == 1:
            assert_same(before, _world_state(ps, opt))
    assert runs_in_chunks(opt)
    ref_ps, ref = build(case, torch.float16, **kw)
    for grads in (stream[0], stream[2], stream[3]):
        feed(ref_ps, ref, grads)
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))


def test_skip_with_master_weights():
    stream = grad_stream(3, torch.float16)
    ps, opt = build(ADAM, torch.float16, nonfinite="skip", master_weights=True)
    feed(ps, opt, stream[0])
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(stream[1], which=0, value=NAN))
    assert_same(before, _world_state(ps, opt))
    feed(ps, opt, stream[2])
    ref_ps, ref = build(ADAM, torch.float16, nonfinite="skip", master_weights=True)
    feed(ref_ps, ref, stream[0])
    feed(ref_ps, ref, stream[2])
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))


@pytest.mark.parametrize("bits", [None, 8], ids=["full-state", "8-bit-state"])
@pytest.mark.parametrize("backend", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", classes())
def test_skip_with_kahan_leaves_parameters_and_compensation_bit_identical(case, backend, bits):
    """A skipped step's update is 0, and the compensation it carries must not be folded in either.

    ``round(x + c)`` is ``x`` for most elements (``|c|`` is below half an ulp of ``x``) but not all: just
    above a power of two the ulp below is half the ulp above, so 16k float16 elements give a few that a
    skipped step used to move (2 of 8192 in the run that found it).  Parameters, compensation and
    states stay as they were, and the run goes on as if the bad step never came.
    """
    from dml_optim.backends.compiled import compile_available

    if backend == "compiled" and not compile_available("cpu")[0]:
        pytest.skip(f"compiled backend unavailable here: {compile_available('cpu')[1]}")
    if backend == "compiled" and not hasattr(torch._inductor.config, "emulate_precision_casts"):
        pytest.skip(f"Kahan runs eager under torch {torch.__version__} (inductor cannot round casts before 2.5)")
    kw = dict(nonfinite="skip", kahan=True, backend=backend, state_bits=bits)
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 128), (8192,)]
    stream = [[torch.randn(s, generator=gen).to(case.device, torch.float16) for s in shapes] for _ in range(5)]

    def run(steps):
        gen0 = torch.Generator().manual_seed(11)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen0).to(case.device, torch.float16)) for s in shapes]
        opt = case.build(ps, **kw)
        for g in steps:
            feed(ps, opt, g)
        return ps, opt

    ps, opt = run(stream[:3])  # a few steps: the compensation holds something
    assert sum(int(i.kahan.ne(0).sum()) for i in opt.flat_buffers() if i.kahan is not None) > 1000
    before = _world_state(ps, opt)
    feed(ps, opt, with_bad(stream[3], which=1, value=NAN))
    assert_same(before, _world_state(ps, opt))
    feed(ps, opt, stream[4])
    ref_ps, ref = run([*stream[:3], stream[4]])
    assert_same(_world_state(ref_ps, ref), _world_state(ps, opt))


def test_skipped_step_is_not_counted_in_state_dict():
    ps, opt = build(ADAM, nonfinite="skip")
    stream = grad_stream(2)
    feed(ps, opt, stream[0])
    feed(ps, opt, with_bad(stream[1]))
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [1.0, 1.0, 1.0]


# -- raise -----------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("case", classes())
def test_raise_names_the_parameters_and_changes_nothing(case, groups):
    stream = grad_stream(2, case.dtype, device=case.device)
    ps, opt = build(case, groups=groups, nonfinite="raise")
    feed(ps, opt, stream[0])
    grads = with_bad(with_bad(drop(stream[1], 0), which=1, value=NAN), which=2, value=-INF)
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()
    before = snapshot(ps, opt)
    with pytest.raises(FloatingPointError) as info:
        opt.step()
    assert_same(before, snapshot(ps, opt))
    msg = str(info.value)
    g1 = "param_groups[0]['params'][1]"
    g2 = "param_groups[1]['params'][0]" if groups else "param_groups[0]['params'][2]"
    assert g1 in msg and "nothing was updated" in msg
    assert "param_groups[0]['params'][0]" not in msg  # its grad is None: not named
    if not groups:  # one buffer: both offenders are named in one message
        assert g2 in msg


def test_raise_costs_one_host_sync_per_step_and_propagate_none():
    ps, opt = build(ADAM, nonfinite="raise")
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 1
    ps, opt = build(ADAM, groups=True, nonfinite="raise")
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 1  # one per step, whatever the number of flat buffers
    ps, opt = build(ADAM)
    with HostSyncCounter() as counter:
        feed(ps, opt, grad_stream(1)[0])
    assert counter.syncs == 0


@pytest.mark.parametrize("position", sorted(CHUNK_POSITIONS))
def test_raise_in_chunked_mode(position, monkeypatch):
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", CHUNK)
    which, index = CHUNK_POSITIONS[position]
    stream = grad_stream(2, torch.float16)
    ps, opt = build(ADAM, torch.float16, nonfinite="raise", compute_dtype=torch.float32)
    _assert_chunk(opt, ps, position)
    feed(ps, opt, stream[0])
    grads = with_bad(stream[1], which=which, index=index)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    before = snapshot(ps, opt)
    with pytest.raises(FloatingPointError, match=rf"param_groups\[0\]\['params'\]\[{which}\]"):
        opt.step()
    assert_same(before, snapshot(ps, opt))


@pytest.mark.parametrize("kept", [False, True], ids=["fresh", "view-kept"])
def test_raise_mode_ignores_the_stale_gradient_slot_of_a_parameter_without_grad(kept):
    """An inf left in the flat gradient slot of a parameter whose grad was later set to
    None must not make every following step raise (with an empty parameter list): whether the
    other gradient is fresh (gathered with the slots zeroed) or its view kept (accumulated in
    place: the slot of the parameter without one is zeroed before the check reads the buffer)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = ADAM.cls([a, b], lr=0.1, nonfinite="raise")
    (a.sum() + (b * math.inf).sum()).backward()
    with pytest.raises(FloatingPointError, match=r"\['params'\]\[1\]"):
        opt.step()
    if kept:
        b.grad = None
        a.grad.zero_()
    else:
        a.grad = b.grad = None
    a.sum().backward()
    opt.step()  # b has no gradient now: nothing non-finite is left to report
    assert torch.isfinite(a).all() and not torch.equal(a.detach(), torch.ones(3))
    assert torch.equal(b.detach(), torch.ones(3))


def test_float16_overflow_to_inf_is_caught_by_skip():
    """A finite float32 value that overflows float16 (7e4 > 65504) is what 'skip' exists for."""
    g = torch.tensor([7e4]).to(torch.float16)
    assert math.isinf(float(g))
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    opt = ADAM.cls([p], nonfinite="skip", epsilon=1e-4)
    p.grad = g
    opt.step()
    assert float(p.detach()) == 1.0
