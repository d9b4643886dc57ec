"""The validator: every rule fires on a case built for it and stays silent on its twin.

Each case changes the literal base descriptor of ``_desc_helpers.base_dict``
(FLOAT32 [1, 1, 1, 1024], in place) in one way; the numbers are hand-worked
from docs/design.md §3.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _desc_helpers import DATA_TENSORS, DESIGN_RULES, TENSORS, base_dict, mutated
from dml_optim.dml.desc import MalformedDescriptor
from dml_optim.dml.desc_json import from_dict, loads
from dml_optim.dml.validate import FEATURE_LEVELS, RULES, Report, Violation, validate


def _all_sizes(d, data_sizes, step_sizes, level=None):
    out = copy.deepcopy(d)
    for name in TENSORS:
        out[name]["Sizes"] = list(step_sizes if name == "TrainingStepTensor" else data_sizes)
    if level:
        out["feature_level"] = level
    return out


def _data(d, **fields):
    out = copy.deepcopy(d)
    for name in DATA_TENSORS:
        out[name].update(fields)
    return out


BASE = base_dict()
NO_BIND = base_dict(bindings=False)
FP16 = base_dict("FLOAT16")

#: rule -> (a descriptor that breaks only that rule, its valid twin)
RULE_CASES = {
    "dimension-count": (_all_sizes(NO_BIND, [32, 32], [1, 1]), _all_sizes(NO_BIND, [32, 32], [1, 1], "4_0")),
    "sizes-length": (
        mutated(BASE, feature_level="4_0", **{"GradientTensor.DimensionCount": 3}),
        mutated(BASE, feature_level="4_0", **{"GradientTensor.DimensionCount": 4}),
    ),
    "strides-length": (
        mutated(BASE, **{"GradientTensor.Strides": [1024, 1]}),
        mutated(BASE, **{"GradientTensor.Strides": [1024, 1024, 1024, 1]}),
    ),
    "zero-size": (
        _data(NO_BIND, Sizes=[1, 1, 0, 1024], TotalTensorSizeInBytes=0),
        _data(NO_BIND, Sizes=[1, 1, 1, 1024], TotalTensorSizeInBytes=4096),
    ),
    # 65536 * 65536 = 2^32 elements; 65535 * 65537 = 2^32 - 1 (4 bytes each)
    "element-count": (
        _data(NO_BIND, Sizes=[1, 1, 65536, 65536], TotalTensorSizeInBytes=2**34),
        _data(NO_BIND, Sizes=[1, 1, 65535, 65537], TotalTensorSizeInBytes=17179869180),
    ),
    "data-type": (_data(BASE, DataType="INT32"), _data(BASE, DataType="FLOAT32")),
    "same-data-type": (
        mutated(BASE, Epsilon=1e-4, **{"GradientTensor.DataType": "FLOAT16", "GradientTensor.TotalTensorSizeInBytes": 2048}),
        mutated(BASE, Epsilon=1e-4),
    ),
    "same-sizes": (mutated(BASE, **{"GradientTensor.Sizes": [1, 1, 2, 512]}), BASE),
    "step-scalar": (
        mutated(BASE, **{"TrainingStepTensor.Sizes": [1, 1, 1, 2], "TrainingStepTensor.TotalTensorSizeInBytes": 8,
                         "Bindings.TrainingStepTensor.Size": 8}),
        mutated(BASE, **{"TrainingStepTensor.TotalTensorSizeInBytes": 8, "Bindings.TrainingStepTensor.Size": 8}),
    ),
    "total-size": (
        mutated(NO_BIND, **{"InputParametersTensor.TotalTensorSizeInBytes": 4092}),
        mutated(NO_BIND, **{"InputParametersTensor.TotalTensorSizeInBytes": 4100}),
    ),
    "alignment": (
        mutated(BASE, **{"GradientTensor.GuaranteedBaseOffsetAlignment": 24}),
        mutated(BASE, **{"GradientTensor.GuaranteedBaseOffsetAlignment": 32}),
    ),
    "flags": (
        mutated(NO_BIND, **{"OutputParametersTensor.Flags": "OWNED_BY_DML"}),
        mutated(NO_BIND, **{"InputParametersTensor.Flags": "OWNED_BY_DML"}),
    ),
    "hyperparameter": (mutated(BASE, Beta1=1.5), mutated(BASE, Beta1=1.0)),
    "binding-size": (
        mutated(BASE, **{"Bindings.GradientTensor.Size": 4092}),
        mutated(BASE, **{"Bindings.GradientTensor.Size": 8192}),
    ),
    "binding-offset-alignment": (
        mutated(BASE, **{"Bindings.GradientTensor.Offset": 8}),
        mutated(BASE, **{"Bindings.GradientTensor.Offset": 16}),
    ),
    "alias": (
        mutated(BASE, **{"Bindings.OutputFirstMomentTensor.Offset": 2048}),
        mutated(BASE, **{"Bindings.OutputFirstMomentTensor.Offset": 4096}),  # adjacent, not overlapping
    ),
    "output-overlap": (
        mutated(BASE, **{"Bindings.OutputFirstMomentTensor": {"Buffer": "v", "Offset": 0, "Size": 4096}}),
        mutated(BASE, **{"Bindings.OutputFirstMomentTensor": {"Buffer": "v", "Offset": 4096, "Size": 4096}}),
    ),
    "training-step-range": (mutated(BASE, TrainingStepValue=2**32), mutated(BASE, TrainingStepValue=2**32 - 1)),
    "training-step-zero": (mutated(BASE, TrainingStepValue=0), mutated(BASE, TrainingStepValue=1)),
    "epsilon-underflow": (
        mutated(FP16, Epsilon=2.0**-25),
        # the next FLOAT (float32) above 2^-25: FP16 rounds it to 2^-24
        mutated(FP16, Epsilon=float(np.nextafter(np.float32(2.0**-25), np.float32(1.0)))),
    ),
}


def test_rules_match_design_table():
    assert RULES == DESIGN_RULES


def test_every_rule_has_a_case():
    assert set(RULE_CASES) == set(RULES)


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_rule_fires_on_its_case(rule):
    report = validate(loads(json.dumps(RULE_CASES[rule][0])))
    assert report.rules == {rule}, [str(v) for v in report.violations]
    assert report.valid == (RULES[rule] == "warning")
    assert all(v.severity == RULES[rule] for v in report.violations)


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_rule_silent_on_its_twin(rule):
    report = validate(loads(json.dumps(RULE_CASES[rule][1])))
    assert report.violations == ()
    assert report.valid


def test_base_descriptors_are_valid():
    for d in (BASE, NO_BIND, FP16):
        assert validate(d).violations == ()


# ---------------------------------------------------------------------------
# Fields, messages, completeness
# ---------------------------------------------------------------------------


def _fields(d, feature_level=None):
    return [(v.field, v.rule) for v in validate(d, feature_level).violations]


def test_dimension_count_reported_for_each_tensor_in_struct_order():
    fields = _fields(RULE_CASES["dimension-count"][0])
    assert fields == [(f"{name}.DimensionCount", "dimension-count") for name in TENSORS]


@pytest.mark.parametrize(
    "rule, field, value_text",
    [
        ("sizes-length", "GradientTensor.Sizes", "DimensionCount = 3"),
        ("strides-length", "GradientTensor.Strides", "[1024, 1]"),
        ("zero-size", "InputParametersTensor.Sizes", "[1, 1, 0, 1024]"),
        ("element-count", "InputParametersTensor.Sizes", "4294967296"),
        ("data-type", "InputParametersTensor.DataType", "INT32"),
        ("same-data-type", "GradientTensor.DataType", "FLOAT16"),
        ("same-sizes", "GradientTensor.Sizes", "[1, 1, 2, 512]"),
        ("step-scalar", "TrainingStepTensor.Sizes", "[1, 1, 1, 2]"),
        ("total-size", "InputParametersTensor.TotalTensorSizeInBytes", "4092"),
        ("alignment", "GradientTensor.GuaranteedBaseOffsetAlignment", "24"),
        ("flags", "OutputParametersTensor.Flags", "OWNED_BY_DML"),
        ("hyperparameter", "Beta1", "1.5"),
        ("binding-size", "Bindings.GradientTensor.Size", "4092"),
        ("binding-offset-alignment", "Bindings.GradientTensor.Offset", "= 8"),
        ("alias", "Bindings.OutputFirstMomentTensor", "[2048, 6144)"),
        ("output-overlap", "Bindings.OutputSecondMomentTensor", "[0, 4096)"),
        ("training-step-range", "TrainingStepValue", "4294967296"),
        ("training-step-zero", "TrainingStepValue", "= 0"),
        ("epsilon-underflow", "Epsilon", "2.98"),
    ],
)
def test_first_violation_names_field_and_value(rule, field, value_text):
    first = validate(RULE_CASES[rule][0]).violations[0]
    assert (first.field, first.rule) == (field, rule)
    assert field.split(".")[-1] in first.message or field in first.message
    assert value_text in first.message
    assert str(first) == f"{first.severity} {field} {rule}: {first.message}"


def test_all_violations_listed_at_once():
    d = mutated(
        FP16,
        Beta2=2.0,
        Epsilon=1e-8,
        TrainingStepValue=0,
        **{"GradientTensor.DataType": "INT8", "GradientTensor.TotalTensorSizeInBytes": 1024,
           "Bindings.InputSecondMomentTensor.Offset": 4},
    )
    got = _fields(d)
    assert got == [
        ("GradientTensor.DataType", "data-type"),
        ("GradientTensor.DataType", "same-data-type"),
        ("Beta2", "hyperparameter"),
        ("Epsilon", "epsilon-underflow"),
        ("Bindings.InputSecondMomentTensor.Offset", "binding-offset-alignment"),
        ("Bindings.OutputSecondMomentTensor", "alias"),  # [0, 2048) vs [4, 2052): not identical
        ("TrainingStepValue", "training-step-zero"),
    ]


def test_total_size_not_multiple_of_4():
    # FLOAT16 [1,1,1,3] = 6 bytes, rounded to 8; 10 is big enough but not a multiple of 4
    d = mutated(base_dict("FLOAT16", 3, bindings=False), **{"GradientTensor.TotalTensorSizeInBytes": 10})
    [v] = validate(d).violations
    assert (v.field, v.rule) == ("GradientTensor.TotalTensorSizeInBytes", "total-size")
    assert "10 is not a multiple of 4" in v.message


def test_total_size_uses_strides():
    # rows of 6 padded to 8: (3*8 + 5*1 + 1) * 4 = 120 bytes; the packed 96 is too small
    d = _data(NO_BIND, Sizes=[1, 1, 4, 6], Strides=[32, 32, 8, 1], TotalTensorSizeInBytes=96)
    assert {v.rule for v in validate(d).violations} == {"total-size"}
    assert "DMLCalcBufferTensorSize = 120" in validate(d).violations[0].message
    assert validate(_data(NO_BIND, Sizes=[1, 1, 4, 6], Strides=[32, 32, 8, 1], TotalTensorSizeInBytes=120)).valid


def test_alignment_below_element_size_and_binding_offset_follows_guaranteed_alignment():
    assert _fields(mutated(BASE, **{"GradientTensor.GuaranteedBaseOffsetAlignment": 2})) == [
        ("GradientTensor.GuaranteedBaseOffsetAlignment", "alignment")
    ]
    # FLOAT16 elements are 2 bytes: an alignment of 2 is fine there
    assert validate(mutated(FP16, **{"GradientTensor.GuaranteedBaseOffsetAlignment": 2})).valid
    d = mutated(BASE, **{"GradientTensor.GuaranteedBaseOffsetAlignment": 256, "Bindings.GradientTensor.Offset": 64})
    [v] = validate(d).violations
    assert (v.rule, v.field) == ("binding-offset-alignment", "Bindings.GradientTensor.Offset")
    assert "multiple of 256" in v.message
    assert validate(mutated(d, **{"Bindings.GradientTensor.Offset": 512})).valid


def test_flags_unknown_bit_and_owned_aliased_input():
    assert _fields(mutated(BASE, **{"GradientTensor.Flags": 2})) == [("GradientTensor.Flags", "flags")]
    assert _fields(mutated(BASE, **{"InputParametersTensor.Flags": "OWNED_BY_DML"})) == [
        ("InputParametersTensor.Flags", "flags")
    ]


def test_alias_rules():
    # the step may never be aliased, even by an identical range
    step_alias = mutated(BASE, **{"Bindings.OutputParametersTensor": {"Buffer": "step", "Offset": 0, "Size": 4096}})
    [v] = validate(step_alias).violations
    assert v.rule == "alias" and "TrainingStepTensor may not be aliased" in v.message
    # identical ranges but different tensor descs (TotalTensorSizeInBytes 8192 vs 4096)
    differs = mutated(BASE, **{"OutputParametersTensor.TotalTensorSizeInBytes": 8192,
                               "Bindings.OutputParametersTensor.Size": 8192,
                               "Bindings.InputParametersTensor.Size": 8192})
    [v] = validate(differs).violations
    assert v.rule == "alias" and "TotalTensorSizeInBytes 8192 vs 4096" in v.message
    # explicit packed strides equal omitted strides: still an identical desc
    assert validate(mutated(BASE, **{"OutputParametersTensor.Strides": [1024, 1024, 1024, 1]})).valid
    # docs/design.md §3: any input/output pair with identical range and desc is a legal in-place pair
    assert validate(mutated(BASE, **{"Bindings.GradientTensor.Buffer": "weights"})).valid
    # different buffers never overlap
    assert validate(mutated(BASE, **{"Bindings.OutputFirstMomentTensor.Buffer": "elsewhere"})).valid


def test_alias_output_at_input_offset_with_a_different_size():
    """Same Offset as the input but another Size is not an identical range, so not in place."""
    for size in (8192, 4112):  # a larger output range
        [v] = validate(mutated(BASE, **{"Bindings.OutputParametersTensor.Size": size})).violations
        assert (v.field, v.rule) == ("Bindings.OutputParametersTensor", "alias")
        assert f"(weights [0, {size})) overlaps Bindings.InputParametersTensor (weights [0, 4096))" in v.message
        assert "identical ranges" in v.message
    # a larger input range
    assert _fields(mutated(BASE, **{"Bindings.InputParametersTensor.Size": 8192})) == [
        ("Bindings.OutputParametersTensor", "alias")
    ]
    # the same larger Size on both sides is identical (a binding may be larger than TotalTensorSizeInBytes)
    same = {"Bindings.OutputParametersTensor.Size": 8192, "Bindings.InputParametersTensor.Size": 8192}
    assert validate(mutated(BASE, **same)).valid


def test_output_overlap_compares_writable_areas():
    """BindOutputs: an output writes [Offset, Offset + TotalTensorSizeInBytes), whatever its binding's Size."""
    # the bindings [0, 8192) and [4096, 8192) overlap, the writable areas [0, 4096) and [4096, 8192) do not
    apart = {"Bindings.OutputFirstMomentTensor": {"Buffer": "out", "Offset": 0, "Size": 8192},
             "Bindings.OutputSecondMomentTensor": {"Buffer": "out", "Offset": 4096, "Size": 4096}}
    assert validate(mutated(BASE, **apart)).violations == ()
    # the bindings [0, 16) and [16, 4112) do not overlap, the writable areas [0, 4096) and [16, 4112) do
    short = {"Bindings.OutputFirstMomentTensor": {"Buffer": "out", "Offset": 0, "Size": 16},
             "Bindings.OutputSecondMomentTensor": {"Buffer": "out", "Offset": 16, "Size": 4096}}
    violations = validate(mutated(BASE, **short)).violations
    assert [(v.field, v.rule) for v in violations] == [
        ("Bindings.OutputFirstMomentTensor.Size", "binding-size"),
        ("Bindings.OutputSecondMomentTensor", "output-overlap"),
    ]
    assert "out [16, 4112)" in violations[1].message and "out [0, 4096)" in violations[1].message


def test_epsilon_underflow_rounds_the_float_directml_receives():
    """The double just above 2^-25 reaches DirectML as the FLOAT 2^-25, which FP16 rounds to 0."""
    just_above = float(np.nextafter(2.0**-25, 1.0))
    assert just_above > 2.0**-25 and np.float32(just_above) == np.float32(2.0**-25)
    assert _fields(mutated(FP16, Epsilon=just_above)) == [("Epsilon", "epsilon-underflow")]


def test_hyperparameters_checked_as_float32():
    assert validate(mutated(BASE, Beta1=1 + 1e-9)).valid  # rounds to 1.0 in float32
    assert {v.rule for v in validate(mutated(BASE, Beta1=1 + 1e-6)).violations} == {"hyperparameter"}
    assert validate(mutated(BASE, LearningRate=3.4e38)).valid  # float32 max is ~3.4028e38
    assert _fields(mutated(BASE, LearningRate=3.5e38)) == [("LearningRate", "hyperparameter")]
    nan = validate(loads(json.dumps(mutated(BASE, Beta2=math.nan, Epsilon=math.inf))))
    assert [(v.field, v.rule) for v in nan.violations] == [("Beta2", "hyperparameter"), ("Epsilon", "hyperparameter")]


def test_epsilon_underflow_threshold_is_fp16_rounding():
    # independent facts: 2^-25 rounds to 0 in FP16 (tie to even), the next double does not
    assert np.float16(2.0**-25) == 0
    assert np.float16(np.nextafter(2.0**-25, 1.0)) == np.float16(2.0**-24)
    assert _fields(mutated(FP16, Epsilon=-1e-9)) == [("Epsilon", "epsilon-underflow")]
    assert validate(mutated(FP16, Epsilon=0.0)).violations == ()  # zero is zero, not an underflow
    assert validate(mutated(BASE, Epsilon=1e-9)).violations == ()  # FLOAT32 tensors: no warning


def test_step_value_range_negative_and_absent():
    assert _fields(mutated(BASE, TrainingStepValue=-1)) == [("TrainingStepValue", "training-step-range")]
    d = copy.deepcopy(BASE)
    del d["TrainingStepValue"]
    assert validate(d).violations == ()


# ---------------------------------------------------------------------------
# Feature levels and Report
# ---------------------------------------------------------------------------


def test_feature_levels():
    assert FEATURE_LEVELS[0] == "3_0" and "4_0" in FEATURE_LEVELS and FEATURE_LEVELS[-1] == "6_4"
    two_d = RULE_CASES["dimension-count"][0]
    assert validate(two_d).feature_level == "3_0"
    assert not validate(two_d, "3_1").valid
    for level in FEATURE_LEVELS[2:]:
        assert validate(two_d, level).valid, level
    eight = _all_sizes(NO_BIND, [1, 2, 1, 2, 2, 2, 4, 8], [1] * 8)
    nine = _all_sizes(NO_BIND, [1, 1, 2, 1, 2, 2, 2, 4, 8], [1] * 9)
    assert validate(eight, "4_0").valid
    assert {v.rule for v in validate(nine, "6_4").violations} == {"dimension-count"}
    assert validate(eight, "DML_FEATURE_LEVEL_5_1").feature_level == "5_1"
    with pytest.raises(MalformedDescriptor, match='feature_level = "2_0"'):
        validate(BASE, "2_0")


def test_descriptor_feature_level_used_unless_overridden():
    d = mutated(RULE_CASES["dimension-count"][0], feature_level="4_0")
    assert validate(d).valid and validate(d).feature_level == "4_0"
    assert not validate(d, "3_0").valid


def test_report_api():
    report = validate(mutated(BASE, Beta1=2.0, TrainingStepValue=0))
    assert isinstance(report, Report)
    assert not report.valid
    assert [v.rule for v in report.errors] == ["hyperparameter"]
    assert [v.rule for v in report.warnings] == ["training-step-zero"]
    data = json.loads(report.to_json())
    assert data["valid"] is False and data["feature_level"] == "3_0"
    assert data["violations"][0] == {"field": "Beta1", "rule": "hyperparameter", "severity": "error",
                                     "message": report.errors[0].message}
    warn_only = validate(mutated(BASE, TrainingStepValue=0))
    assert warn_only.valid and warn_only.errors == () and len(warn_only.warnings) == 1
    assert isinstance(report.violations[0], Violation)


def test_validate_accepts_desc_or_mapping_only():
    assert validate(from_dict(BASE)).valid
    with pytest.raises(MalformedDescriptor, match="must be a JSON object"):
        validate([1, 2, 3])


# ---------------------------------------------------------------------------
# Properties: nothing crashes
# ---------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_EDGE_INTS = st.sampled_from([0, 1, 2, 3, 4, 15, 16, 17, 255, 256, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -1])


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield prefix + (i,)
            yield from _paths(value, prefix + (i,))


_BASE_PATHS = sorted(set(_paths(BASE)) | set(_paths(NO_BIND)) | set(_paths(FP16)), key=str)


@st.composite
def _mutations(draw):
    d = copy.deepcopy(draw(st.sampled_from([BASE, NO_BIND, FP16])))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(_BASE_PATHS))
        parent = d
        try:
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(_EDGE_INTS | _JSON)
    return d


def _outcome(obj):
    try:
        desc = loads(json.dumps(obj))
    except MalformedDescriptor as exc:
        assert "\n" not in str(exc) and str(exc)
        return exc
    report = validate(desc)
    assert isinstance(report, Report)
    assert report.valid == (not report.errors)
    assert all(v.rule in RULES and v.severity == RULES[v.rule] for v in report.violations)
    return report


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_mutated_descriptors_never_crash(d):
    _outcome(d)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_JSON)
def test_arbitrary_json_never_crashes(value):
    assert isinstance(_outcome(value), MalformedDescriptor)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_text_never_crashes(text):
    try:
        validate(loads(text))
    except MalformedDescriptor:
        pass


def test_astronomical_values_do_not_crash_messages():
    # 1500 sizes of 2^32 - 1: an element count far beyond str()'s 4300-digit limit
    d = mutated(NO_BIND, **{"GradientTensor.Sizes": [2**32 - 1] * 1500})
    report = validate(loads(json.dumps(d)))
    assert {"dimension-count", "element-count", "same-sizes", "total-size"} <= report.rules
    assert all(len(v.message) < 400 for v in report.violations)
    huge_step = validate(from_dict(BASE).replace(training_step_value=10**5000))
    assert [v.rule for v in huge_step.violations] == ["training-step-range"]


# -- what the messages show (mutation testing found these unpinned) ---------------------------


@pytest.mark.parametrize("value, shown", [
    ([[[[]]]], "got [[[[]]]]"),            # an empty list at the preview's depth limit
    ([[[[1]]]], "got [[[[...]]]]"),        # a non-empty one
    ({"a": [1]}, 'got {"a": [1]}'),        # a mapping: keys and values
    (np.bool_(True), "got <bool>"),        # numpy's bool is not an integer, like Python's
    (2**300, "= <a 301-bit integer> does not fit in UINT"),
    ({(1, 2): 3}, "got {[...]: 3}"),            # a key is previewed at depth 0
])
def test_malformed_messages_preview_the_value(value, shown):
    with pytest.raises(MalformedDescriptor) as info:
        from_dict(mutated(BASE, **{"InputParametersTensor.Sizes": [value, 1, 1, 1024]}))
    assert str(info.value).startswith("InputParametersTensor.Sizes[0] ") and shown in str(info.value), str(info.value)


def test_binding_offset_beyond_uint64_names_the_c_type():
    with pytest.raises(MalformedDescriptor, match=r"^Bindings\.InputParametersTensor\.Offset = 18446744073709551616 "
                                                 r"does not fit in UINT64 \(0\.\.18446744073709551615\)$"):
        from_dict(mutated(BASE, **{"Bindings.InputParametersTensor.Offset": 2**64}))


@pytest.mark.parametrize("value, shown", [(2**256 - 1, str(2**256 - 1)), (2**256, "a 257-bit number")])
def test_huge_step_values_are_shown_in_digits_up_to_256_bits(value, shown):
    [v] = validate(from_dict(mutated(BASE, TrainingStepValue=value))).violations
    assert v.message == f"TrainingStepValue = {shown} does not fit in UINT32 (0..4294967295)"


def test_alias_with_another_data_type_names_the_difference():
    report = validate(from_dict(mutated(BASE, **{"OutputParametersTensor.DataType": "FLOAT16"})))
    (alias,) = [v for v in report.violations if v.rule == "alias"]
    assert alias.message.endswith("in-place execution needs identical tensor descs (DataType FLOAT16 vs FLOAT32)")


def test_alignment_beyond_uint32_names_the_c_type():
    with pytest.raises(MalformedDescriptor, match=r"^InputParametersTensor\.GuaranteedBaseOffsetAlignment = 4294967296 "
                                                 r"does not fit in UINT \(0\.\.4294967295\)$"):
        from_dict(mutated(BASE, **{"InputParametersTensor.GuaranteedBaseOffsetAlignment": 2**32}))


def test_long_size_lists_are_shortened_after_eight_entries():
    report = validate(from_dict(mutated(BASE, **{"InputParametersTensor.Sizes": [1] * 8 + [1024]})))
    (same,) = [v for v in report.violations if v.rule == "same-sizes" and v.field == "InputFirstMomentTensor.Sizes"]
    assert same.message.endswith("differ from InputParametersTensor.Sizes = [1, 1, 1, 1, 1, 1, 1, 1, ...]")


def test_alias_with_another_dimension_count_names_the_difference():
    d = mutated(BASE, feature_level="4_0", **{"OutputParametersTensor.Sizes": [1, 1, 1, 1, 1024],
                                              "OutputParametersTensor.DimensionCount": 5})
    (alias,) = [v for v in validate(from_dict(d)).violations if v.rule == "alias"]
    assert alias.message.endswith("in-place execution needs identical tensor descs (DimensionCount 5 vs 4)")


def test_an_owned_input_aliased_by_two_outputs_is_reported_once():
    d = mutated(BASE, **{"InputParametersTensor.Flags": "OWNED_BY_DML",
                         "Bindings.OutputFirstMomentTensor.Buffer": "weights"})
    report = validate(from_dict(d))
    # two outputs share its range (an output overlap), the flag is one problem
    assert [v.field for v in report.violations if v.rule == "flags"] == ["InputParametersTensor.Flags"]
    assert [v.rule for v in report.violations if v.rule == "output-overlap"] == ["output-overlap"]


def test_bindings_are_kept_in_struct_order_and_copied():
    """``desc.bindings`` lists the bound tensors in struct order whatever the input order, and is the
    descriptor's own mapping (changing the caller's dict afterwards changes nothing)."""
    from dml_optim.dml.desc import TENSOR_NAMES

    d = copy.deepcopy(BASE)
    d["Bindings"] = dict(reversed(list(d["Bindings"].items())))
    desc = from_dict(d)
    assert list(desc.bindings) == list(TENSOR_NAMES)
    raw = dict(reversed(list(desc.bindings.items())))
    copied = desc.replace(bindings=raw)
    raw.pop("GradientTensor")
    assert list(copied.bindings) == list(TENSOR_NAMES)


def test_a_zero_size_binding_inside_another_range_overlaps_nothing():
    """A binding of 0 bytes shares no byte with anything (it is only too small: binding-size)."""
    d = mutated(BASE, **{"Bindings.InputFirstMomentTensor.Buffer": "weights", "Bindings.InputFirstMomentTensor.Offset": 16,
                         "Bindings.InputFirstMomentTensor.Size": 0})
    assert [(v.rule, v.field) for v in validate(from_dict(d)).violations] == [
        ("binding-size", "Bindings.InputFirstMomentTensor.Size")]


def test_a_negative_stride_names_its_field():
    with pytest.raises(MalformedDescriptor, match=r"^InputParametersTensor\.Strides\[0\] = -1 does not fit in UINT"):
        from_dict(mutated(BASE, **{"InputParametersTensor.Strides": [-1, 1, 1, 1]}))


def test_alias_with_other_sizes_names_the_difference():
    d = mutated(BASE, **{"OutputParametersTensor.Sizes": [1, 1, 2, 512]})
    (alias,) = [v for v in validate(from_dict(d)).violations if v.rule == "alias"]
    assert alias.message.endswith("in-place execution needs identical tensor descs (Sizes [1, 1, 2, 512] vs [1, 1, 1, 1024])")


def test_dimension_count_message_gives_the_range_of_the_feature_level():
    d = mutated(BASE, feature_level="4_0", **{"InputParametersTensor.Sizes": [1] * 9 + [1024]})
    messages = [v.message for v in validate(from_dict(d)).violations if v.rule == "dimension-count"]
    assert messages == ["InputParametersTensor.DimensionCount = 10; ADAM_OPTIMIZER at feature level 4_0 takes 1 to 8"]
