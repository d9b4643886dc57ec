"""Bad inputs to the public functions of ``dml_optim.core.functional``, as a table.

Each case builds fresh arguments, calls the function and checks: the exception
type, that the message names the offending argument (and, where useful, the
bad value), and that no tensor passed in changed (bit-exact, compared with
clones taken before the call).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from dml_optim.core import functional as F

# Valid hyperparameters per function; a case overrides one of them.
HYPER = {
    "adagrad": {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.01},
    "momentum": {"alpha": 0.9, "beta": 0.9, "mode": "standard", "norm_coefficient": 0.01},
    "adam": {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "norm_coefficient": 0.01, "norm_coefficient_post": 0.01},
    "dml_adam": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
}
GROUPS = {"adagrad": 3, "momentum": 3, "adam": 4}  # X, G, then the states


def _t(shape=(3,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float64).to(dtype) + 0.5


def onnx_call(fn: str, n: int = 1, *, R=0.1, T=1, replace: dict | None = None, count: int | None = None, **hyper):
    """Arguments for ``fn`` with ``n`` tensors per group; ``replace`` maps (group, i) to a tensor.

    ``count`` truncates the flat tensor list to that many inputs (bad counts).
    Returns ``(function, args, kwargs)``.
    """
    groups = GROUPS[fn]
    tensors = [_t(seed=k) for k in range(groups * n)]
    for (group, i), tensor in (replace or {}).items():
        tensors[group * n + i] = tensor
    if count is not None:
        tensors = [_t(seed=k) for k in range(count)]
    return getattr(F, fn), (R, T, *tensors), {**HYPER[fn], **hyper}


def dml_call(*, T=1, replace: dict | None = None, **hyper):
    """Arguments for ``dml_adam(X, M, V, G, T)``; ``replace`` maps a name to a tensor."""
    tensors = {name: _t(seed=k) for k, name in enumerate("XMVG")}
    tensors.update(replace or {})
    return F.dml_adam, (*tensors.values(), T), {**HYPER["dml_adam"], **hyper}


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], tuple]  # -> (function, args, kwargs), fresh tensors every call
    exc: type[Exception]
    names: tuple[str, ...] = field(default=())  # fragments the message must contain
    marks: tuple = field(default=())  # pytest marks (xfail for a known, reported bug)


X, G = 0, 1  # group indices
NAN, INF = math.nan, math.inf

CASES = [
    # ---- input counts that do not split into the spec's groups
    Case("adagrad-no-tensors", lambda: onnx_call("adagrad", count=0), ValueError, ("inputs", "got 0")),
    Case("adagrad-4-tensors", lambda: onnx_call("adagrad", count=4), ValueError, ("inputs", "got 4")),
    Case("momentum-2-tensors", lambda: onnx_call("momentum", count=2), ValueError, ("inputs", "got 2")),
    Case("momentum-7-tensors", lambda: onnx_call("momentum", count=7), ValueError, ("inputs", "got 7")),
    Case("adam-no-tensors", lambda: onnx_call("adam", count=0), ValueError, ("inputs", "got 0")),
    Case("adam-5-tensors", lambda: onnx_call("adam", count=5), ValueError, ("inputs", "got 5")),
    Case("adam-6-tensors", lambda: onnx_call("adam", count=6), ValueError, ("inputs", "got 6")),
    # ---- an X_i whose gradient or state has another shape
    Case("adagrad-G1-shape", lambda: onnx_call("adagrad", 2, replace={(G, 1): _t((4,))}), ValueError, ("G[1]", "(4,)")),
    Case("adagrad-H0-shape", lambda: onnx_call("adagrad", 2, replace={(2, 0): _t((3, 1))}), ValueError, ("H[0]",)),
    Case("momentum-V1-shape", lambda: onnx_call("momentum", 2, replace={(2, 1): _t((1, 3))}), ValueError, ("V[1]",)),
    Case("adam-G0-broadcastable", lambda: onnx_call("adam", replace={(G, 0): _t((1,))}), ValueError, ("G[0]",)),
    Case("adam-V2-shape", lambda: onnx_call("adam", 3, replace={(2, 2): _t((2,))}), ValueError, ("V[2]",)),
    Case("adam-H3-shape", lambda: onnx_call("adam", 4, replace={(3, 3): _t(())}), ValueError, ("H[3]",)),
    Case("adam-0d-X-1d-G", lambda: onnx_call("adam", replace={(X, 0): _t(()), (G, 0): _t((1,))}),
         ValueError, ("G[0]",)),
    Case("dml-M-shape", lambda: dml_call(replace={"M": _t((2,))}), ValueError, ("M",)),
    Case("dml-G-shape", lambda: dml_call(replace={"G": _t((3, 1))}), ValueError, ("G",)),
    # ---- mixed dtypes within one tensor's group
    Case("adam-G0-float64", lambda: onnx_call("adam", replace={(G, 0): _t(dtype=torch.float64)}),
         TypeError, ("G[0]", "float64")),
    # ---- R and T: non-scalar, negative, non-integer, non-finite, wrong type
    Case("R-vector", lambda: onnx_call("adam", R=torch.full((2,), 0.1)), ValueError, ("R", "(2,)")),
    Case("T-vector", lambda: onnx_call("adagrad", T=torch.tensor([1, 2])), ValueError, ("T", "(2,)")),
    Case("dml-T-vector", lambda: dml_call(T=torch.ones(2, dtype=torch.int64)), ValueError, ("T",)),
    Case("T-negative", lambda: onnx_call("momentum", T=-1), ValueError, ("T", "-1")),
    Case("T-negative-tensor", lambda: onnx_call("adam", T=torch.tensor(-3)), ValueError, ("T", "-3")),
    Case("dml-T-negative", lambda: dml_call(T=-2), ValueError, ("T", "-2")),
    Case("T-1.5", lambda: onnx_call("adagrad", T=1.5), TypeError, ("T", "1.5")),
    Case("T-float-tensor", lambda: onnx_call("adam", T=torch.tensor(1.0)), TypeError, ("T", "float32")),
    Case("T-nan", lambda: onnx_call("adam", T=NAN), TypeError, ("T", "nan")),
    Case("T-bool", lambda: onnx_call("momentum", T=True), TypeError, ("T", "bool")),
    Case("T-string", lambda: onnx_call("adam", T="1"), TypeError, ("T", "'1'")),
    Case("dml-T-1.5", lambda: dml_call(T=1.5), TypeError, ("T", "1.5")),
    # an integer too large for a float (int64 is ONNX's type for T)
    Case("T-10**400", lambda: onnx_call("adam", T=10**400), ValueError, ("T", "int64")),
    Case("T-2**63", lambda: onnx_call("momentum", T=2**63), ValueError, ("T", "int64")),
    Case("R-nan", lambda: onnx_call("adam", R=NAN), ValueError, ("R", "nan")),
    Case("R-inf", lambda: onnx_call("momentum", R=INF), ValueError, ("R", "inf")),
    Case("R-minus-inf-tensor", lambda: onnx_call("adagrad", R=torch.tensor(-INF)), ValueError, ("R", "inf")),
    Case("R-string", lambda: onnx_call("adagrad", R="0.1"), TypeError, ("R", "'0.1'")),
    Case("R-bool", lambda: onnx_call("adam", R=True), TypeError, ("R", "bool")),
    Case("R-complex", lambda: onnx_call("adam", R=0.1 + 0j), TypeError, ("R", "complex")),
    Case("R-complex-tensor", lambda: onnx_call("momentum", R=torch.tensor(0.1 + 0j)), TypeError,
         ("R", "complex64")),
    # ---- integer, complex, boolean and non-tensor inputs
    Case("X-int64", lambda: onnx_call("adam", replace={(X, 0): torch.ones(3, dtype=torch.int64)}),
         TypeError, ("X[0]", "int64")),
    Case("adagrad-X0-int64", lambda: onnx_call("adagrad", replace={(X, 0): torch.ones(3, dtype=torch.int64)}),
         TypeError, ("X[0]", "int64")),
    Case("adam-V0-int16", lambda: onnx_call("adam", replace={(2, 0): torch.ones(3, dtype=torch.int16)}),
         TypeError, ("V[0]", "int16")),
    Case("G1-int32", lambda: onnx_call("adagrad", 2, replace={(G, 1): torch.ones(3, dtype=torch.int32)}),
         TypeError, ("G[1]", "int32")),
    Case("H0-complex64", lambda: onnx_call("adam", replace={(3, 0): _t(dtype=torch.complex64)}),
         TypeError, ("H[0]", "complex64")),
    Case("X-complex128", lambda: onnx_call("momentum", replace={(X, 0): _t(dtype=torch.complex128)}),
         TypeError, ("X[0]", "complex128")),
    Case("V-bool", lambda: onnx_call("momentum", replace={(2, 0): torch.ones(3, dtype=torch.bool)}),
         TypeError, ("V[0]", "bool")),
    Case("dml-X-int", lambda: dml_call(replace={"X": torch.ones(3, dtype=torch.int32)}), TypeError, ("X", "int32")),
    Case("dml-V-complex", lambda: dml_call(replace={"V": _t(dtype=torch.complex64)}), TypeError, ("V", "complex64")),
    Case("G-list", lambda: onnx_call("adagrad", replace={(G, 0): [1.0, 2.0, 3.0]}), TypeError, ("G[0]", "list")),
    # ---- momentum mode
    Case("mode-capitalised", lambda: onnx_call("momentum", mode="Standard"), ValueError, ("mode", "'Standard'")),
    Case("mode-sgd", lambda: onnx_call("momentum", mode="sgd"), ValueError, ("mode", "'sgd'")),
    Case("mode-bytes", lambda: onnx_call("momentum", mode=b"nesterov"), ValueError, ("mode",)),
    Case("mode-none", lambda: onnx_call("momentum", mode=None), ValueError, ("mode", "None")),
    # ---- non-finite hyperparameters
    Case("momentum-alpha-nan", lambda: onnx_call("momentum", alpha=NAN), ValueError, ("alpha", "nan")),
    Case("adam-alpha-inf", lambda: onnx_call("adam", alpha=INF), ValueError, ("alpha", "inf")),
    # an int beyond float's range (float() raises OverflowError): found by the state-dict fuzz test
    Case("adam-alpha-huge-int", lambda: onnx_call("adam", alpha=10**400), ValueError, ("alpha", "too large for a float", "1329 bits")),
    Case("adam-beta-nan", lambda: onnx_call("adam", beta=NAN), ValueError, ("beta", "nan")),
    Case("momentum-beta-minus-inf", lambda: onnx_call("momentum", beta=-INF), ValueError, ("beta", "inf")),
    Case("adagrad-epsilon-nan", lambda: onnx_call("adagrad", epsilon=NAN), ValueError, ("epsilon", "nan")),
    Case("adam-epsilon-inf", lambda: onnx_call("adam", epsilon=INF), ValueError, ("epsilon", "inf")),
    Case("adagrad-decay-inf", lambda: onnx_call("adagrad", decay_factor=INF), ValueError, ("decay_factor", "inf")),
    Case("adagrad-norm-nan", lambda: onnx_call("adagrad", norm_coefficient=NAN), ValueError, ("norm_coefficient",)),
    Case("momentum-norm-inf", lambda: onnx_call("momentum", norm_coefficient=INF), ValueError, ("norm_coefficient",)),
    Case("adam-norm-post-nan", lambda: onnx_call("adam", norm_coefficient_post=NAN), ValueError,
         ("norm_coefficient_post", "nan")),
    Case("adam-alpha-nan-tensor", lambda: onnx_call("adam", alpha=torch.tensor(NAN)), ValueError, ("alpha", "nan")),
    Case("dml-learning-rate-nan", lambda: dml_call(learning_rate=NAN), ValueError, ("learning_rate", "nan")),
    Case("dml-beta1-inf", lambda: dml_call(beta1=INF), ValueError, ("beta1", "inf")),
    Case("dml-epsilon-nan", lambda: dml_call(epsilon=NAN), ValueError, ("epsilon", "nan")),
    Case("dml-beta2-above-1", lambda: dml_call(beta2=1.5), ValueError, ("beta2", "1.5")),
    Case("dml-beta1-negative", lambda: dml_call(beta1=-0.1), ValueError, ("beta1", "-0.1")),
    Case("dml-beta2-negative", lambda: dml_call(beta2=-0.1), ValueError, ("beta2", "-0.1")),
    # ---- wrong hyperparameter types
    Case("momentum-alpha-bool", lambda: onnx_call("momentum", alpha=True), TypeError, ("alpha", "bool")),
    Case("adam-beta-bool", lambda: onnx_call("adam", beta=False), TypeError, ("beta", "bool")),
    Case("adagrad-epsilon-string", lambda: onnx_call("adagrad", epsilon="1e-8"), TypeError, ("epsilon", "'1e-8'")),
    Case("adam-epsilon-none", lambda: onnx_call("adam", epsilon=None), TypeError, ("epsilon", "None")),
    Case("momentum-norm-string", lambda: onnx_call("momentum", norm_coefficient="0"), TypeError, ("norm_coefficient",)),
    # a tensor of 2 elements is a ValueError, as torch.optim's "Tensor lr must be 1-element"
    Case("adam-alpha-vector", lambda: onnx_call("adam", alpha=torch.tensor([0.9, 0.9])), ValueError, ("alpha",)),
    Case("dml-learning-rate-bool", lambda: dml_call(learning_rate=True), TypeError, ("learning_rate", "bool")),
    Case("dml-beta2-string", lambda: dml_call(beta2="0.999"), TypeError, ("beta2",)),
]


def _snapshot(value):
    """Everything that identifies a tensor's contents, bit for bit (NaN-safe)."""
    if not isinstance(value, torch.Tensor):
        return None
    return value.dtype, tuple(value.shape), value.stride(), value.detach().cpu().resolve_conj().numpy().tobytes()


def _tensors(args, kwargs):
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input(case: Case):
    fn, args, kwargs = case.build()
    tensors = _tensors(args, kwargs)
    before = [_snapshot(t.clone()) for t in tensors]
    with pytest.raises(case.exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for fragment in case.names:  # as a whole word: "beta" is not found in "beta2" or "XXbetaXX"
        assert re.search(rf"(?<!\w){re.escape(fragment)}(?!\w)", message), f"{fragment!r} not in the message {message!r}"
    assert [_snapshot(t) for t in tensors] == before, "an input tensor changed"


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("fn", ["adagrad", "momentum", "adam", "dml_adam"])
def test_the_table_builders_make_valid_calls(fn):
    """Every bad case is one change away from a call that works: check the baseline works."""
    function, args, kwargs = dml_call() if fn == "dml_adam" else onnx_call(fn, 2)
    outputs = function(*args, **kwargs)
    assert all(torch.isfinite(o).all() for o in outputs)


def test_momentum_attributes_are_required():
    x = _t()
    for name in HYPER["momentum"]:
        kwargs = {k: v for k, v in HYPER["momentum"].items() if k != name}
        with pytest.raises(TypeError, match=name):
            F.momentum(0.1, 1, x, x, x, **kwargs)


def test_hyperparameters_are_keyword_only():
    x = _t()
    with pytest.raises(TypeError):
        F.dml_adam(x, x, x, x, 1, 1e-3, 0.9, 0.999, 1e-8)


def test_snapshot_sees_a_one_bit_change_and_is_nan_safe():
    """The "no input changed" check of test_bad_input can fail: it sees a single flipped bit."""
    t = torch.tensor([1.0, float("nan"), -0.0])
    before = _snapshot(t.clone())
    assert _snapshot(t) == before  # NaN compares equal to itself here, unlike torch.equal
    t.view(torch.int32)[0] ^= 1
    assert _snapshot(t) != before


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_R_may_be_a_one_element_tensor_of_any_shape(shape):
    """Like torch.optim's lr: a number or a 1-element tensor (0-d or not) gives the same update."""
    fn, args, kwargs = onnx_call("adam", R=torch.full(shape, 0.1, dtype=torch.float64))
    _, base_args, _ = onnx_call("adam", R=0.1)
    for out, expected in zip(fn(*args, **kwargs), fn(*base_args, **kwargs)):
        assert torch.equal(out, expected)


def test_dml_adam_accepts_the_ends_of_its_closed_beta_interval():
    """DirectML's Beta1 and Beta2 are in [0, 1] (the validator's rule), ends included."""
    for beta1, beta2 in ((0.0, 0.0), (1.0, 1.0)):
        fn, args, kwargs = dml_call(beta1=beta1, beta2=beta2, T=2)
        fn(*args, **kwargs)
