"""ONNX backend node tests for Adagrad/Momentum/Adam, run through ``dml_optim.onnx.run_node``.

The cases are generated in-process by ``onnx.backend.test.case.node.collect_testcases``
(the same generator that writes ONNX's backend test data), so they always
match the installed onnx version.  Plus the error contract of ``run_node``.
"""

from __future__ import annotations

import functools
import sys
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install dml-optim[onnx])")
from onnx import helper  # noqa: E402

from dml_optim.onnx import DOMAIN, run_node  # noqa: E402
from reference import numpy_ref as ref  # noqa: E402

#: The ONNX backend node cases of the three operators (onnx/backend/test/case/node/{adagrad,momentum,adam}.py).
EXPECTED_CASES = (
    "test_adagrad",
    "test_adagrad_multiple",
    "test_momentum",
    "test_momentum_multiple",
    "test_nesterov_momentum",
    "test_adam",
    "test_adam_multiple",
)
OUR_OPS = ("Adagrad", "Momentum", "Adam")

# The backend cases carry rtol=1e-3, atol=1e-7.  We hold ourselves to a tighter
# relative bound: the largest relative error observed on these float32 cases is
# 1.04e-7 (test_adam_multiple, X_new[1]); atol stays the cases' own.
CONFORMANCE_RTOL = 1e-6


@functools.cache
def _cases() -> dict[str, object]:
    """Every collected node case whose single node is one of our ops, by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other ops' generators overflow on purpose (cast.py, ...)
        # collect_testcases() imports every case module once per process and returns
        # the module-level list; no op_type filter, since a filtered first call would
        # leave the list without our ops for the rest of the process.
        cases = collect_testcases()
    ours = {}
    for case in cases:
        nodes = case.model.graph.node
        if len(nodes) == 1 and nodes[0].domain == DOMAIN and nodes[0].op_type in OUR_OPS:
            ours[case.name] = case
    return ours


def test_collection_finds_all_seven_cases():
    found = _cases()
    missing = sorted(set(EXPECTED_CASES) - set(found))
    assert not missing, f"collect_testcases() found none of {missing}; found {sorted(found)}"
    assert len(found) >= len(EXPECTED_CASES)


def _check_case(case) -> None:
    node = case.model.graph.node[0]
    assert case.data_sets, f"{case.name} carries no data set"
    for inputs, expected in case.data_sets:
        before = [np.array(a, copy=True) for a in inputs]
        got = run_node(node, inputs)
        assert len(got) == len(expected) == len(node.output)
        for name, g, e in zip(node.output, got, expected):
            assert g.dtype == e.dtype, f"{case.name} {name}: dtype {g.dtype}, expected {e.dtype}"
            assert g.shape == e.shape, f"{case.name} {name}: shape {g.shape}, expected {e.shape}"
            np.testing.assert_allclose(g, e, rtol=CONFORMANCE_RTOL, atol=case.atol, err_msg=f"{case.name} {name}")
        for a, b in zip(inputs, before):
            assert np.asarray(a).tobytes() == b.tobytes(), f"{case.name}: run_node modified an input"


@pytest.mark.parametrize("name", EXPECTED_CASES)
def test_backend_case(name):
    case = _cases().get(name)
    assert case is not None, f"onnx backend case {name} was not collected"
    _check_case(case)


def test_backend_cases_beyond_the_known_seven():
    """Cases a newer onnx adds for these ops must pass too (none in onnx 1.16-1.23)."""
    for name, case in sorted(_cases().items()):
        if name not in EXPECTED_CASES:
            _check_case(case)


# --------------------------------------------------------------------------
# attribute defaults and dtypes
# --------------------------------------------------------------------------


def _node(op_type, n_inputs, n_outputs, domain=DOMAIN, **attrs):
    return helper.make_node(
        op_type,
        inputs=[f"in{i}" for i in range(n_inputs)],
        outputs=[f"out{i}" for i in range(n_outputs)],
        domain=domain,
        **attrs,
    )


def _rng_arrays(n, shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, size=shape).astype(dtype) for _ in range(n)]


# Inputs to which every attribute matters: tiny G and H make epsilon count, T > 0 makes
# decay_factor and the bias correction count, X != 0 makes the norm coefficients count.
def _sensitive_inputs(op_type):
    rng = np.random.default_rng(5)
    x = rng.uniform(0.5, 1.5, 4)
    g = rng.uniform(-2e-6, 2e-6, 4)
    state = rng.uniform(0, 1e-6, 4)  # V (Adam) and H
    tensors = [x, g, state] if op_type == "Adagrad" else [x, g, state, state**2]
    return [np.float64(0.1), np.int64(3), *tensors]


def _schema_defaults():
    """(op, attribute, default) for every optional attribute of our ops, from the installed schemas."""
    out = []
    for op_type in ("Adagrad", "Adam"):
        schema = onnx.defs.get_schema(op_type, 1, DOMAIN)
        for name, attr in sorted(schema.attributes.items()):
            if not attr.required:
                out.append((op_type, name, helper.get_attribute_value(attr.default_value)))
    return out


@pytest.mark.parametrize(("op_type", "attr", "default"), _schema_defaults())
def test_attribute_default_is_the_schema_default(op_type, attr, default):
    """A node without the attribute runs exactly like one that sets it to the schema's default."""
    n_out = 2 if op_type == "Adagrad" else 3
    inputs = _sensitive_inputs(op_type)
    without = run_node(_node(op_type, len(inputs), n_out), inputs)
    explicit = run_node(_node(op_type, len(inputs), n_out, **{attr: default}), inputs)
    assert [a.tobytes() for a in without] == [a.tobytes() for a in explicit]
    # and the inputs are sensitive to it: another value changes the result
    other = run_node(_node(op_type, len(inputs), n_out, **{attr: default * 0.5 + 0.01}), inputs)
    assert [a.tobytes() for a in other] != [a.tobytes() for a in without]


def test_adagrad_epsilon_default_is_1e_6_not_0():
    """docs/design.md §2 lists Adagrad's epsilon default as 0; the ONNX schema (defs.cc) says 1e-6,
    and onnx.reference agrees.  run_node follows the schema."""
    inputs = [np.float64(1.0), np.int64(0), np.array([0.0, 1e-6]), np.array([0.0, 1e-6]), np.zeros(2)]
    x_new, h_new = run_node(_node("Adagrad", 5, 2), inputs)
    # with epsilon = 1e-6: x = 1e-6 - 1e-6 / (1e-6 + 1e-6) = 1e-6 - 0.5; with 0 it would be NaN and 1e-6 - 1
    np.testing.assert_allclose(x_new, [0.0, 1e-6 - 0.5], rtol=1e-6, atol=0)


@pytest.mark.parametrize("op_type", ["Adagrad", "Adam"])
def test_node_without_attributes_matches_onnx_reference(op_type):
    from onnx.reference import ReferenceEvaluator

    inputs = _sensitive_inputs(op_type)
    n_out = 2 if op_type == "Adagrad" else 3
    node = _node(op_type, len(inputs), n_out)
    graph = helper.make_graph(
        [node], op_type,
        [helper.make_tensor_value_info(f"in{i}", helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype), np.shape(a))
         for i, a in enumerate(inputs)],
        [helper.make_tensor_value_info(f"out{i}", onnx.TensorProto.DOUBLE, None) for i in range(n_out)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    expected = ReferenceEvaluator(model).run(None, {f"in{i}": np.asarray(a) for i, a in enumerate(inputs)})
    got = run_node(node, inputs)
    for a, e in zip(got, expected, strict=True):
        # onnx.reference rounds `1 - alpha` etc. to float32 (its attributes are np.float32): float32-level agreement
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum_keeps_dtype(dtype, mode):
    x, g, v = _rng_arrays(3, (5,), dtype, seed=2)
    node = _node("Momentum", 5, 2, alpha=0.9, beta=0.5, mode=mode, norm_coefficient=0.01)
    got = run_node(node, [np.array(0.1, dtype=dtype), np.array(2, dtype=np.int64), x, g, v])
    assert [a.dtype for a in got] == [np.dtype(dtype)] * 2
    # attributes are FLOAT (float32) in ONNX: use the rounded values for the reference
    a32, b32, n32 = (float(np.float32(c)) for c in (0.9, 0.5, 0.01))
    xs, vs = ref.onnx_momentum(0.1 if dtype == np.float64 else np.float32(0.1), 2, [x], [g], [v],
                               alpha=a32, beta=b32, mode=mode, norm_coefficient=n32)
    # float32: values are O(1), so a few float32 ulps of O(1) terms bound the error
    tol = {"rtol": 1e-12, "atol": 0.0} if dtype == np.float64 else {"rtol": 1e-6, "atol": 1e-6}
    np.testing.assert_allclose(got[0], xs[0], **tol)
    np.testing.assert_allclose(got[1], vs[0], **tol)


@pytest.mark.parametrize("device", [
    None,
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
], ids=["none", "cpu-string", "cuda-string"])
def test_device_argument(device):
    """CPU results are bit-identical whatever names the CPU; CUDA agrees to float32 rounding."""
    node = _node("Adagrad", 5, 2)
    inputs = [np.float32(0.5), np.int64(0), *_rng_arrays(3, (3,), np.float32, seed=3)]
    inputs[-1] = np.abs(inputs[-1])
    a = run_node(node, inputs, device=device)
    b = run_node(node, inputs, device=torch.device("cpu"))
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == np.float32
        if device == "cuda":
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)  # other kernels, other roundings
        else:
            assert x.tobytes() == y.tobytes()


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


def _momentum_attrs(**drop):
    attrs = {"alpha": 0.9, "beta": 1.0, "mode": "standard", "norm_coefficient": 0.0}
    for name in drop:
        del attrs[name]
    return attrs


def _inputs(n_tensors):
    return [np.float32(0.1), np.int64(1), *_rng_arrays(n_tensors, (2,), np.float32, seed=4)]


ERROR_CASES = [
    # (id, node, inputs, exception, message fragments)
    ("wrong-domain-default", _node("Adam", 6, 3, domain=""), _inputs(4), ValueError, ["domain", "''", DOMAIN]),
    ("wrong-domain-other", _node("Adam", 6, 3, domain="com.microsoft"), _inputs(4), ValueError, ["com.microsoft"]),
    ("wrong-op", _node("Gradient", 6, 3), _inputs(4), ValueError, ["'Gradient'", "Adagrad"]),
    ("wrong-op-case", _node("adam", 6, 3), _inputs(4), ValueError, ["'adam'"]),
    *[
        (f"momentum-missing-{attr}", _node("Momentum", 5, 2, **_momentum_attrs(**{attr: None})), _inputs(3),
         ValueError, ["Momentum", f"'{attr}'", "missing"])
        for attr in ("alpha", "beta", "mode", "norm_coefficient")
    ],
    ("unknown-attribute", _node("Adagrad", 5, 2, learning_rate=0.1), _inputs(3), ValueError, ["'learning_rate'"]),
    ("attribute-wrong-type", _node("Adam", 6, 3, alpha=1), _inputs(4), ValueError, ["'alpha'", "FLOAT", "INT"]),
    ("mode-wrong-value", _node("Momentum", 5, 2, **{**_momentum_attrs(), "mode": "heavy"}), _inputs(3),
     ValueError, ["mode", "heavy"]),
    ("adam-5-inputs", _node("Adam", 5, 3), _inputs(3), ValueError, ["Adam", "got 5"]),
    ("adam-only-R-T", _node("Adam", 2, 0), _inputs(0), ValueError, ["Adam", "got 2"]),
    ("adagrad-7-inputs", _node("Adagrad", 7, 2), _inputs(5), ValueError, ["Adagrad", "got 7"]),
    ("inputs-do-not-match-node", _node("Adagrad", 5, 2), _inputs(6), ValueError, ["5 inputs", "8 were given"]),
    ("output-count", _node("Momentum", 5, 3, **_momentum_attrs()), _inputs(3), ValueError, ["2 outputs", "names 3"]),
    ("mode-not-utf8", _node("Momentum", 5, 2, **{**_momentum_attrs(), "mode": b"\xff"}), _inputs(3),
     ValueError, ["'mode'", "UTF-8"]),
    ("string-input", _node("Adagrad", 5, 2), [np.float32(0.1), np.int64(0), np.array(["a", "b"]),
                                              np.zeros(2, np.float32), np.zeros(2, np.float32)],
     TypeError, ["'in2'"]),
    ("float-T", _node("Adagrad", 5, 2), [np.float32(0.1), np.float32(1.0), *_rng_arrays(3, (2,), np.float32)],
     TypeError, ["T"]),
    ("shape-mismatch", _node("Adagrad", 5, 2), [np.float32(0.1), np.int64(0), np.zeros(2, np.float32),
                                                 np.zeros(3, np.float32), np.zeros(2, np.float32)],
     ValueError, ["G[0]"]),
]


@pytest.mark.parametrize(("node", "inputs", "exc", "fragments"), [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_run_node_errors(node, inputs, exc, fragments):
    before = [np.array(a, copy=True) for a in inputs]
    with pytest.raises(exc) as info:
        run_node(node, inputs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    for a, b in zip(inputs, before):
        assert np.asarray(a).tobytes() == b.tobytes()


def test_run_node_rejects_a_non_node():
    with pytest.raises(TypeError, match="NodeProto"):
        run_node({"op_type": "Adam"}, _inputs(4))


def test_missing_onnx_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` raise ImportError
    with pytest.raises(ImportError, match=r"pip install dml-optim\[onnx\]"):
        run_node(object(), [])
