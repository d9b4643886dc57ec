"""Every optimizer of the test matrix (tests/matrix.py) against independent oracles over 50 steps (docs/design.md §2).

Model: mixed shapes (0-d, 1-d, 2-d, 4-d conv weight) in two param groups with
different hyperparameters (the second with ``norm_coefficient``/``weight_decay``).
Each matrix case (optimizer variant x dtype x backend x device) is compared, at every step, with

* its exact ``torch.optim`` twin per docs/design.md §2 (Adam and DmlAdam with
  epsilon 0; AdamW; Adagrad; Momentum standard, and nesterov with beta = 1),
  written out in the matrix, not taken from the registry;
* the float64 NumPy transcription of its spec (``tests/reference/numpy_ref.py``),
  applied parameter by parameter to our pre-step values, with T as docs/design.md
  §2 says (Adam/DmlAdam/AdamW from 1, Adagrad/Momentum from 0): every step's
  update and states to the tolerance of the parameter dtype, with a learning
  rate that changes every step (a scheduler: no recompilation, and the new
  value is used).

The backend axis: every case eager; each optimizer's default variant compiled
(slow) in float32, the dtype models train in (the compiled float64 coefficients
have their own test in ``test_backends.py``); a compile fallback fails the test.
And ``fused`` (torch's fused CPU kernels on the flat buffers, what ``auto`` runs
on the CPU): every variant the kernels take, in float32 and float64, against
torch's ``fused=True`` twin *bit for bit* (parameters and states, every step)
and against the float64 reference like the eager cases; a fused fallback fails
the test.  ``backend="fused"`` where it cannot run warns once and runs what
``auto`` runs (:func:`test_fused_where_it_cannot_run_warns_once_and_follows_the_reference`).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import dml_optim
import dml_optim.backends.choose
from dml_optim.backends import compiled
from dml_optim.backends.fused import FusedFallbackWarning
from dml_optim.optimizers import registry
from matrix import ENTRIES, FUSED_UNIT_ELEMENTS, Case, case_of, cases, classes, fused_cases
from tolerances import assert_close, assert_close_to_reference

STEPS = 50
SHAPES = [(), (7,), (5, 3), (4, 3, 3, 3)]
#: The same ranks in whole units of torch's fused kernels (matrix.FUSED_UNIT_ELEMENTS): a fused case equals
#: its ``fused=True`` twin bit for bit over these; over SHAPES, to rounding (its reference cases take SHAPES)
UNIT_SHAPES = [(FUSED_UNIT_ELEMENTS,), (2 * FUSED_UNIT_ELEMENTS,), (4, FUSED_UNIT_ELEMENTS // 4 * 3),
               (2, 2, 2, FUSED_UNIT_ELEMENTS // 2)]
#: Which parameter goes to which group: 0-d and conv in group 0, 1-d and 2-d in group 1.
GROUPS = [[0, 3], [1, 2]]
#: state_dict() numbers parameters in param-group order: index k is parameter ORDER[k].
ORDER = [i for idx in GROUPS for i in idx]

# eager: every variant in every dtype; compiled (slow): each optimizer's default variant in float32,
# whose graphs (one per group structure) both tests share; fused: every variant torch's fused kernels take,
# in float32 and float64 (no compile: as cheap as the eager cases)
COMPILED = dict(backends=("compiled",), dtypes=(torch.float32,))
TORCH_CASES = (cases(variants="all", twin=True, low_precision=False) + cases(twin=True, **COMPILED)
               + fused_cases(variants="all", twin=True))
REFERENCE_CASES = cases(variants="all") + cases(**COMPILED) + fused_cases(variants="all")


def _lr(step: int, base: float) -> float:
    """A schedule that changes the learning rate every step."""
    return base * (0.5 + 0.5 * (0.93**step))


@pytest.fixture
def compile_fallbacks_fail():
    """A compiled (or fused) case that fell back to eager would test eager twice."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", compiled.CompileFallbackWarning)
        warnings.simplefilter("error", FusedFallbackWarning)
        yield


def _initial(case: Case, shapes=SHAPES):
    g = torch.Generator().manual_seed(1234)
    return [case.randn(s, g) for s in shapes]


def _grads(case: Case, step: int, shapes=SHAPES):
    g = torch.Generator().manual_seed(10_000 + step)
    return [case.randn(s, g) for s in shapes]


def _split(params):
    return [params[i] for i in GROUPS[0]], [params[i] for i in GROUPS[1]]


def _group_of(i: int) -> int:
    return next(gi for gi, idx in enumerate(GROUPS) if i in idx)


def test_matrix_covers_the_registry():
    """Adding an optimizer to the registry without a matrix entry (or the reverse) fails here."""
    assert set(ENTRIES) == set(registry.OPTIMIZERS)
    for name, e in ENTRIES.items():
        assert e.states == e.cls.state_names, name
        assert set(e.dtypes) <= set(e.cls.dtypes), name
        if e.torch_class is not None:  # (a twinless optimizer, Lion, is checked against its float64 reference alone)
            assert any(e.twin_kwargs(v.hyper) is not None for v in e.variants), f"{name}: no variant with a torch twin"
        else:
            assert callable(e.reference), f"{name}: no torch twin and no reference"
        assert {n for n, *_ in e.intervals} == {h.name for h in e.cls.spec.hyperparameters if h.kind == "float"}, name


@pytest.mark.parametrize("case", cases(variants="all", devices=("cpu",), dtypes="widest"))
def test_the_registry_twin_is_the_matrix_twin(case: Case):
    """``registry.torch_equivalent(exact=True)`` (what ``audit``/``compare`` use) builds the twin
    written out in the matrix, and refuses where the matrix says there is none."""
    p = [torch.nn.Parameter(torch.zeros(2, dtype=case.dtype))]
    expected = case.entry.twin_kwargs(case.hyper)
    if expected is None:
        match = "no torch.optim twin" if case.entry.torch_class is None else "equivalent"
        with pytest.raises(ValueError, match=match):
            registry.torch_equivalent(case.name, p, exact=True, **case.hyper)
        return
    got = registry.torch_equivalent(case.name, p, exact=True, foreach=False, **case.hyper)
    assert type(got) is case.entry.torch_class
    group = got.param_groups[0]
    for key, value in expected.items():
        assert group[key] == pytest.approx(value, rel=1e-15, abs=0), key


@pytest.mark.parametrize("case", TORCH_CASES)
def test_matches_torch_optim_every_step(case: Case, compile_fallbacks_fail):
    """A fused case runs the kernels of its ``fused=True`` twin: over parameters of whole kernel units its
    parameters and states are equal bit for bit at every step; the others agree to the dtype's tolerance."""
    shapes = UNIT_SHAPES if case.bit_exact_twin else SHAPES
    ours_p, ref_p = ([torch.nn.Parameter(t.clone()) for t in _initial(case, shapes)] for _ in range(2))
    ours = case.build(case.groups(*_split(ours_p)))
    ref = case.twin(case.groups(*_split(ref_p)))
    tol = case.torch_tolerance()
    for step in range(STEPS):
        for p, q, g in zip(ours_p, ref_p, _grads(case, step, shapes)):
            p.grad = g.clone()
            q.grad = g.clone()
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours_p, ref_p)):
            if case.bit_exact_twin:
                assert torch.equal(p.detach(), q.detach()), (step, i)
                for name in case.states:
                    assert torch.equal(ours.state[p][name], ref.state[q][name]), (step, i, name)
            else:
                assert_close(p.detach(), q.detach(), **tol)
    # the states, in torch.optim's names, match too
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    # (torch.optim.SGD without momentum keeps no state at all, and neither do we)
    assert sorted(ours_sd["state"]) == sorted(ref_sd["state"]) == (list(range(len(shapes))) if case.states else [])
    for k in ref_sd["state"]:
        assert set(ours_sd["state"][k]) - {"step"} == set(ref_sd["state"][k]) - {"step"}
        for name in case.states:
            assert_close(ours_sd["state"][k][name], ref_sd["state"][k][name].to(case.dtype), **tol)
        if "step" in ref_sd["state"][k]:  # torch.optim.SGD keeps no step count
            assert float(ours_sd["state"][k]["step"]) == float(ref_sd["state"][k]["step"]) == STEPS
    if case.backend in ("compiled", "fused"):
        assert ours.resolved_backends() == [[case.backend], [case.backend]]
        assert ours.compile_fallback is None


def _follow_the_reference(case: Case, ours_p: list, ours, steps: int = STEPS) -> None:
    """Each of ``steps`` steps of ``ours`` (two groups over ``ours_p``), from our pre-step values, equals
    the float64 NumPy spec to the tolerance of the parameters' dtype, parameters and every state; the
    learning rate of both groups changes every step."""
    hypers = [case.hyper, {**case.hyper, **case.second}]
    base = [h["lr"] for h in hypers]
    for step in range(steps):
        for group, h, lr in zip(ours.param_groups, hypers, base):
            group["lr"] = h["lr"] = _lr(step, lr)
        grads = _grads(case, step)
        before = [p.detach().clone() for p in ours_p]
        states = ([[torch.full_like(p, case.entry.initial(hypers[_group_of(i)])) for _ in case.states]
                   for i, p in enumerate(ours_p)] if step == 0 else
                  [[ours.state[p][n].clone() for n in case.states] for p in ours_p])
        for p, g in zip(ours_p, grads):
            p.grad = g.clone()
        ours.step()
        for i, p in enumerate(ours_p):
            x, s = case.reference_step(hypers[_group_of(i)], step, before[i], grads[i], states[i])
            assert_close_to_reference(p.detach(), x)
            for name, expected in zip(case.states, s):
                assert_close_to_reference(ours.state[p][name], expected)
    sd = ours.state_dict()
    for k in range(len(ORDER)):  # (a rule without state, SGD without momentum, saves none, as torch.optim)
        assert (float(sd["state"][k]["step"]) == steps) if case.states else k not in sd["state"]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_matches_the_float64_reference_every_step(case: Case, compile_fallbacks_fail):
    """Each step, from our pre-step values, equals the float64 NumPy spec to the dtype's tolerance
    (parameters and every state), so an error of one step cannot hide in the drift of many; the
    learning rate of both groups changes every step."""
    ours_p = [torch.nn.Parameter(t.clone()) for t in _initial(case)]
    ours = case.build(case.groups(*_split(ours_p)))
    _follow_the_reference(case, ours_p, ours)
    assert ours.resolved_backends() == [[case.backend], [case.backend]]
    if case.backend == "compiled":
        assert ours.compile_fallback is None


def test_the_fused_axis_covers_every_optimizer():
    """Each optimizer has fused cases against its torch twin and the reference (the CPU, float32 and
    float64 where it has them), and exactly the variants without a torch kernel are left out."""
    fused_torch = {p.values[0].name for p in TORCH_CASES if p.values[0].backend == "fused"}
    fused_reference = [p.values[0] for p in REFERENCE_CASES if p.values[0].backend == "fused"]
    fused = {name for name, e in ENTRIES.items() if e.cls.rule.fused is not None}
    assert fused == set(ENTRIES) - {"lion"}  # (torch has no fused kernel of Lion's rule)
    assert fused_torch == {c.name for c in fused_reference} == fused
    left_out = {(e.name, v.id) for e in ENTRIES.values() if e.name in fused for v in e.variants} - {
        (c.name, c.variant.id) for c in fused_reference}
    assert left_out == {("adam", "adam-norm-coefficients")}  # (norm_coefficient_post: no torch kernel)
    assert all(c.dtype in (torch.float32, torch.float64) and c.device == "cpu" for c in fused_reference)


#: ``backend="fused"`` where torch's kernel cannot run: (case, options, what the warning says)
FUSED_FALLBACKS = {
    "adam-norm-coefficient-post": (case_of("adam", dtype=torch.float64, variant="adam-norm-coefficients", backend="fused"),
                                   {}, "not one of torch's fused kernels"),
    "dml-adam-float16": (case_of("dml-adam", dtype=torch.float16, variant="dml-adam-epsilon", backend="fused"),
                         {}, "float16 parameters"),
    "adamw-float16-states": (case_of("adamw", dtype=torch.float32, backend="fused"), dict(state_dtype=torch.float16),
                             "state_dtype or compute_dtype"),
}


@pytest.mark.parametrize("which", sorted(FUSED_FALLBACKS))
def test_fused_where_it_cannot_run_warns_once_and_follows_the_reference(which):
    """``backend="fused"`` on a buffer torch's kernel cannot run (a rule it does not compute, float16
    parameters, states in another dtype) warns once (FusedFallbackWarning, with the reason), runs what
    ``auto`` runs (eager for these small buffers) and still follows the float64 reference every step."""
    case, options, reason = FUSED_FALLBACKS[which]
    ours_p = [torch.nn.Parameter(t.clone()) for t in _initial(case)]
    ours = case.build(case.groups(*_split(ours_p)), **options)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _follow_the_reference(case, ours_p, ours, steps=10)  # (states compared in their stored dtype)
    fallbacks = [w for w in record if issubclass(w.category, FusedFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert reason in str(fallbacks[0].message) and "backend='auto'" in str(fallbacks[0].message)
    assert ours.resolved_backends() == [["eager"], ["eager"]]


#: precision modes: (parameter dtype, options); the rule runs in float32 over bounded chunks, converting
#: operands into a fixed scratch, or on a float32 master copy whose rounding is written to the parameters
PRECISION_MODES = {
    "fp16-params-fp32-compute": (torch.float16, dict(compute_dtype=torch.float32)),
    "fp32-params-fp16-states": (torch.float32, dict(state_dtype=torch.float16)),
    "fp16-master-weights": (torch.float16, dict(master_weights=True)),
}


@pytest.mark.parametrize("mode", sorted(PRECISION_MODES))
@pytest.mark.parametrize("case", classes())
def test_precision_modes_match_the_float64_reference_every_step(case: Case, mode):
    """Each step of a precision mode, from our pre-step values (the master copy where there is one),
    equals the float64 reference rounded to the stored dtypes: converted states are written back,
    the master copy is updated and rounded into the parameters."""
    dtype, options = PRECISION_MODES[mode]
    low = Case(case.entry, case.variant, dtype, case.backend, case.device)
    hyper = {**case.hyper, **case.epsilon_kwargs(1e-4)}  # an epsilon float16 can hold
    ours_p = [torch.nn.Parameter(t.clone()) for t in _initial(low)]
    ours = low.build(ours_p, **hyper, **options)
    master = options.get("master_weights", False)
    for step in range(10):
        grads = _grads(low, step)
        before = [(ours.state[p]["master_param"] if master and step else p.detach()).clone() for p in ours_p]
        states = ([[torch.zeros_like(p) for _ in low.states] for p in ours_p] if step == 0 else
                  [[ours.state[p][n].clone() for n in low.states] for p in ours_p])
        for p, g in zip(ours_p, grads):
            p.grad = g.clone()
        ours.step()
        for i, p in enumerate(ours_p):
            x, s = low.reference_step(hyper, step, before[i], grads[i], states[i])
            if master:
                assert_close_to_reference(ours.state[p]["master_param"], x)
                assert torch.equal(p.detach(), ours.state[p]["master_param"].to(dtype))
            else:
                assert_close_to_reference(p.detach(), x)
            for name, expected in zip(low.states, s):
                assert_close_to_reference(ours.state[p][name], expected)


@pytest.mark.parametrize("options, slots", [
    (dict(compute_dtype=torch.float32), 5),                               # x, g, exp_avg, exp_avg_sq + the rule's
    (dict(compute_dtype=torch.float32, state_dtype=torch.float32), 3),    # x, g + the rule's
    (dict(master_weights=True), 2),                                       # g (the master copy is float32) + the rule's
    (dict(kahan=True), 5),                                                # g, updated x, old x, compensation + the rule's
], ids=["fp16-fp32-compute", "fp16-fp32-states", "master-weights", "kahan"])
def test_a_chunked_update_has_one_scratch_slot_per_converted_operand(options, slots):
    """docs/design.md §5, Memory: a converting update runs over bounded chunks with one float32 slot
    per operand it converts (Kahan: the updated and the old parameters and the compensation) and the
    rule's own temporary; nothing more (Adam, float16 parameters)."""
    p = torch.nn.Parameter(torch.randn(10).half())
    p.grad = torch.randn(10).half()
    opt = dml_optim.Adam([p], epsilon=1e-4, **options)
    opt.step()
    scratch = opt.flat_buffers()[0].scratch
    assert len(scratch) == slots and all(t.dtype == torch.float32 and t.numel() == 10 for t in scratch)


def test_first_steps_use_the_spec_step_counters():
    """T from 1 for Adam (ONNX T = 0 would skip bias correction: a ~3x larger first
    update with these betas), T from 0 for Momentum (beta applies from the second step)."""
    x0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0.5, 0.25], dtype=torch.float64)
    p = torch.nn.Parameter(x0.clone())
    opt = dml_optim.Adam([p], lr=0.1, epsilon=0.0)
    p.grad = g.clone()
    opt.step()
    # T = 1: V = 0.1 g, H = 0.001 g^2, R_adj = 0.1 * sqrt(0.001) / 0.1: X = x0 - 0.1 * sign(g)
    torch.testing.assert_close(p.detach(), x0 - 0.1 * torch.sign(g), rtol=1e-12, atol=1e-12)
    q = torch.nn.Parameter(x0.clone())
    mom = dml_optim.Momentum([q], lr=0.1, alpha=0.9, beta=0.5)
    q.grad = g.clone()
    mom.step()  # T = 0: V = g (beta not applied)
    torch.testing.assert_close(q.detach(), x0 - 0.1 * g, rtol=1e-12, atol=1e-12)
    q.grad = g.clone()
    mom.step()  # T = 1: V = 0.9 g + 0.5 g
    torch.testing.assert_close(q.detach(), x0 - 0.1 * g - 0.1 * 1.4 * g, rtol=1e-12, atol=1e-12)
