"""Validation of ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` descriptors and their bindings.

:func:`validate` checks a representable descriptor (see
:mod:`dml_optim.dml.desc`) against the DirectML rules of docs/design.md §3
and lists **every** violation, each with a stable rule id:

* Tensors (``DML_BUFFER_TENSOR_DESC`` page, ADAM_OPTIMIZER page): exactly 4
  dimensions at feature level 3_0/3_1, 1 to 8 from 4_0 (DirectML 1.6,
  ``DML_TENSOR_DIMENSION_COUNT_MAX1 = 8``); no size 0; at most 2^32 - 1
  elements; the seven non-step tensors FLOAT32 or FLOAT16, all with
  InputParametersTensor's data type and sizes; TrainingStepTensor a UINT32
  scalar (all sizes 1); ``TotalTensorSizeInBytes`` at least
  ``DMLCalcBufferTensorSize`` and a multiple of 4;
  ``GuaranteedBaseOffsetAlignment`` 0 or a power of two at least the element
  size; ``DML_TENSOR_FLAG_OWNED_BY_DML`` on inputs only.
* Attributes: Beta1 and Beta2 in [0, 1], LearningRate and Epsilon finite, all
  as the FLOAT (float32) DirectML receives.
* Bindings (``IDMLBindingTable::BindInputs/BindOutputs``): offsets multiples of
  ``DML_MINIMUM_BUFFER_TENSOR_ALIGNMENT = 16`` (and of the guaranteed
  alignment when larger); each range at least the tensor's size; an output may
  share bytes with an input only as an identical range with an identical
  tensor desc (in-place execution), never with TrainingStepTensor; the
  writable areas of two outputs (``[Offset, Offset +
  TotalTensorSizeInBytes)``, as ``BindOutputs`` defines them) never overlap.
* Step value: UINT32; 0 is a warning, because ``Alpha = sqrt(1 - Beta2**T) /
  (1 - Beta1**T)`` is 0/0 there.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from dml_optim.dml.desc import (
    DIMENSION_COUNT_MAX,
    FEATURE_LEVELS,
    FLAG_OWNED_BY_DML,
    INPUT_TENSORS,
    KNOWN_FLAGS,
    MAX_ELEMENTS,
    MINIMUM_BUFFER_TENSOR_ALIGNMENT,
    OUTPUT_TENSORS,
    UINT32_MAX,
    AdamOptimizerDesc,
    Binding,
    TensorDesc,
    canonical_feature_level,
    packed_strides,
)
from dml_optim.dml.desc_json import from_dict

__all__ = ["validate", "Report", "Violation", "RULES", "FEATURE_LEVELS", "ERROR", "WARNING"]

ERROR = "error"
WARNING = "warning"

#: Rule id -> severity (docs/design.md §3; ids are stable, tests and users match on them).
RULES: dict[str, str] = {
    "dimension-count": ERROR,
    "sizes-length": ERROR,
    "strides-length": ERROR,
    "zero-size": ERROR,
    "element-count": ERROR,
    "data-type": ERROR,
    "same-data-type": ERROR,
    "same-sizes": ERROR,
    "step-scalar": ERROR,
    "total-size": ERROR,
    "alignment": ERROR,
    "flags": ERROR,
    "hyperparameter": ERROR,
    "binding-size": ERROR,
    "binding-offset-alignment": ERROR,
    "alias": ERROR,
    "output-overlap": ERROR,
    "training-step-range": ERROR,
    "training-step-zero": WARNING,
    "epsilon-underflow": WARNING,
}

_STEP = "TrainingStepTensor"
_PARAMS = "InputParametersTensor"
_DATA_TENSOR_TYPES = ("FLOAT32", "FLOAT16")
#: Largest nonzero magnitude that rounds to 0 in FP16 (half the smallest subnormal, 2^-24; ties to even).
FP16_UNDERFLOW = 2.0**-25


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``field`` (``GradientTensor.DataType``, ``Bindings.X``, ``Beta1``), rule id, severity, message."""

    field: str
    rule: str
    severity: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"field": self.field, "rule": self.rule, "severity": self.severity, "message": self.message}

    def __str__(self) -> str:
        return f"{self.severity} {self.field} {self.rule}: {self.message}"


@dataclass(frozen=True)
class Report:
    """The outcome of :func:`validate`: ``valid`` is true when no violation has error severity."""

    valid: bool
    feature_level: str
    violations: tuple[Violation, ...]

    @property
    def errors(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.severity == ERROR)

    @property
    def warnings(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.severity == WARNING)

    @property
    def rules(self) -> set[str]:
        """The distinct rule ids that fired."""
        return {v.rule for v in self.violations}

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "feature_level": self.feature_level,
            "violations": [v.to_dict() for v in self.violations],
        }

    def to_json(self, indent: int | None = None) -> str:
        """``{"valid": ..., "feature_level": ..., "violations": [...]}`` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)


def _n(value: int) -> str:
    """An int for a message; astronomically large ones (beyond str()'s digit limit) by bit length."""
    return str(value) if value.bit_length() <= 256 else f"a {value.bit_length()}-bit number"


def _seq(values) -> str:
    """A list for a message, shortened after 8 entries."""
    items = [str(v) for v in values[:8]] + (["..."] if len(values) > 8 else [])
    return "[" + ", ".join(items) + "]"


def _v(field: str, rule: str, message: str) -> Violation:
    return Violation(field, rule, RULES[rule], message)


def validate(desc: AdamOptimizerDesc | Mapping[str, Any], feature_level: str | None = None) -> Report:
    """Every violation of the DirectML rules by ``desc`` at ``feature_level``.

    ``desc`` is an :class:`AdamOptimizerDesc` or a parsed JSON object (which
    may raise :class:`~dml_optim.dml.desc.MalformedDescriptor`).
    ``feature_level`` None uses the descriptor's own (default ``"3_0"``);
    an unknown level raises ``MalformedDescriptor``.
    """
    if not isinstance(desc, AdamOptimizerDesc):
        desc = from_dict(desc)
    level = canonical_feature_level(desc.feature_level if feature_level is None else feature_level)
    violations = tuple(_all_violations(desc, level))
    return Report(not any(v.severity == ERROR for v in violations), level, violations)


def _all_violations(desc: AdamOptimizerDesc, level: str) -> Iterator[Violation]:
    tensors = desc.tensors()
    for name, tensor in tensors.items():
        yield from _tensor_shape_rules(name, tensor, level)
        yield from _tensor_type_rules(name, tensor, tensors[_PARAMS])
        yield from _tensor_storage_rules(name, tensor)
    yield from _hyperparameter_rules(desc)
    if desc.bindings is not None:
        yield from _binding_rules(desc)
    yield from _step_value_rules(desc.training_step_value)


# ---------------------------------------------------------------------------
# Per tensor
# ---------------------------------------------------------------------------


def _dimension_range(level: str) -> tuple[int, int]:
    """(min, max) dimension count: exactly 4 before 4_0, 1..8 from 4_0 on."""
    return (4, 4) if level.startswith("3_") else (1, DIMENSION_COUNT_MAX)


def _tensor_shape_rules(name: str, t: TensorDesc, level: str) -> Iterator[Violation]:
    low, high = _dimension_range(level)
    count = t.dimension_count
    if not low <= count <= high:
        allowed = "exactly 4" if low == high else f"{low} to {high}"
        yield _v(f"{name}.DimensionCount", "dimension-count",
                 f"{name}.DimensionCount = {count}; ADAM_OPTIMIZER at feature level {level} takes {allowed}")
    if count != len(t.sizes):
        yield _v(f"{name}.Sizes", "sizes-length",
                 f"{name}.DimensionCount = {count} but Sizes has {len(t.sizes)} entries {_seq(t.sizes)}")
    if t.strides is not None and len(t.strides) != count:
        yield _v(f"{name}.Strides", "strides-length",
                 f"{name}.Strides has {len(t.strides)} entries {_seq(t.strides)}; DimensionCount is {count}")
    if 0 in t.sizes:
        yield _v(f"{name}.Sizes", "zero-size", f"{name}.Sizes {_seq(t.sizes)} contains 0; no size may be 0")
    if t.element_count > MAX_ELEMENTS:
        yield _v(f"{name}.Sizes", "element-count",
                 f"{name}.Sizes {_seq(t.sizes)} hold {_n(t.element_count)} elements; a buffer tensor holds at most "
                 f"2^32 - 1 = {MAX_ELEMENTS}")
    if name == _STEP and any(s != 1 for s in t.sizes):
        yield _v(f"{name}.Sizes", "step-scalar",
                 f"{name}.Sizes = {_seq(t.sizes)}; the training step is a scalar (every size 1)")


def _tensor_type_rules(name: str, t: TensorDesc, params: TensorDesc) -> Iterator[Violation]:
    if name == _STEP:
        if t.data_type != "UINT32":
            yield _v(f"{name}.DataType", "data-type",
                     f"{name}.DataType = {t.data_type}; the training step must be UINT32")
        return
    if t.data_type not in _DATA_TENSOR_TYPES:
        yield _v(f"{name}.DataType", "data-type",
                 f"{name}.DataType = {t.data_type}; ADAM_OPTIMIZER takes FLOAT32 or FLOAT16")
    if name == _PARAMS:
        return
    if t.data_type != params.data_type:
        yield _v(f"{name}.DataType", "same-data-type",
                 f"{name}.DataType = {t.data_type} differs from {_PARAMS}.DataType = {params.data_type}")
    if t.sizes != params.sizes:
        yield _v(f"{name}.Sizes", "same-sizes",
                 f"{name}.Sizes = {_seq(t.sizes)} differ from {_PARAMS}.Sizes = {_seq(params.sizes)}")


def _tensor_storage_rules(name: str, t: TensorDesc) -> Iterator[Violation]:
    total = t.total_tensor_size_in_bytes
    minimum = t.minimum_size_in_bytes()
    if total % 4:
        yield _v(f"{name}.TotalTensorSizeInBytes", "total-size",
                 f"{name}.TotalTensorSizeInBytes = {total} is not a multiple of 4")
    elif minimum is not None and total < minimum:
        yield _v(f"{name}.TotalTensorSizeInBytes", "total-size",
                 f"{name}.TotalTensorSizeInBytes = {total} is less than DMLCalcBufferTensorSize = {_n(minimum)}")
    align = t.guaranteed_base_offset_alignment
    if align and (align & (align - 1) or align < t.element_size):
        yield _v(f"{name}.GuaranteedBaseOffsetAlignment", "alignment",
                 f"{name}.GuaranteedBaseOffsetAlignment = {align}; must be 0 or a power of two "
                 f">= the element size ({t.element_size} bytes)")
    unknown = t.flags & ~sum(KNOWN_FLAGS.values())
    if unknown:
        yield _v(f"{name}.Flags", "flags", f"{name}.Flags = {t.flags} has unknown DML_TENSOR_FLAGS bits {unknown:#x}")
    if t.flags & FLAG_OWNED_BY_DML and name in OUTPUT_TENSORS:
        yield _v(f"{name}.Flags", "flags",
                 f"{name}.Flags = OWNED_BY_DML; DML_TENSOR_FLAG_OWNED_BY_DML applies to inputs only")


# ---------------------------------------------------------------------------
# Attributes and step value
# ---------------------------------------------------------------------------


def _float32(x: float) -> float:
    """``x`` as the FLOAT that DirectML receives (overflow becomes +-inf, NaN stays NaN)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _hyperparameter_rules(desc: AdamOptimizerDesc) -> Iterator[Violation]:
    for name, value in (("Beta1", desc.beta1), ("Beta2", desc.beta2)):
        if not 0.0 <= _float32(value) <= 1.0:
            yield _v(name, "hyperparameter", f"{name} = {value!r}; must be in [0, 1]")
    for name, value in (("LearningRate", desc.learning_rate), ("Epsilon", desc.epsilon)):
        if not math.isfinite(_float32(value)):
            yield _v(name, "hyperparameter", f"{name} = {value!r} is not a finite FLOAT (float32)")
    eps = desc.epsilon
    fp16 = [n for n, t in desc.tensors().items() if n != _STEP and t.data_type == "FLOAT16"]
    # FLOAT16 rounds the FLOAT that DirectML receives, not the double given here
    if fp16 and eps != 0 and abs(_float32(eps)) <= FP16_UNDERFLOW:
        yield _v("Epsilon", "epsilon-underflow",
                 f"Epsilon = {eps!r} rounds to 0 in FLOAT16 (|Epsilon| <= 2^-25 ~ 2.98e-8) and {fp16[0]} is "
                 f"FLOAT16; sqrt(V) + Epsilon can be 0")


def _step_value_rules(value: int | None) -> Iterator[Violation]:
    if value is None:
        return
    if not 0 <= value <= UINT32_MAX:
        yield _v("TrainingStepValue", "training-step-range",
                 f"TrainingStepValue = {_n(value)} does not fit in UINT32 (0..{UINT32_MAX})")
    elif value == 0:
        yield _v("TrainingStepValue", "training-step-zero",
                 "TrainingStepValue = 0 makes Alpha = sqrt(1 - Beta2^0) / (1 - Beta1^0) = 0/0 (NaN); start at 1")


# ---------------------------------------------------------------------------
# Bindings
# ---------------------------------------------------------------------------


def _binding_rules(desc: AdamOptimizerDesc) -> Iterator[Violation]:
    bindings = desc.bindings or {}
    tensors = desc.tensors()
    for name, b in bindings.items():
        yield from _range_rules(name, b, tensors[name])
    yield from _alias_rules(bindings, tensors)
    yield from _output_overlap_rules(bindings, tensors)


def _required_offset_alignment(t: TensorDesc) -> int:
    align = t.guaranteed_base_offset_alignment
    power_of_two = align > 0 and not align & (align - 1)
    return max(MINIMUM_BUFFER_TENSOR_ALIGNMENT, align if power_of_two else 0)


def _range_rules(name: str, b: Binding, t: TensorDesc) -> Iterator[Violation]:
    if b.size < t.total_tensor_size_in_bytes:
        yield _v(f"Bindings.{name}.Size", "binding-size",
                 f"Bindings.{name}.Size = {b.size} is less than {name}.TotalTensorSizeInBytes = "
                 f"{t.total_tensor_size_in_bytes}")
    align = _required_offset_alignment(t)
    if b.offset % align:
        yield _v(f"Bindings.{name}.Offset", "binding-offset-alignment",
                 f"Bindings.{name}.Offset = {b.offset} is not a multiple of {align} "
                 f"(DML_MINIMUM_BUFFER_TENSOR_ALIGNMENT = 16, or the guaranteed alignment if larger)")


def _effective_strides(t: TensorDesc) -> tuple[int, ...] | None:
    return t.strides if t.strides is not None else tuple(packed_strides(t.sizes))


def _desc_difference(a: TensorDesc, b: TensorDesc) -> str | None:
    """What differs between two tensor descs for in-place purposes (None when identical)."""
    for label, get in (
        ("DataType", lambda t: t.data_type),
        ("DimensionCount", lambda t: t.dimension_count),
        ("Sizes", lambda t: list(t.sizes)),
        ("Strides", lambda t: list(_effective_strides(t) or ())),
        ("TotalTensorSizeInBytes", lambda t: t.total_tensor_size_in_bytes),
    ):
        if get(a) != get(b):
            return f"{label} {get(a)} vs {get(b)}"
    return None


def _alias_rules(bindings: Mapping[str, Binding], tensors: Mapping[str, TensorDesc]) -> Iterator[Violation]:
    owned_reported: set[str] = set()
    for out in OUTPUT_TENSORS:
        if out not in bindings:
            continue
        for inp in INPUT_TENSORS:
            if inp not in bindings or not bindings[out].overlaps(bindings[inp]):
                continue
            reason = _alias_problem(out, inp, bindings, tensors)
            if reason:
                yield _v(f"Bindings.{out}", "alias", reason)
            if tensors[inp].flags & FLAG_OWNED_BY_DML and inp not in owned_reported:
                owned_reported.add(inp)
                yield _v(f"{inp}.Flags", "flags",
                         f"{inp}.Flags = OWNED_BY_DML but {inp} shares its buffer range with {out}; "
                         f"an aliased input cannot be owned by DirectML")


def _alias_problem(out: str, inp: str, bindings: Mapping[str, Binding], tensors: Mapping[str, TensorDesc]) -> str:
    bo, bi = bindings[out], bindings[inp]
    where = f"Bindings.{out} ({bo.buffer} [{bo.offset}, {bo.end})) overlaps Bindings.{inp} ({bi.buffer} [{bi.offset}, {bi.end}))"
    if inp == _STEP:
        return f"{where}; TrainingStepTensor may not be aliased"
    if (bo.offset, bo.size) != (bi.offset, bi.size):
        return f"{where}; in-place execution needs identical ranges"
    difference = _desc_difference(tensors[out], tensors[inp])
    if difference:
        return f"{where}; in-place execution needs identical tensor descs ({difference})"
    return ""


def _writable_area(b: Binding, t: TensorDesc) -> Binding:
    """What an output may write: ``[Offset, Offset + TotalTensorSizeInBytes)`` of its buffer (``BindOutputs``)."""
    return Binding(b.buffer, b.offset, t.total_tensor_size_in_bytes)


def _output_overlap_rules(bindings: Mapping[str, Binding], tensors: Mapping[str, TensorDesc]) -> Iterator[Violation]:
    areas = {o: _writable_area(bindings[o], tensors[o]) for o in OUTPUT_TENSORS if o in bindings}
    outs = list(areas)
    for i, first in enumerate(outs):
        for second in outs[i + 1 :]:
            a, b = areas[first], areas[second]
            if a.overlaps(b):
                yield _v(f"Bindings.{second}", "output-overlap",
                         f"Bindings.{second} writes {b.buffer} [{b.offset}, {b.end}), overlapping what "
                         f"Bindings.{first} writes ({a.buffer} [{a.offset}, {a.end})); the writable areas "
                         f"(Offset + TotalTensorSizeInBytes) of two outputs may not share bytes")
