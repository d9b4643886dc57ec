"""The descriptor model: DMLCalcBufferTensorSize, dml_sizes, describe_tensor, JSON, builders.

Expected numbers are worked by hand from the DirectML docs (docs/design.md §3):
packed size = product(sizes) * element size; strided size =
(sum((size_i - 1) * stride_i) + 1) * element size; both rounded up to 4.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _desc_helpers import TENSORS, base_dict, mutated
from dml_optim.dml.builder import adam_descriptor, split_for_dml
from dml_optim.dml.desc import AdamOptimizerDesc, Binding, MalformedDescriptor, TensorDesc, calc_buffer_tensor_size
from dml_optim.dml.desc_json import dump, dumps, from_dict, load, loads
from dml_optim.dml.torch_bridge import describe_tensor, dml_sizes
from dml_optim.dml.validate import validate

HYPER = dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, training_step=1)


# ---------------------------------------------------------------------------
# calc_buffer_tensor_size
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data_type, sizes, strides, expected",
    [
        # packed: product of sizes times element size
        ("FLOAT32", [1, 1, 1, 1024], None, 4096),
        ("FLOAT32", [2, 3, 4, 5], None, 480),  # 120 elements * 4
        ("FLOAT16", [1, 1, 1, 1024], None, 2048),
        # FLOAT16 rounding up to a multiple of 4 bytes
        ("FLOAT16", [1, 1, 1, 3], None, 8),  # 6 -> 8
        ("FLOAT16", [1, 1, 1, 1], None, 4),  # 2 -> 4
        ("UINT8", [5], None, 8),  # 5 -> 8
        ("UINT32", [1, 1, 1, 1], None, 4),
        ("FLOAT64", [3], None, 24),
        # padded strides: rows of 6 padded to 8; last index 3*8 + 5*1 = 29, (29 + 1) * 4
        ("FLOAT32", [1, 1, 4, 6], [32, 32, 8, 1], 120),
        # transposed [3, 5] seen as [5, 3]: last index 4*1 + 2*5 = 14, 15 * 4
        ("FLOAT32", [1, 1, 5, 3], [15, 15, 1, 5], 60),
        # broadcast: stride 0 repeats one row of 8; last index 7, 8 * 4
        ("FLOAT32", [1, 1, 4, 8], [0, 0, 0, 1], 32),
        # broadcast of a single element everywhere: last index 0, 1 * 2 = 2 -> 4
        ("FLOAT16", [2, 3], [0, 0], 4),
        # strided FLOAT16 with odd byte count: last index 2*2 = 4, 5 * 2 = 10 -> 12
        ("FLOAT16", [3], [2], 12),
        # no 32-bit overflow: last index 2 * (2^32 - 1) = 8589934590, 8589934591 * 4
        ("FLOAT32", [3, 1], [4294967295, 1], 34359738364),
        # packed 2^32 - 1 FLOAT64 elements: 34359738360 bytes (already a multiple of 4)
        ("FLOAT64", [65535, 65537], None, 34359738360),
        # UNKNOWN: DMLCalcBufferTensorSize's default case returns 0
        ("UNKNOWN", [1, 1, 1, 16], None, 0),
        # the directml.h prefix is accepted
        ("DML_TENSOR_DATA_TYPE_FLOAT16", [1, 1, 1, 3], None, 8),
    ],
)
def test_calc_buffer_tensor_size_hand_worked(data_type, sizes, strides, expected):
    assert calc_buffer_tensor_size(data_type, sizes, strides) == expected


def test_calc_buffer_tensor_size_rejects_unknown_type_and_bad_strides():
    with pytest.raises(MalformedDescriptor, match="BFLOAT16"):
        calc_buffer_tensor_size("BFLOAT16", [4])
    with pytest.raises(ValueError, match="strides has 1 entries but sizes has 2"):
        calc_buffer_tensor_size("FLOAT32", [2, 2], [1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.sampled_from(["FLOAT32", "FLOAT16", "UINT8"]))
def test_calc_buffer_tensor_size_packed_equals_explicit_packed_strides(sizes, data_type):
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    assert calc_buffer_tensor_size(data_type, sizes, strides) == calc_buffer_tensor_size(data_type, sizes)
    assert calc_buffer_tensor_size(data_type, sizes) % 4 == 0


# ---------------------------------------------------------------------------
# dml_sizes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, count, expected",
    [
        ((3, 5), 4, [1, 1, 3, 5]),
        ((), 4, [1, 1, 1, 1]),
        ((), 1, [1]),
        (7, 4, [1, 1, 1, 7]),
        ((2, 3, 4, 5), 4, [2, 3, 4, 5]),
        ((2, 3, 4, 5, 6), 4, [6, 4, 5, 6]),  # 2 * 3 folded into the leading dimension
        ((2, 3, 4, 5, 6), 2, [120, 6]),
        ((3, 5), 1, [15]),
        ((768,), 8, [1, 1, 1, 1, 1, 1, 1, 768]),
        ((0, 5), 4, [1, 1, 0, 5]),
    ],
)
def test_dml_sizes_examples(shape, count, expected):
    assert dml_sizes(shape, count) == expected


@pytest.mark.parametrize("bad", [0, 9, -1, 2.0, True])
def test_dml_sizes_rejects_bad_dimension_count(bad):
    with pytest.raises(ValueError, match="dimension_count"):
        dml_sizes((2, 3), bad)


def test_dml_sizes_rejects_negative_dimension():
    with pytest.raises(ValueError, match=r"shape\[1\] must be a non-negative int, got -3"):
        dml_sizes((2, -3))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=10), st.integers(1, 8))
def test_dml_sizes_properties(shape, count):
    sizes = dml_sizes(shape, count)
    assert len(sizes) == count
    assert math.prod(sizes) == math.prod(shape)
    kept = min(len(shape), count - 1) if len(shape) > count else len(shape)
    if kept:
        assert sizes[-kept:] == list(shape[-kept:])  # trailing dimensions are unchanged
    if len(shape) <= count:
        assert sizes[: count - len(shape)] == [1] * (count - len(shape))


# ---------------------------------------------------------------------------
# describe_tensor
# ---------------------------------------------------------------------------


def test_describe_tensor_contiguous_fp32():
    desc = describe_tensor(torch.zeros(3, 5))
    assert desc.data_type == "FLOAT32"
    assert desc.sizes == (1, 1, 3, 5)
    assert desc.strides[-2:] == (5, 1)
    assert desc.total_tensor_size_in_bytes == 60  # 15 * 4
    assert desc.dimension_count == 4


def test_describe_tensor_transpose_slice_expand():
    t = torch.zeros(3, 5, dtype=torch.float16).t()  # shape (5, 3), strides (1, 5)
    d = describe_tensor(t)
    assert (d.data_type, d.sizes, d.strides[-2:]) == ("FLOAT16", (1, 1, 5, 3), (1, 5))
    assert d.total_tensor_size_in_bytes == 32  # last index 4*1 + 2*5 = 14, 15 * 2 = 30 -> 32

    s = torch.zeros(4, 6)[:, ::2]  # shape (4, 3), strides (6, 2)
    d = describe_tensor(s)
    assert (d.sizes, d.strides[-2:]) == ((1, 1, 4, 3), (6, 2))
    assert d.total_tensor_size_in_bytes == 92  # last index 3*6 + 2*2 = 22, 23 * 4

    e = torch.zeros(3).expand(4, 3)  # strides (0, 1)
    d = describe_tensor(e)
    assert (d.sizes, d.strides[-2:]) == ((1, 1, 4, 3), (0, 1))
    assert d.total_tensor_size_in_bytes == 12  # last index 2, 3 * 4


def test_describe_tensor_folds_mergeable_and_refuses_unmergeable():
    t = torch.zeros(2, 3, 4, 5, 6)[:, :, 1]  # (2, 3, 5, 6), 4 dims: no folding
    assert describe_tensor(t).sizes == (2, 3, 5, 6)
    folded = describe_tensor(torch.zeros(2, 3, 4, 5, 6))
    assert (folded.sizes, folded.strides) == ((6, 4, 5, 6), (120, 30, 6, 1))
    with pytest.raises(ValueError, match="cannot fold"):
        describe_tensor(torch.zeros(2, 3, 4, 5, 6).permute(1, 0, 2, 3, 4))
    assert describe_tensor(torch.zeros(2, 3, 4, 5, 6).permute(1, 0, 2, 3, 4), 5).sizes == (3, 2, 4, 5, 6)


@pytest.mark.parametrize(
    "dtype, name", [(torch.float32, "FLOAT32"), (torch.float16, "FLOAT16"), (torch.int64, "INT64"),
                    (torch.bfloat16, "UNKNOWN"), (torch.float64, "FLOAT64")]
)
def test_describe_tensor_data_types(dtype, name):
    assert describe_tensor(torch.zeros(2, 2, dtype=dtype)).data_type == name


def test_describe_tensor_other_dtype_fails_data_type_rule():
    d = base_dict()
    bad = describe_tensor(torch.zeros(1, 1, 1, 1024, dtype=torch.int64))
    desc = from_dict(d).replace(GradientTensor=bad)
    report = validate(desc)
    assert {(v.field, v.rule) for v in report.errors} >= {("GradientTensor.DataType", "data-type")}


_VIEWS = st.sampled_from(["none", "t", "slice", "step", "expand", "permute", "flip_dims"])


@st.composite
def _views(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    kind = draw(_VIEWS)
    return shape, kind


def _make_view(shape, kind):
    base = torch.arange(float(math.prod(shape) * 4)).reshape(shape[:-1] + (shape[-1] * 4,))
    t = base[..., : shape[-1]]  # a non-contiguous slice of a larger storage
    if kind == "t" and t.dim() >= 2:
        t = t.transpose(-1, -2)
    elif kind == "slice":
        t = t[..., 1:] if t.shape[-1] > 1 else t
    elif kind == "step":
        t = base[..., ::2]
    elif kind == "expand":
        t = t[..., :1].expand(*t.shape[:-1], 3)
    elif kind == "permute":
        t = t.permute(*reversed(range(t.dim())))
    elif kind == "flip_dims" and t.dim() >= 2:
        t = t.movedim(0, -1)
    return t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_views(), st.integers(4, 8))
def test_describe_tensor_addresses_the_same_elements(view, count):
    shape, kind = view
    t = _make_view(shape, kind)
    desc = describe_tensor(t, count)
    assert desc.dimension_count == count == len(desc.sizes) == len(desc.strides)
    assert math.prod(desc.sizes) == t.numel()
    storage = torch.arange(float(t.untyped_storage().nbytes() // 4))
    rebuilt = torch.as_strided(storage, desc.sizes, desc.strides, t.storage_offset())
    assert torch.equal(rebuilt.reshape(t.shape), t)
    last = sum((s - 1) * st_ for s, st_ in zip(desc.sizes, desc.strides))
    assert desc.total_tensor_size_in_bytes >= (last + 1) * 4


# ---------------------------------------------------------------------------
# TensorDesc / Binding / AdamOptimizerDesc and JSON
# ---------------------------------------------------------------------------


def test_tensor_desc_defaults():
    t = TensorDesc("FLOAT16", [1, 1, 1, 3])
    assert t.sizes == (1, 1, 1, 3)
    assert t.dimension_count == 4
    assert t.strides is None
    assert t.total_tensor_size_in_bytes == 8
    assert t.flags == 0 and t.guaranteed_base_offset_alignment == 0


@pytest.mark.parametrize(
    "flags, bits",
    [("NONE", 0), ("OWNED_BY_DML", 1), ("DML_TENSOR_FLAG_OWNED_BY_DML", 1), ("NONE|OWNED_BY_DML", 1),
     (["OWNED_BY_DML"], 1), (2, 2), (None, 0)],
)
def test_flags_forms(flags, bits):
    assert TensorDesc("FLOAT32", [4], flags=flags).flags == bits


@pytest.mark.parametrize(
    "path, value, needle",
    [
        ("GradientTensor.Sizes", [1, 1, -1, 4], "GradientTensor.Sizes[2] = -1"),
        ("GradientTensor.Sizes", [1, 1, 1, 2.5], "GradientTensor.Sizes[3] must be an integer"),
        ("GradientTensor.Sizes", [1, 1, 1, 2**32], "GradientTensor.Sizes[3] = 4294967296"),
        ("GradientTensor.Sizes", "1024", "GradientTensor.Sizes must be a list"),
        ("GradientTensor.DataType", "BFLOAT16", 'GradientTensor.DataType = "BFLOAT16"'),
        ("GradientTensor.DataType", 1, "GradientTensor.DataType must be a data type name"),
        ("GradientTensor.Flags", "READ_ONLY", 'GradientTensor.Flags = "READ_ONLY"'),
        ("GradientTensor.Flags", -1, "GradientTensor.Flags = -1"),
        ("GradientTensor.TotalTensorSizeInBytes", 2**64, "GradientTensor.TotalTensorSizeInBytes = 18446744073709551616"),
        ("GradientTensor.GuaranteedBaseOffsetAlignment", -16, "GradientTensor.GuaranteedBaseOffsetAlignment = -16"),
        ("GradientTensor.DimensionCount", True, "GradientTensor.DimensionCount must be an integer"),
        ("GradientTensor.Extra", 1, 'GradientTensor has an unknown key "Extra"'),
        ("GradientTensor", None, "GradientTensor must be a JSON object"),
        ("LearningRate", "0.001", 'LearningRate must be a number (FLOAT), got "0.001"'),
        ("Beta1", True, "Beta1 must be a number"),
        ("TrainingStepValue", 1.0, "TrainingStepValue must be an integer, got 1.0"),
        ("feature_level", "2_1", 'feature_level = "2_1"'),
        ("feature_level", 3, "feature_level must be a string"),
        ("operator", "GEMM", 'operator = "GEMM" is not supported'),
        ("Bindings.GradientTensor.Offset", -16, "Bindings.GradientTensor.Offset = -16"),
        ("Bindings.GradientTensor.Buffer", "", "Bindings.GradientTensor.Buffer must be a non-empty string"),
        ("Bindings.Gradient", {"Buffer": "g"}, 'Bindings has an unknown key "Gradient"'),
        ("Bindings", [], "Bindings must be a JSON object"),
        ("Beta_1", 0.9, 'descriptor has an unknown key "Beta_1"'),
    ],
)
def test_malformed_names_field_and_value(path, value, needle):
    with pytest.raises(MalformedDescriptor) as info:
        loads(json.dumps(mutated(base_dict(), **{path: value})))
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_malformed_missing_parts_and_non_json():
    d = base_dict()
    del d["GradientTensor"]
    with pytest.raises(MalformedDescriptor, match="^GradientTensor is missing$"):
        loads(json.dumps(d))
    d = base_dict()
    del d["InputParametersTensor"]["Sizes"]
    with pytest.raises(MalformedDescriptor, match="InputParametersTensor.Sizes is missing"):
        loads(json.dumps(d))
    with pytest.raises(MalformedDescriptor, match="^not JSON: "):
        loads('{"LearningRate": 0.001,}')
    with pytest.raises(MalformedDescriptor, match="must be a JSON object"):
        loads("[1, 2]")
    with pytest.raises(MalformedDescriptor, match="^not JSON"):
        loads("[" * 100000)


def test_loader_ignores_expect_and_description():
    plain = base_dict()
    annotated = {"description": "x", "expect": {"exit": 0, "rules": ["anything"]}, **plain}
    assert loads(json.dumps(annotated)) == loads(json.dumps(plain))


def test_defaults_when_optional_fields_are_omitted():
    d = base_dict(bindings=False)
    del d["TrainingStepValue"], d["feature_level"], d["operator"]
    d["Bindings"] = {"GradientTensor": {"Buffer": "g"}}
    desc = loads(json.dumps(d))
    assert desc.feature_level == "3_0"
    assert desc.training_step_value is None
    assert desc.bindings == {"GradientTensor": Binding("g", 0, 4096)}  # Size defaults to the tensor's total
    assert desc.gradient.dimension_count == 4


def test_prefixed_names_are_canonicalised():
    d = mutated(base_dict(), **{"GradientTensor.DataType": "DML_TENSOR_DATA_TYPE_FLOAT32",
                                "feature_level": "DML_FEATURE_LEVEL_4_1", "GradientTensor.Flags": "DML_TENSOR_FLAG_NONE"})
    desc = loads(json.dumps(d))
    assert (desc.gradient.data_type, desc.feature_level, desc.gradient.flags) == ("FLOAT32", "4_1", 0)


def test_round_trip_exact_and_stable(tmp_path):
    desc = loads(json.dumps(mutated(base_dict(), **{"GradientTensor.Strides": [1024, 1024, 1024, 1],
                                                    "GradientTensor.Flags": 3, "TrainingStepValue": -5})))
    text = dumps(desc)
    assert loads(text) == desc
    assert dumps(loads(text)) == text
    assert loads(dumps(desc, indent=None)) == desc
    path = tmp_path / "d.json"
    dump(desc, path)
    assert load(path) == desc
    buf = io.StringIO()
    dump(desc, buf)
    assert load(io.StringIO(buf.getvalue())) == desc


def test_load_unreadable_path_is_malformed(tmp_path):
    with pytest.raises(MalformedDescriptor, match="cannot read .*nope.json"):
        load(tmp_path / "nope.json")


_DTYPE = st.sampled_from(["FLOAT32", "FLOAT16", "UINT32", "INT8", "UNKNOWN"])
_SIZES = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=9)


@st.composite
def _tensor_descs(draw):
    sizes = draw(_SIZES)
    return TensorDesc(
        data_type=draw(_DTYPE),
        sizes=sizes,
        strides=draw(st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=9)),
        total_tensor_size_in_bytes=draw(st.none() | st.integers(0, 2**64 - 1)),
        flags=draw(st.integers(0, 2**32 - 1)),
        guaranteed_base_offset_alignment=draw(st.integers(0, 2**32 - 1)),
        dimension_count=draw(st.none() | st.integers(0, 2**32 - 1)),
    )


@st.composite
def _descs(draw):
    tensors = {name: draw(_tensor_descs()) for name in TENSORS}
    floats = st.floats(allow_nan=False)
    bindings = draw(st.none() | st.dictionaries(
        st.sampled_from(TENSORS),
        st.builds(Binding, st.sampled_from(["a", "b"]), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    ))
    desc_kwargs = {name: t for name, t in tensors.items()}
    base = from_dict(base_dict())
    return base.replace(
        **desc_kwargs, LearningRate=draw(floats), Beta1=draw(floats), Beta2=draw(floats), Epsilon=draw(floats),
        bindings=bindings, training_step_value=draw(st.none() | st.integers(-(2**70), 2**70)),
        feature_level=draw(st.sampled_from(["3_0", "4_0", "6_4"])),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_descs())
def test_round_trip_property(desc):
    text = dumps(desc)
    assert loads(text) == desc
    assert dumps(loads(text)) == text


# ---------------------------------------------------------------------------
# adam_descriptor and split_for_dml
# ---------------------------------------------------------------------------


def test_adam_descriptor_is_in_place_over_one_flat_buffer():
    desc = adam_descriptor(1000, "FLOAT32", **HYPER)
    assert isinstance(desc, AdamOptimizerDesc)
    assert desc.input_parameters.sizes == (1, 1, 1, 1000)
    assert desc.input_parameters.total_tensor_size_in_bytes == 4000
    assert desc.training_step == TensorDesc("UINT32", (1, 1, 1, 1), None, 4)
    assert desc.training_step_value == 1
    b = desc.bindings
    assert b["OutputParametersTensor"] == b["InputParametersTensor"] == Binding("parameters", 0, 4000)
    assert b["OutputFirstMomentTensor"] == b["InputFirstMomentTensor"] == Binding("first_moment", 0, 4000)
    assert b["OutputSecondMomentTensor"] == b["InputSecondMomentTensor"] == Binding("second_moment", 0, 4000)
    assert b["GradientTensor"] == Binding("gradient", 0, 4000)
    assert b["TrainingStepTensor"] == Binding("training_step", 0, 4)
    assert desc.output_parameters == desc.input_parameters
    assert validate(desc).violations == ()


def test_adam_descriptor_options():
    desc = adam_descriptor((3, 5), torch.float16, **{**HYPER, "epsilon": 1e-4}, dimension_count=2,
                           buffer_names={"gradient": "g0"}, element_offset=8)
    assert desc.feature_level == "4_0"
    assert desc.gradient.sizes == (3, 5)
    assert desc.gradient.data_type == "FLOAT16"
    assert desc.bindings["GradientTensor"] == Binding("g0", 16, 32)  # 8 elements * 2 bytes; 30 -> 32 bytes
    assert desc.training_step.sizes == (1, 1)
    assert validate(desc).valid
    with pytest.raises(ValueError, match="unknown role 'grad'"):
        adam_descriptor(4, "FLOAT32", **HYPER, buffer_names={"grad": "x"})
    with pytest.raises(ValueError, match="no DirectML data type"):
        adam_descriptor(4, torch.bfloat16, **HYPER)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 64), max_size=5),  # at most 64^5 = 2^30 elements
    st.sampled_from(["FLOAT32", "FLOAT16"]),
    st.integers(1, 8),
    st.integers(0, 2**20),
    st.integers(1, 2**32 - 1),
)
def test_adam_descriptor_is_always_valid(shape, data_type, count, offset_chunks, step):
    desc = adam_descriptor(shape, data_type, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-4,
                           training_step=step, dimension_count=count, element_offset=offset_chunks * 16)
    report = validate(desc)
    assert report.violations == (), report.violations


@pytest.mark.parametrize(
    "numel, expected",
    [
        (0, []),
        (10, [10]),
        (2**32 - 16, [2**32 - 16]),
        (2**32 - 1, [4294967280, 15]),  # chunks other than the last are multiples of 16
        (2**33, [4294967280, 4294967280, 32]),  # 8589934592 - 2 * 4294967280 = 32
    ],
)
def test_split_for_dml(numel, expected):
    assert split_for_dml(numel) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(16, 10**6).flatmap(lambda m: st.tuples(st.integers(0, 40 * m), st.just(m))))
def test_split_for_dml_properties(numel_and_max):
    numel, max_elements = numel_and_max
    chunks = split_for_dml(numel, max_elements)
    assert sum(chunks) == numel
    assert all(0 < c <= max_elements for c in chunks)
    assert all(c % 16 == 0 for c in chunks[:-1])


def test_split_for_dml_rejects_negative():
    with pytest.raises(ValueError, match="numel must be a non-negative int, got -1"):
        split_for_dml(-1)


def test_numpy_and_torch_integers_are_accepted():
    import numpy as np

    assert dml_sizes(torch.Size([2, 3])) == [1, 1, 2, 3]
    assert dml_sizes(np.int64(5)) == [1, 1, 1, 5]
    desc = adam_descriptor(np.int64(8), torch.float32, learning_rate=np.float32(0.5), beta1=0.9, beta2=0.999,
                           epsilon=1e-8, training_step=np.int64(3))
    assert desc.training_step_value == 3 and type(desc.training_step_value) is int
    assert desc.learning_rate == 0.5 and type(desc.learning_rate) is float
    with pytest.raises(MalformedDescriptor, match="Sizes\\[0\\] must be an integer"):
        TensorDesc("FLOAT32", [np.True_])
