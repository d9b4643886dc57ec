"""Property tests (hypothesis) of ``dml_optim.core.functional`` against two independent oracles.

* ``tests/reference/numpy_ref.py``: float64 NumPy transcriptions of docs/design.md §2.
* ``onnx.reference.ReferenceEvaluator`` running a one-node model of the ONNX op.

Inputs: 1-4 tensors per call with independent random shapes (0-d and empty
included), ``T`` in {0, 1, a few hundred, 10**6}, attributes over their
sensible ranges, float32 and float64.  Attributes are drawn as float32 values
because ONNX stores them as FLOAT, so both oracles and ``dml_optim`` see the
same numbers.

Tolerance model: an output element may differ from the exact result by at most
``rtol * M`` where ``M`` is the same formula evaluated on absolute values (every
``-`` turned into ``+``), i.e. the scale of the terms that were added, which is
what rounding errors are proportional to.  This is "atol scaled to the
magnitude", per element, and it stays meaningful under cancellation.  Plus the
dtype's smallest normal number, for products that underflow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from dml_optim.core import functional as F
from reference import numpy_ref as ref

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install dml-optim[onnx])")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

# --------------------------------------------------------------------------
# the one tolerance table: |actual - expected| <= rtol * M (see the module docstring)
# --------------------------------------------------------------------------

TOLERANCES = {
    # float64 against float64 references: a few ulps (2.2e-16) of M.
    np.float64: {"rtol": 1e-12},
    # float32 against references fed the same float32 inputs: about 80 ulps (6e-8) of M,
    # room for ~10 roundings on each side.
    np.float32: {"rtol": 5e-6},
    # float16: "loosely" (ulp 4.9e-4; the coefficients round to float16 too, and
    # values below 6.1e-5 are subnormal, with a fixed absolute error of up to 3e-8).
    np.float16: {"rtol": 5e-2},
}
# Largest err/M observed in runs with max_examples=1000-3000 per test (elements with M > 1e-30):
# float64 4.7e-16; float32 3.0e-7 (public functions vs numpy_ref and ReferenceEvaluator,
# which rounds in float32 itself), 7.7e-7 (adam_ in place with 0-d tensor coefficients);
# float16 8.3e-3 (nesterov; subnormal inputs).
#
# Override: onnx.reference.ReferenceEvaluator hands attributes to the kernels as
# np.float32 scalars, so `1 - alpha`, `1 - beta`, `beta**T` are rounded to float32
# even for float64 tensors (beta=1e-8: its `1 - beta` is exactly 1.0).  Against it,
# float64 results are held to float32's bound.  Observed err/M: 5.4e-8.
EVALUATOR_TOLERANCES = {**TOLERANCES, np.float64: TOLERANCES[np.float32]}

TORCH_DTYPES = {np.float16: torch.float16, np.float32: torch.float32, np.float64: torch.float64}
ONNX_TYPES = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}

# Example counts scale with the hypothesis profile of tests/conftest.py: the oracle
# comparisons run 2x its max_examples (ci: 120), the lighter checks 2/3 (ci: 40); with
# the ci profile the whole file takes about 7 s of CPU.
PROFILE = settings(max_examples=2 * settings().max_examples, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])
LIGHT = settings(max_examples=max(10, 2 * settings().max_examples // 3), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


def assert_within(actual, expected, magnitude, dtype, what: str, tolerances=TOLERANCES) -> None:
    """``|actual - expected| <= rtol(dtype) * magnitude`` element-wise; NaN only where expected is NaN."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan), f"{what}: NaN at other positions than the reference"
    err = np.abs(actual - expected)[~nan]
    rtol = tolerances[dtype]["rtol"]
    # + the smallest normal number: products that underflow lose everything below it
    bound = rtol * np.asarray(magnitude, dtype=np.float64)[~nan] + np.finfo(dtype).tiny
    bad = ~(err <= bound)
    if bad.any():
        i = np.flatnonzero(bad)[0]
        raise AssertionError(
            f"{what} ({np.dtype(dtype).name}): {bad.sum()} element(s) off; first: got {actual[~nan][i]!r}, "
            f"expected {expected[~nan][i]!r}, error {err[i]:.3g} > bound {bound[i]:.3g} "
            f"(err/M = {err[i] / np.asarray(magnitude, dtype=np.float64)[~nan][i]:.3g})"
        )


# --------------------------------------------------------------------------
# magnitude bounds M: the formulas of docs/design.md §2 on absolute values
# --------------------------------------------------------------------------


def _abs(a) -> np.ndarray:
    return np.abs(np.asarray(a, dtype=np.float64))  # in float64: M itself must not round or underflow


def _g_mag(x, g, norm_coefficient):
    return abs(norm_coefficient) * _abs(x) + _abs(g)


def magnitudes_adagrad(R, T, X, G, H, H_new, *, decay_factor, epsilon, norm_coefficient):
    r = abs(R / (1 + T * decay_factor))
    out_x, out_h = [], []
    for x, g, h, h_new in zip(X, G, H, H_new):
        g_mag = _g_mag(x, g, norm_coefficient)
        out_x.append(_abs(x) + r * g_mag / (np.sqrt(h_new) + epsilon))
        out_h.append(_abs(h) + g_mag * g_mag)
    return out_x + out_h


def magnitudes_momentum(R, T, X, G, V, *, alpha, beta, mode, norm_coefficient):
    beta_adj = abs(beta) if T > 0 else 1.0
    out_x, out_v = [], []
    for x, g, v in zip(X, G, V):
        g_mag = _g_mag(x, g, norm_coefficient)
        v_mag = abs(alpha) * _abs(v) + beta_adj * g_mag
        step = v_mag if mode == "standard" else g_mag + abs(alpha) * v_mag
        out_x.append(_abs(x) + abs(R) * step)
        out_v.append(v_mag)
    return out_x + out_v


def magnitudes_adam(R, T, X, G, V, H, H_new, *, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post):
    r_adj = abs(R * np.sqrt(1 - beta**T) / (1 - alpha**T)) if T > 0 else abs(R)
    out_x, out_v, out_h = [], [], []
    for x, g, v, h, h_new in zip(X, G, V, H, H_new):
        g_mag = _g_mag(x, g, norm_coefficient)
        v_mag = abs(alpha) * _abs(v) + abs(1 - alpha) * g_mag
        out_x.append(abs(1 - norm_coefficient_post) * (_abs(x) + r_adj * v_mag / (np.sqrt(h_new) + epsilon)))
        out_v.append(v_mag)
        out_h.append(abs(beta) * _abs(h) + abs(1 - beta) * g_mag * g_mag)
    return out_x + out_v + out_h


# --------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------

def _f32(low, high, **kwargs):
    """Floats in [low, high] that are float32 values (ONNX FLOAT attributes)."""
    return st.floats(float(np.float32(low)), float(np.float32(high)), width=32, allow_subnormal=False, **kwargs)


DTYPES = st.sampled_from([np.float32, np.float64])
STEPS = st.one_of(st.sampled_from([0, 1, 10**6]), st.integers(2, 500))
UNIT = _f32(0.0, 1.0, exclude_max=True)  # alpha, beta in [0, 1)
EPSILON = _f32(1e-8, 1e-1)
NORM = st.one_of(st.just(0.0), _f32(0.0, 0.1))
RATE = st.one_of(st.just(0.0), _f32(1e-4, 1.0))


@st.composite
def tensor_groups(draw, groups: int, dtype, states: tuple[int, ...], count=st.integers(1, 4)):
    """``groups`` lists of ``n`` arrays (``n`` drawn from ``count``), entry i of every list with one shape.

    Groups listed in ``states`` hold squared-gradient accumulators: drawn >= 0.
    """
    n = draw(count)
    shapes = [draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)) for _ in range(n)]
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for k in range(groups):
        if k in states:
            out.append([(rng.uniform(0, 1, s) * scale * scale).astype(dtype) for s in shapes])
        else:
            out.append([(rng.uniform(-1, 1, s) * scale).astype(dtype) for s in shapes])
    return out


def _torch(arrays):
    return [torch.from_numpy(np.array(a, copy=True)) for a in arrays]


def _numpy(tensors):
    return [t.numpy() for t in tensors]


def _onnx_outputs(op_type, dtype, R, T, groups, n_outputs_per_tensor, **attrs):
    """Run a one-node model of ``op_type`` through ``onnx.reference.ReferenceEvaluator``."""
    flat = [a for group in groups for a in group]
    names = [f"in{i}" for i in range(len(flat))]
    outs = [f"out{i}" for i in range(len(groups[0]) * n_outputs_per_tensor)]
    node = helper.make_node(op_type, ["R", "T", *names], outs, domain="ai.onnx.preview.training", **attrs)
    elem = ONNX_TYPES[dtype]
    graph = helper.make_graph(
        [node],
        op_type,
        [helper.make_tensor_value_info("R", elem, []), helper.make_tensor_value_info("T", TensorProto.INT64, [])]
        + [helper.make_tensor_value_info(nm, elem, a.shape) for nm, a in zip(names, flat)],
        [helper.make_tensor_value_info(nm, elem, None) for nm in outs],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.preview.training", 1)],
    )
    feeds = {"R": np.array(R, dtype=dtype), "T": np.array(T, dtype=np.int64)}
    feeds.update(zip(names, flat))
    return ReferenceEvaluator(model).run(None, feeds)


# --------------------------------------------------------------------------
# the three ONNX ops against numpy_ref and the ONNX reference evaluator
# --------------------------------------------------------------------------


@PROFILE
@given(data=st.data(), dtype=DTYPES, T=STEPS, R=RATE,
       decay_factor=st.one_of(st.just(0.0), _f32(0.0, 1.0)), epsilon=EPSILON, norm_coefficient=NORM)
def test_adagrad(data, dtype, T, R, decay_factor, epsilon, norm_coefficient):
    X, G, H = data.draw(tensor_groups(3, dtype, states=(2,)))
    attrs = {"decay_factor": decay_factor, "epsilon": epsilon, "norm_coefficient": norm_coefficient}
    got = _numpy(F.adagrad(R, T, *_torch(X), *_torch(G), *_torch(H), **attrs))
    assert [a.dtype for a in got] == [np.dtype(dtype)] * len(got)
    X_new, H_new = ref.onnx_adagrad(R, T, X, G, H, **attrs)
    expected = X_new + H_new
    magnitude = magnitudes_adagrad(R, T, X, G, H, H_new, **attrs)
    for i, (a, e, m) in enumerate(zip(got, expected, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"adagrad output {i} vs numpy_ref")
    evaluated = _onnx_outputs("Adagrad", dtype, R, T, [X, G, H], 2, **attrs)
    for i, (a, e, m) in enumerate(zip(got, evaluated, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"adagrad output {i} vs ReferenceEvaluator", EVALUATOR_TOLERANCES)


@PROFILE
@given(data=st.data(), dtype=DTYPES, T=STEPS, R=RATE, alpha=UNIT, beta=UNIT,
       mode=st.sampled_from(["standard", "nesterov"]), norm_coefficient=NORM)
def test_momentum(data, dtype, T, R, alpha, beta, mode, norm_coefficient):
    X, G, V = data.draw(tensor_groups(3, dtype, states=()))
    attrs = {"alpha": alpha, "beta": beta, "mode": mode, "norm_coefficient": norm_coefficient}
    got = _numpy(F.momentum(R, T, *_torch(X), *_torch(G), *_torch(V), **attrs))
    assert [a.dtype for a in got] == [np.dtype(dtype)] * len(got)
    X_new, V_new = ref.onnx_momentum(R, T, X, G, V, **attrs)
    magnitude = magnitudes_momentum(R, T, X, G, V, **attrs)
    for i, (a, e, m) in enumerate(zip(got, X_new + V_new, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"momentum output {i} vs numpy_ref")
    evaluated = _onnx_outputs("Momentum", dtype, R, T, [X, G, V], 2, **attrs)
    for i, (a, e, m) in enumerate(zip(got, evaluated, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"momentum output {i} vs ReferenceEvaluator", EVALUATOR_TOLERANCES)


@PROFILE
@given(data=st.data(), dtype=DTYPES, T=STEPS, R=RATE, alpha=UNIT, beta=UNIT, epsilon=EPSILON,
       norm_coefficient=NORM, norm_coefficient_post=NORM)
def test_adam(data, dtype, T, R, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post):
    X, G, V, H = data.draw(tensor_groups(4, dtype, states=(3,)))
    attrs = {"alpha": alpha, "beta": beta, "epsilon": epsilon,
             "norm_coefficient": norm_coefficient, "norm_coefficient_post": norm_coefficient_post}
    got = _numpy(F.adam(R, T, *_torch(X), *_torch(G), *_torch(V), *_torch(H), **attrs))
    assert [a.dtype for a in got] == [np.dtype(dtype)] * len(got)
    X_new, V_new, H_new = ref.onnx_adam(R, T, X, G, V, H, **attrs)
    magnitude = magnitudes_adam(R, T, X, G, V, H, H_new, **attrs)
    for i, (a, e, m) in enumerate(zip(got, X_new + V_new + H_new, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"adam output {i} vs numpy_ref")
    if dtype == np.float64 and len(X) > 1:
        # onnx.reference's Adam casts every output of a multi-tensor node to float32
        # (op_adam.py: `xs.append(a.astype(np.float32))`); dml_optim keeps float64,
        # so for float64 the oracle is numpy_ref alone (checked above).
        return
    evaluated = _onnx_outputs("Adam", dtype, R, T, [X, G, V, H], 3, **attrs)
    for i, (a, e, m) in enumerate(zip(got, evaluated, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"adam output {i} vs ReferenceEvaluator", EVALUATOR_TOLERANCES)


# --------------------------------------------------------------------------
# DirectML ADAM_OPTIMIZER
# --------------------------------------------------------------------------


@st.composite
def dml_case(draw, min_step=1):
    dtype = draw(DTYPES)
    (X,), (M,), (V,), (G,) = draw(tensor_groups(4, dtype, states=(2,), count=st.just(1)))
    T = draw(st.one_of(st.sampled_from([min_step, 1, 10**6]), st.integers(max(min_step, 2), 500)))
    hyper = {"learning_rate": draw(RATE), "beta1": draw(UNIT), "beta2": draw(UNIT), "epsilon": draw(EPSILON)}
    return dtype, X, M, V, G, T, hyper


@PROFILE
@given(case=dml_case())
def test_dml_adam_matches_reference(case):
    dtype, X, M, V, G, T, hyper = case
    got = _numpy(F.dml_adam(*_torch([X, M, V, G]), T, **hyper))
    assert [a.dtype for a in got] == [np.dtype(dtype)] * 3
    X_new, M_new, V_new = ref.dml_adam(X, M, V, G, T, **hyper)
    magnitude = magnitudes_adam(
        hyper["learning_rate"], T, [X], [G], [M], [V], [V_new], alpha=hyper["beta1"], beta=hyper["beta2"],
        epsilon=hyper["epsilon"], norm_coefficient=0.0, norm_coefficient_post=0.0,
    )
    for i, (a, e, m) in enumerate(zip(got, [X_new, M_new, V_new], magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"dml_adam output {i} vs numpy_ref")


@PROFILE
@given(case=dml_case())
def test_dml_adam_is_onnx_adam_without_norm_coefficients(case):
    """docs/design.md §2: for T >= 1, DML Adam = ONNX Adam with both norm coefficients 0
    (LearningRate = R, Beta1 = alpha, Beta2 = beta; M = V, V = H; note the argument orders)."""
    dtype, X, M, V, G, T, hyper = case
    dml = _numpy(F.dml_adam(*_torch([X, M, V, G]), T, **hyper))
    onnx_out = _numpy(F.adam(hyper["learning_rate"], T, *_torch([X, G, M, V]), alpha=hyper["beta1"],
                             beta=hyper["beta2"], epsilon=hyper["epsilon"], norm_coefficient=0.0,
                             norm_coefficient_post=0.0))
    _, _, V_new = ref.dml_adam(X, M, V, G, T, **hyper)
    magnitude = magnitudes_adam(
        hyper["learning_rate"], T, [X], [G], [M], [V], [V_new], alpha=hyper["beta1"], beta=hyper["beta2"],
        epsilon=hyper["epsilon"], norm_coefficient=0.0, norm_coefficient_post=0.0,
    )
    for i, (a, e, m) in enumerate(zip(dml, onnx_out, magnitude, strict=True)):
        assert_within(a, e, m, dtype, f"dml_adam output {i} vs adam")


@PROFILE
@given(case=dml_case())
def test_dml_adam_at_step_zero_is_nan_where_onnx_is_not(case):
    """At T = 0 DirectML's Alpha is 0/0 (NaN parameters); ONNX disables the bias correction instead."""
    dtype, X, M, V, G, _, hyper = case
    x_dml, m_dml, v_dml = F.dml_adam(*_torch([X, M, V, G]), 0, **hyper)
    assert torch.isnan(x_dml).all()
    x_onnx, m_onnx, v_onnx = F.adam(hyper["learning_rate"], 0, *_torch([X, G, M, V]), alpha=hyper["beta1"],
                                    beta=hyper["beta2"], epsilon=hyper["epsilon"])
    assert torch.isfinite(x_onnx).all()
    # the moments do not involve Alpha: same as ONNX
    assert torch.equal(m_dml, m_onnx) and torch.equal(v_dml, v_onnx)


# --------------------------------------------------------------------------
# dtypes (float16 too) and immutability of the inputs
# --------------------------------------------------------------------------


def _call(op, R, T, groups, dtype):
    """Run ``op`` on ``groups`` (lists of numpy arrays); returns (outputs, numpy_ref outputs, magnitudes)."""
    tensors = [t.to(TORCH_DTYPES[dtype]) for group in groups for t in _torch(group)]
    # the references see exactly the values the tensors hold (rounded to dtype)
    groups = [[np.asarray(a, dtype=dtype) for a in group] for group in groups]
    if op == "adagrad":
        attrs = {"decay_factor": 0.1, "epsilon": 1e-3, "norm_coefficient": 0.01}
        out = F.adagrad(R, T, *tensors, **attrs)
        X_new, H_new = ref.onnx_adagrad(R, T, *groups, **attrs)
        return out, X_new + H_new, magnitudes_adagrad(R, T, *groups, H_new, **attrs)
    if op in ("standard", "nesterov"):
        attrs = {"alpha": 0.9, "beta": 0.8, "mode": op, "norm_coefficient": 0.01}
        out = F.momentum(R, T, *tensors, **attrs)
        X_new, V_new = ref.onnx_momentum(R, T, *groups, **attrs)
        return out, X_new + V_new, magnitudes_momentum(R, T, *groups, **attrs)
    if op == "adam":
        attrs = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-3, "norm_coefficient": 0.01, "norm_coefficient_post": 0.01}
        out = F.adam(R, T, *tensors, **attrs)
        X_new, V_new, H_new = ref.onnx_adam(R, T, *groups, **attrs)
        return out, X_new + V_new + H_new, magnitudes_adam(R, T, *groups, H_new, **attrs)
    assert op == "dml_adam"
    hyper = {"learning_rate": R, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-3}
    x, m, v, g = tensors
    out = F.dml_adam(x, m, v, g, max(T, 1), **hyper)
    (X,), (M,), (V,), (G,) = groups
    expected = ref.dml_adam(X, M, V, G, max(T, 1), **hyper)
    magnitude = magnitudes_adam(R, max(T, 1), [X], [G], [M], [V], [expected[2]], alpha=0.9, beta=0.999,
                                epsilon=1e-3, norm_coefficient=0.0, norm_coefficient_post=0.0)
    return out, list(expected), magnitude


# op -> (number of tensor groups, indices of the groups that are >= 0)
OPS = {"adagrad": (3, (2,)), "standard": (3, ()), "nesterov": (3, ()), "adam": (4, (3,)), "dml_adam": (4, (2,))}


def _count(op):
    return st.just(1) if op == "dml_adam" else st.integers(1, 4)  # DirectML's operator takes one tensor


@LIGHT
@given(data=st.data(), op=st.sampled_from(sorted(OPS)), T=st.sampled_from([0, 1, 7, 10**6]),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_outputs_keep_dtype(data, op, T, dtype):
    groups, states = OPS[op]
    arrays = data.draw(tensor_groups(groups, np.float64, states=states, count=_count(op)))
    # float16: keep magnitudes O(1) (no overflow of G*G, few subnormals) and H away from 0
    arrays = [[a / max(1.0, float(np.abs(a).max(initial=0))) for a in group] for group in arrays]
    if dtype == np.float16:
        arrays = [[0.25 + 0.75 * a if k in states else a for a in group] for k, group in enumerate(arrays)]
    out, expected, magnitude = _call(op, 0.01, T, arrays, dtype)
    assert [t.dtype for t in out] == [TORCH_DTYPES[dtype]] * len(expected)
    for i, (a, e, m) in enumerate(zip(out, expected, magnitude, strict=True)):
        assert_within(a.float().numpy() if dtype == np.float16 else a.numpy(), e, m, dtype, f"{op} output {i}")


def _bits(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.stride(), t.detach().numpy().tobytes()


@LIGHT
@given(data=st.data(), op=st.sampled_from(sorted(OPS)), T=st.sampled_from([0, 1, 10**6]),
       alias=st.booleans(), as_tensor=st.booleans())
def test_inputs_are_never_modified(data, op, T, alias, as_tensor):
    groups, states = OPS[op]
    arrays = data.draw(tensor_groups(groups, np.float32, states=states, count=_count(op)))
    tensors = [t for group in arrays for t in _torch(group)]
    if alias:  # the same tensor object as parameter and gradient
        n = len(arrays[0])
        if op == "dml_adam":
            tensors[3] = tensors[0]  # (X, M, V, G)
        else:
            tensors[n] = tensors[0]
    R = torch.tensor(0.1, dtype=torch.float64) if as_tensor else 0.1
    T_in = torch.tensor(T) if as_tensor else T
    scalars = [s for s in (R, T_in) if isinstance(s, torch.Tensor)]
    before = [_bits(t.clone()) for t in tensors + scalars]
    if op == "adagrad":
        out = F.adagrad(R, T_in, *tensors, epsilon=1e-3, norm_coefficient=0.1, decay_factor=0.1)
    elif op in ("standard", "nesterov"):
        out = F.momentum(R, T_in, *tensors, alpha=0.9, beta=0.9, mode=op, norm_coefficient=0.1)
    elif op == "adam":
        out = F.adam(R, T_in, *tensors, norm_coefficient=0.1, norm_coefficient_post=0.1)
    else:
        out = F.dml_adam(*tensors, max(T_in, 1), learning_rate=0.1, beta1=0.9, beta2=0.999, epsilon=1e-8)
    assert [_bits(t) for t in tensors + scalars] == before
    # and no output shares memory with an input (later in-place use of an output cannot corrupt an input)
    inputs_storage = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    assert not any(o.untyped_storage().data_ptr() in inputs_storage for o in out if o.numel())


# --------------------------------------------------------------------------
# coefficient functions: T as a number or as a 0-d tensor (a step counter kept on the device)
# --------------------------------------------------------------------------

# An int64 T makes torch evaluate `beta**T`, `1 - beta**T`, ... in the default dtype
# (float32), where `1 - beta**T` cancels for beta near 1: the int64 case draws the usual
# hyperparameters only and allows 1e-3 (observed 2.0e-5 with the T=0/T>0 selection fixed).
# A float64 T stays float64: observed 3.4e-16 for the usual betas.  For beta just below 1 the
# *number* path (the expected value) is the imprecise one: `1 - beta**T` in float64 cancels,
# a relative error of about eps64 / (1 - beta**T) (T = 60, beta = 1 - 6e-8: observed 1.0e-12),
# while the tensor path computes -expm1(T * log(beta)); `_cancellation` allows for it.
STEP_TENSOR_CASES = {
    torch.int64: (st.sampled_from([0.0, 0.5, 0.9, 0.99, 0.999]), 1e-3),
    torch.float64: (UNIT, 1e-12),
}


def _cancellation(T, *bases) -> float:
    """The relative rounding error of ``1 - base**T`` computed in float64 on the host, for the worst base."""
    worst = max((1.0 / (1.0 - b**T) for b in bases if T > 0 and b**T < 1.0), default=1.0)
    return 8 * 2.0**-52 * worst


def _coefficients(R, T, alpha, beta, decay_factor):
    return {
        "adagrad": F.adagrad_coefficients(R, T, decay_factor=decay_factor),
        "momentum": F.momentum_coefficients(R, T, beta=beta),
        "adam": F.adam_coefficients(R, T, alpha=alpha, beta=beta),
        "dml_adam": F.dml_adam_coefficients(R, T, beta1=alpha, beta2=beta),
    }


@pytest.mark.parametrize("step_dtype", [
    pytest.param(torch.int64, id="int64"),
    pytest.param(torch.float64, id="float64"),
])
@LIGHT
@given(data=st.data(), T=STEPS, R=RATE, decay_factor=_f32(0.0, 1.0))
def test_coefficients_take_T_as_a_number_or_a_tensor(step_dtype, data, T, R, decay_factor):
    """``*_coefficients`` accept T as a 0-d tensor (a step counter kept on the device) and
    give the values they give for the number T."""
    hyper, rtol = STEP_TENSOR_CASES[step_dtype]
    alpha, beta = data.draw(hyper), data.draw(hyper)
    rtol = max(rtol, _cancellation(T, alpha, beta))
    expected = _coefficients(R, T, alpha, beta, decay_factor)
    got = _coefficients(R, torch.tensor(T, dtype=step_dtype), alpha, beta, decay_factor)
    for op, coefficients in expected.items():
        for name, want in coefficients.items():
            value = float(got[op][name])
            assert value == pytest.approx(float(want), rel=rtol, abs=1e-300, nan_ok=True), (
                f"{op} {name} at T={T} ({step_dtype}): {value!r} != {want!r}"
            )


# --------------------------------------------------------------------------
# in-place kernels (what the optimizers run) = the public functions
# --------------------------------------------------------------------------


@LIGHT
@given(data=st.data(), op=st.sampled_from(["adagrad", "standard", "nesterov", "adam"]), dtype=DTYPES,
       T=st.sampled_from([0, 1, 7, 10**6]), tensor_coefficients=st.booleans(), scratch=st.booleans(),
       norm_coefficient=NORM)
def test_in_place_kernels_match_the_public_functions(data, op, dtype, T, tensor_coefficients, scratch,
                                                     norm_coefficient):
    """``*_coefficients`` + ``adagrad_``/``momentum_``/``adam_`` in place, with hyperparameters as numbers
    or as 0-d tensors (a float T counter on the device) and with or without scratch buffers, give what
    the out-of-place public functions give."""
    groups, states = OPS[op]
    arrays = data.draw(tensor_groups(groups, dtype, states=states, count=st.just(1)))
    x, g, *state = (t for (t,) in (_torch(group) for group in arrays))
    R, alpha, beta, epsilon, post = 0.05, 0.9, 0.99, 1e-3, 0.01
    torch_dtype = TORCH_DTYPES[dtype]

    def c(value):
        return torch.tensor(value, dtype=torch_dtype) if tensor_coefficients else value

    buffers = {"scratch": torch.empty_like(x)} if scratch else {}
    if op == "adagrad":
        expected = F.adagrad(R, T, x, g, *state, decay_factor=0.1, epsilon=epsilon, norm_coefficient=norm_coefficient)
        magnitude = magnitudes_adagrad(R, T, *arrays, ref.onnx_adagrad(R, T, *arrays, decay_factor=0.1,
                                       epsilon=epsilon, norm_coefficient=norm_coefficient)[1],
                                       decay_factor=0.1, epsilon=epsilon, norm_coefficient=norm_coefficient)
        coefficients = F.adagrad_coefficients(c(R), c(float(T)), decay_factor=0.1)
        x_new, h_new = x.clone(), state[0].clone()
        F.adagrad_(x_new, g, h_new, epsilon=c(epsilon), norm_coefficient=c(norm_coefficient), **coefficients,
                   **({**buffers, "scratch2": torch.empty_like(x)} if scratch else {}))
        got = [x_new, h_new]
    elif op in ("standard", "nesterov"):
        attrs = {"alpha": alpha, "beta": 0.5, "mode": op, "norm_coefficient": norm_coefficient}
        expected = F.momentum(R, T, x, g, *state, **attrs)
        magnitude = magnitudes_momentum(R, T, *arrays, **attrs)
        coefficients = F.momentum_coefficients(c(R), c(float(T)), beta=0.5)
        x_new, v_new = x.clone(), state[0].clone()
        F.momentum_(x_new, g, v_new, alpha=c(alpha), nesterov=op == "nesterov",
                    norm_coefficient=c(norm_coefficient), **coefficients, **buffers)
        got = [x_new, v_new]
    else:
        attrs = {"alpha": alpha, "beta": beta, "epsilon": epsilon, "norm_coefficient": norm_coefficient,
                 "norm_coefficient_post": post}
        expected = F.adam(R, T, x, g, *state, **attrs)
        magnitude = magnitudes_adam(R, T, *arrays, ref.onnx_adam(R, T, *arrays, **attrs)[2], **attrs)
        coefficients = F.adam_coefficients(c(R), c(float(T)), alpha=alpha, beta=beta)
        x_new, v_new, h_new = x.clone(), state[0].clone(), state[1].clone()
        F.adam_(x_new, g, v_new, h_new, alpha=c(alpha), beta=c(beta), epsilon=c(epsilon),
                norm_coefficient=c(norm_coefficient), norm_coefficient_post=c(post), **coefficients, **buffers)
        got = [x_new, v_new, h_new]
    for i, (a, e, m) in enumerate(zip(got, expected, magnitude, strict=True)):
        assert a.dtype == e.dtype
        assert_within(a.numpy(), e.numpy(), m, dtype, f"{op} in place, output {i}")
