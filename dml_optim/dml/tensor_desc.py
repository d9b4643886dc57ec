"""DirectML buffer-tensor and ADAM_OPTIMIZER descriptors, in Python.

This module mirrors two structs of ``directml.h``:

* ``DML_BUFFER_TENSOR_DESC`` as :class:`TensorDesc` (``DataType, Flags,
  DimensionCount, Sizes, Strides, TotalTensorSizeInBytes,
  GuaranteedBaseOffsetAlignment``), and
* ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` as :class:`AdamOptimizerDesc` (eight
  tensors, the FLOAT attributes ``LearningRate, Beta1, Beta2, Epsilon``), plus
  what a binding table would hold (:class:`Binding`, one per tensor) and the
  value stored in the ``TrainingStepTensor``.

The objects only refuse what the C structs cannot *hold* (a negative or
non-integer size, a size above UINT32, an unknown data-type name, a missing
tensor): that raises :class:`MalformedDescriptor`. Whether a representable
descriptor is *allowed* is :func:`dml_optim.dml.validate.validate`'s job.

The JSON format (DESIGN.md §3) uses directml.h's field names::

    {"operator": "ADAM_OPTIMIZER", "feature_level": "3_0",
     "LearningRate": 0.001, "Beta1": 0.9, "Beta2": 0.999, "Epsilon": 1e-8,
     "InputParametersTensor": {"DataType": "FLOAT32", "Sizes": [1, 1, 1, 1024]},
     ... the other seven tensors ...,
     "Bindings": {"InputParametersTensor": {"Buffer": "w", "Offset": 0, "Size": 4096}},
     "TrainingStepValue": 1}

The top-level keys ``expect`` and ``description`` are ignored by the loader
(the ``shapes/descriptors`` corpus keeps its expectations there); any other
unknown key is malformed, so that a typo (``"Beta_1"``) is never silently
ignored. Facts cited below come from the Microsoft Learn pages listed in
DESIGN.md §3.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import IO, Any, Mapping, Sequence

__all__ = [
    "DATA_TYPES",
    "ELEMENT_SIZES",
    "FLAG_NONE",
    "FLAG_OWNED_BY_DML",
    "KNOWN_FLAGS",
    "TENSOR_NAMES",
    "INPUT_TENSORS",
    "OUTPUT_TENSORS",
    "UINT32_MAX",
    "UINT64_MAX",
    "MAX_ELEMENTS",
    "MINIMUM_BUFFER_TENSOR_ALIGNMENT",
    "DIMENSION_COUNT_MAX",
    "FEATURE_LEVELS",
    "BUFFER_ROLES",
    "MalformedDescriptor",
    "TensorDesc",
    "Binding",
    "AdamOptimizerDesc",
    "calc_buffer_tensor_size",
    "element_size",
    "parse_data_type",
    "parse_flags",
    "flags_to_json",
    "canonical_feature_level",
    "dml_sizes",
    "packed_strides",
    "describe_tensor",
    "adam_descriptor",
    "split_for_dml",
    "from_dict",
    "to_dict",
    "loads",
    "dumps",
    "load",
    "dump",
]

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
#: A buffer tensor holds at most 2^32 - 1 elements (sizes and element indices are UINT).
MAX_ELEMENTS = UINT32_MAX
#: ``DML_MINIMUM_BUFFER_TENSOR_ALIGNMENT``: binding offsets are multiples of 16 bytes.
MINIMUM_BUFFER_TENSOR_ALIGNMENT = 16
#: ``DML_TENSOR_DIMENSION_COUNT_MAX1``.
DIMENSION_COUNT_MAX = 8

#: ``DML_TENSOR_DATA_TYPE`` names (without the prefix) and their element sizes in
#: bytes, as ``DMLCalcBufferTensorSize`` switches on them; UNKNOWN counts 0 bytes
#: (DMLCalcBufferTensorSize returns 0 for it). The 4-bit types of later
#: DirectML releases are not modelled.
ELEMENT_SIZES: dict[str, int] = {
    "UNKNOWN": 0,
    "FLOAT32": 4,
    "FLOAT16": 2,
    "UINT32": 4,
    "UINT16": 2,
    "UINT8": 1,
    "INT32": 4,
    "INT16": 2,
    "INT8": 1,
    "FLOAT64": 8,
    "UINT64": 8,
    "INT64": 8,
}
DATA_TYPES = tuple(ELEMENT_SIZES)
_DATA_TYPE_PREFIX = "DML_TENSOR_DATA_TYPE_"

#: ``DML_TENSOR_FLAGS`` bits.
FLAG_NONE = 0
FLAG_OWNED_BY_DML = 1
KNOWN_FLAGS: dict[str, int] = {"NONE": FLAG_NONE, "OWNED_BY_DML": FLAG_OWNED_BY_DML}
_FLAG_PREFIX = "DML_TENSOR_FLAG_"

#: ``DML_FEATURE_LEVEL`` values at which ADAM_OPTIMIZER exists (it arrived in 3_0).
FEATURE_LEVELS = ("3_0", "3_1", "4_0", "4_1", "5_0", "5_1", "5_2", "6_0", "6_1", "6_2", "6_3", "6_4")
_FEATURE_LEVEL_PREFIX = "DML_FEATURE_LEVEL_"

#: JSON name -> attribute name of the eight tensors, in directml.h's struct order.
_TENSOR_FIELDS: dict[str, str] = {
    "InputParametersTensor": "input_parameters",
    "InputFirstMomentTensor": "input_first_moment",
    "InputSecondMomentTensor": "input_second_moment",
    "GradientTensor": "gradient",
    "TrainingStepTensor": "training_step",
    "OutputParametersTensor": "output_parameters",
    "OutputFirstMomentTensor": "output_first_moment",
    "OutputSecondMomentTensor": "output_second_moment",
}
TENSOR_NAMES = tuple(_TENSOR_FIELDS)
INPUT_TENSORS = TENSOR_NAMES[:5]
OUTPUT_TENSORS = TENSOR_NAMES[5:]
_ATTRIBUTES: dict[str, str] = {
    "LearningRate": "learning_rate",
    "Beta1": "beta1",
    "Beta2": "beta2",
    "Epsilon": "epsilon",
}
_TENSOR_KEYS = (
    "DataType",
    "Flags",
    "DimensionCount",
    "Sizes",
    "Strides",
    "TotalTensorSizeInBytes",
    "GuaranteedBaseOffsetAlignment",
)
_BINDING_KEYS = ("Buffer", "Offset", "Size")
_IGNORED_KEYS = ("expect", "description")
_TOP_KEYS = (
    ("operator", "feature_level")
    + tuple(_ATTRIBUTES)
    + TENSOR_NAMES
    + ("Bindings", "TrainingStepValue")
    + _IGNORED_KEYS
)


class MalformedDescriptor(ValueError):
    """Input the C structs cannot hold; ``str(exc)`` is one line naming the field and value."""


# ---------------------------------------------------------------------------
# Scalar parsing helpers (the "can the C struct hold it" checks)
# ---------------------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    """A one-line, bounded preview of a (possibly huge or deeply nested) value for messages."""
    text = " ".join(_preview(value, 3).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _preview(value: Any, depth: int) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 256 else f"<a {value.bit_length()}-bit integer>"
    if isinstance(value, str):
        return json.dumps(value[:80])
    if isinstance(value, (list, tuple)):
        if depth == 0:
            return "[...]" if value else "[]"
        items = [_preview(v, depth - 1) for v in value[:5]]
        return "[" + ", ".join(items + (["..."] if len(value) > 5 else [])) + "]"
    if isinstance(value, Mapping):
        if depth == 0:
            return "{...}" if value else "{}"
        keys = list(value)[:5]
        items = [f"{_preview(k, 0)}: {_preview(value[k], depth - 1)}" for k in keys]
        return "{" + ", ".join(items + (["..."] if len(value) > 5 else [])) + "}"
    return f"<{type(value).__name__}>"


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (numpy/torch integers too), else None; bools are not."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _uint(value: Any, where: str, maximum: int, ctype: str) -> int:
    """``value`` as an int in [0, maximum], else MalformedDescriptor naming ``where``."""
    number = _as_int(value)
    if number is None:
        raise MalformedDescriptor(f"{where} must be an integer ({ctype}), got {_short(value)}")
    if number < 0 or number > maximum:
        raise MalformedDescriptor(f"{where} = {_short(number)} does not fit in {ctype} (0..{maximum})")
    return number


def _uint_list(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise MalformedDescriptor(f"{where} must be a list of UINT, got {_short(value)}")
    return tuple(_uint(v, f"{where}[{i}]", UINT32_MAX, "UINT") for i, v in enumerate(value))


def _real(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy floats are Real, numpy bools not
        raise MalformedDescriptor(f"{where} must be a number (FLOAT), got {_short(value)}")
    try:
        return float(value)
    except OverflowError:
        raise MalformedDescriptor(f"{where} = {_short(value)} is too large for a FLOAT") from None


def parse_data_type(value: Any, where: str = "DataType") -> str:
    """Canonical ``DML_TENSOR_DATA_TYPE`` name (``FLOAT32``; the ``DML_TENSOR_DATA_TYPE_`` prefix is accepted)."""
    if not isinstance(value, str):
        raise MalformedDescriptor(f"{where} must be a data type name such as FLOAT32, got {_short(value)}")
    name = value.strip().upper()
    if name.startswith(_DATA_TYPE_PREFIX):
        name = name[len(_DATA_TYPE_PREFIX) :]
    if name not in ELEMENT_SIZES:
        raise MalformedDescriptor(
            f"{where} = {_short(value)} is not a DML_TENSOR_DATA_TYPE (one of {', '.join(DATA_TYPES)})"
        )
    return name


def _parse_flag_name(token: str, where: str) -> int:
    name = token.strip().upper()
    if name.startswith(_FLAG_PREFIX):
        name = name[len(_FLAG_PREFIX) :]
    if name not in KNOWN_FLAGS:
        raise MalformedDescriptor(f"{where} = {_short(token)} is not a DML_TENSOR_FLAGS name (NONE, OWNED_BY_DML)")
    return KNOWN_FLAGS[name]


def parse_flags(value: Any, where: str = "Flags") -> int:
    """``DML_TENSOR_FLAGS`` as an int bitmask.

    Accepts a name (``"OWNED_BY_DML"``, ``"DML_TENSOR_FLAG_OWNED_BY_DML"``), names
    joined by ``|``, a list of names, or a raw UINT bitmask. An unknown *name* is
    malformed; unknown *bits* in an integer are representable and left to the
    validator's ``flags`` rule.
    """
    if value is None:
        return FLAG_NONE
    if isinstance(value, str):
        bits = 0
        for token in value.split("|"):
            bits |= _parse_flag_name(token, where)
        return bits
    if isinstance(value, (list, tuple)):
        bits = 0
        for i, token in enumerate(value):
            if not isinstance(token, str):
                raise MalformedDescriptor(f"{where}[{i}] must be a flag name, got {_short(token)}")
            bits |= _parse_flag_name(token, f"{where}[{i}]")
        return bits
    return _uint(value, where, UINT32_MAX, "DML_TENSOR_FLAGS (UINT)")


def flags_to_json(flags: int) -> str | int:
    """``"NONE"``, ``"OWNED_BY_DML"``, or the raw int when unknown bits are set."""
    if flags == FLAG_NONE:
        return "NONE"
    if flags == FLAG_OWNED_BY_DML:
        return "OWNED_BY_DML"
    return flags


def canonical_feature_level(value: Any, where: str = "feature_level") -> str:
    """``"3_0"`` from ``"3_0"``, ``"3.0"`` or ``"DML_FEATURE_LEVEL_3_0"``; unknown levels are malformed.

    ADAM_OPTIMIZER exists from feature level 3_0 (DirectML 1.4); the accepted
    levels are ``FEATURE_LEVELS`` (3_0 ... 6_4).
    """
    if not isinstance(value, str):
        raise MalformedDescriptor(f"{where} must be a string such as \"3_0\", got {_short(value)}")
    level = value.strip().upper().replace(".", "_")
    if level.startswith(_FEATURE_LEVEL_PREFIX):
        level = level[len(_FEATURE_LEVEL_PREFIX) :]
    if level not in FEATURE_LEVELS:
        raise MalformedDescriptor(
            f"{where} = {_short(value)} is not a DirectML feature level with ADAM_OPTIMIZER "
            f"(one of {', '.join(FEATURE_LEVELS)})"
        )
    return level


def element_size(data_type: str) -> int:
    """Bytes per element of a data type name (0 for UNKNOWN)."""
    return ELEMENT_SIZES[parse_data_type(data_type)]


# ---------------------------------------------------------------------------
# DMLCalcBufferTensorSize
# ---------------------------------------------------------------------------


def calc_buffer_tensor_size(data_type: str, sizes: Sequence[int], strides: Sequence[int] | None = None) -> int:
    """Minimum ``TotalTensorSizeInBytes``, exactly as DirectMLX's ``DMLCalcBufferTensorSize``.

    Packed (``strides`` None): ``product(sizes) * element_size``. Strided:
    ``index_of_last = sum((size_i - 1) * stride_i)`` and
    ``(index_of_last + 1) * element_size``. Either way rounded up to a multiple
    of 4 bytes. UNKNOWN returns 0 (the C function's ``default`` case). Python
    ints, so no 32/64-bit overflow. A zero size makes the strided formula
    meaningless; it then returns the packed size (0).

    >>> calc_buffer_tensor_size("FLOAT16", [1, 1, 1, 3])
    8
    """
    size = ELEMENT_SIZES[parse_data_type(data_type)]
    if size == 0:
        return 0
    sizes = list(sizes)
    if strides is not None and len(strides) != len(sizes):
        raise ValueError(f"strides has {len(strides)} entries but sizes has {len(sizes)}")
    if strides is None or any(s == 0 for s in sizes):
        nbytes = math.prod(sizes) * size
    else:
        last = sum((s - 1) * st for s, st in zip(sizes, strides))
        nbytes = (last + 1) * size
    return (nbytes + 3) // 4 * 4


# ---------------------------------------------------------------------------
# The descriptor dataclasses
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDesc:
    """``DML_BUFFER_TENSOR_DESC``.

    ``dimension_count`` defaults to ``len(sizes)``; ``strides`` None means packed;
    ``total_tensor_size_in_bytes`` None becomes the ``DMLCalcBufferTensorSize``
    minimum; ``flags`` is the ``DML_TENSOR_FLAGS`` bitmask (names accepted).
    """

    data_type: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    total_tensor_size_in_bytes: int | None = None
    flags: int = FLAG_NONE
    guaranteed_base_offset_alignment: int = 0
    dimension_count: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("data_type", parse_data_type(self.data_type, "DataType"))
        set_("sizes", _uint_list(self.sizes, "Sizes"))
        if self.strides is not None:
            set_("strides", _uint_list(self.strides, "Strides"))
        if self.dimension_count is None:
            set_("dimension_count", len(self.sizes))
        set_("dimension_count", _uint(self.dimension_count, "DimensionCount", UINT32_MAX, "UINT"))
        set_("flags", parse_flags(self.flags, "Flags"))
        set_(
            "guaranteed_base_offset_alignment",
            _uint(self.guaranteed_base_offset_alignment, "GuaranteedBaseOffsetAlignment", UINT32_MAX, "UINT"),
        )
        if self.total_tensor_size_in_bytes is None:
            set_("total_tensor_size_in_bytes", self._default_total())
        set_(
            "total_tensor_size_in_bytes",
            _uint(self.total_tensor_size_in_bytes, "TotalTensorSizeInBytes", UINT64_MAX, "UINT64"),
        )

    def _default_total(self) -> int:
        strides = self.strides if self.strides is not None and len(self.strides) == len(self.sizes) else None
        minimum = calc_buffer_tensor_size(self.data_type, self.sizes, strides)
        return min(minimum, UINT64_MAX - 3)  # the largest multiple of 4 a UINT64 holds

    @property
    def element_size(self) -> int:
        """Bytes per element (0 for UNKNOWN)."""
        return ELEMENT_SIZES[self.data_type]

    @property
    def element_count(self) -> int:
        """Product of the sizes."""
        return math.prod(self.sizes)

    def minimum_size_in_bytes(self) -> int | None:
        """DMLCalcBufferTensorSize of these sizes/strides; None when strides do not match sizes."""
        if self.strides is not None and len(self.strides) != len(self.sizes):
            return None
        return calc_buffer_tensor_size(self.data_type, self.sizes, self.strides)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of DESIGN.md §3 (all fields written)."""
        return {
            "DataType": self.data_type,
            "Flags": flags_to_json(self.flags),
            "DimensionCount": self.dimension_count,
            "Sizes": list(self.sizes),
            "Strides": None if self.strides is None else list(self.strides),
            "TotalTensorSizeInBytes": self.total_tensor_size_in_bytes,
            "GuaranteedBaseOffsetAlignment": self.guaranteed_base_offset_alignment,
        }

    @classmethod
    def from_dict(cls, obj: Any, where: str = "tensor") -> "TensorDesc":
        """Build from a JSON object; field names in errors are prefixed with ``where``."""
        if not isinstance(obj, Mapping):
            raise MalformedDescriptor(f"{where} must be a JSON object (a DML_BUFFER_TENSOR_DESC), got {_short(obj)}")
        _reject_unknown(obj, _TENSOR_KEYS, where)
        for key in ("DataType", "Sizes"):
            if key not in obj:
                raise MalformedDescriptor(f"{where}.{key} is missing")
        try:
            return cls(
                data_type=obj["DataType"],
                sizes=obj["Sizes"],
                strides=obj.get("Strides"),
                total_tensor_size_in_bytes=obj.get("TotalTensorSizeInBytes"),
                flags=obj.get("Flags", FLAG_NONE),
                guaranteed_base_offset_alignment=obj.get("GuaranteedBaseOffsetAlignment", 0),
                dimension_count=obj.get("DimensionCount"),
            )
        except MalformedDescriptor as exc:
            raise MalformedDescriptor(f"{where}.{exc}") from None


@dataclass(frozen=True)
class Binding:
    """A ``DML_BUFFER_BINDING``: a byte range of a named buffer (``Buffer, Offset, SizeInBytes``)."""

    buffer: str
    offset: int = 0
    size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, str) or not self.buffer:
            raise MalformedDescriptor(f"Buffer must be a non-empty string naming a buffer, got {_short(self.buffer)}")
        object.__setattr__(self, "offset", _uint(self.offset, "Offset", UINT64_MAX, "UINT64"))
        object.__setattr__(self, "size", _uint(self.size, "Size", UINT64_MAX, "UINT64"))

    @property
    def end(self) -> int:
        """One past the last byte of the range."""
        return self.offset + self.size

    def overlaps(self, other: "Binding") -> bool:
        """True when both ranges are in the same buffer and share at least one byte."""
        return (
            self.buffer == other.buffer
            and self.size > 0
            and other.size > 0
            and self.offset < other.end
            and other.offset < self.end
        )

    def to_dict(self) -> dict[str, Any]:
        return {"Buffer": self.buffer, "Offset": self.offset, "Size": self.size}

    @classmethod
    def from_dict(cls, obj: Any, where: str, default_size: int) -> "Binding":
        """Build from ``{"Buffer", "Offset"=0, "Size"=the tensor's TotalTensorSizeInBytes}``."""
        if not isinstance(obj, Mapping):
            raise MalformedDescriptor(f"{where} must be a JSON object with Buffer, Offset, Size, got {_short(obj)}")
        _reject_unknown(obj, _BINDING_KEYS, where)
        if "Buffer" not in obj:
            raise MalformedDescriptor(f"{where}.Buffer is missing")
        try:
            return cls(obj["Buffer"], obj.get("Offset", 0), obj.get("Size", default_size))
        except MalformedDescriptor as exc:
            raise MalformedDescriptor(f"{where}.{exc}") from None


@dataclass(frozen=True)
class AdamOptimizerDesc:
    """``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` plus its bindings and step value.

    Formula (DirectML docs, feature level 3_0)::

        M = Beta1 * M + (1 - Beta1) * G
        V = Beta2 * V + (1 - Beta2) * G * G
        Alpha = sqrt(1 - Beta2**T) / (1 - Beta1**T)
        X = X - LearningRate * Alpha * M / (sqrt(V) + Epsilon)

    ``bindings`` maps tensor names (``"InputParametersTensor"`` ...) to
    :class:`Binding`; None means "no bindings given". ``training_step_value``
    is the UINT32 ``T`` stored in TrainingStepTensor (any int is held, so that
    the validator can report one out of range).
    """

    input_parameters: TensorDesc
    input_first_moment: TensorDesc
    input_second_moment: TensorDesc
    gradient: TensorDesc
    training_step: TensorDesc
    output_parameters: TensorDesc
    output_first_moment: TensorDesc
    output_second_moment: TensorDesc
    learning_rate: float
    beta1: float
    beta2: float
    epsilon: float
    bindings: Mapping[str, Binding] | None = None
    training_step_value: int | None = None
    feature_level: str = "3_0"

    def __post_init__(self) -> None:
        for json_name, attr in _TENSOR_FIELDS.items():
            if not isinstance(getattr(self, attr), TensorDesc):
                raise MalformedDescriptor(f"{json_name} must be a TensorDesc, got {_short(getattr(self, attr))}")
        for json_name, attr in _ATTRIBUTES.items():
            object.__setattr__(self, attr, _real(getattr(self, attr), json_name))
        object.__setattr__(self, "feature_level", canonical_feature_level(self.feature_level))
        value = self.training_step_value
        if value is not None:
            number = _as_int(value)
            if number is None:
                raise MalformedDescriptor(f"TrainingStepValue must be an integer, got {_short(value)}")
            object.__setattr__(self, "training_step_value", number)
        if self.bindings is not None:
            object.__setattr__(self, "bindings", self._checked_bindings(self.bindings))

    @staticmethod
    def _checked_bindings(bindings: Any) -> dict[str, Binding]:
        if not isinstance(bindings, Mapping):
            raise MalformedDescriptor(f"Bindings must map tensor names to bindings, got {_short(bindings)}")
        for name, binding in bindings.items():
            if name not in _TENSOR_FIELDS:
                raise MalformedDescriptor(f"Bindings.{name} is not one of the eight ADAM_OPTIMIZER tensors")
            if not isinstance(binding, Binding):
                raise MalformedDescriptor(f"Bindings.{name} must be a Binding, got {_short(binding)}")
        return {name: bindings[name] for name in TENSOR_NAMES if name in bindings}

    def tensor(self, name: str) -> TensorDesc:
        """The tensor called ``name`` in directml.h (``"GradientTensor"``)."""
        return getattr(self, _TENSOR_FIELDS[name])

    def tensors(self) -> dict[str, TensorDesc]:
        """The eight tensors by directml.h name, in struct order."""
        return {name: getattr(self, attr) for name, attr in _TENSOR_FIELDS.items()}

    def replace(self, **changes: Any) -> "AdamOptimizerDesc":
        """A copy with some attributes (or tensors, by directml.h name) changed."""
        renamed = {_TENSOR_FIELDS.get(k, _ATTRIBUTES.get(k, k)): v for k, v in changes.items()}
        return dataclasses.replace(self, **renamed)


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def _reject_unknown(obj: Mapping, allowed: Sequence[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise MalformedDescriptor(f"{where} has an unknown key {_short(key)} (allowed: {', '.join(allowed)})")


def from_dict(obj: Any) -> AdamOptimizerDesc:
    """An :class:`AdamOptimizerDesc` from a parsed JSON value (keys ``expect``/``description`` ignored)."""
    if not isinstance(obj, Mapping):
        raise MalformedDescriptor(f"a descriptor must be a JSON object, got {_short(obj)}")
    _reject_unknown(obj, _TOP_KEYS, "descriptor")
    operator = obj.get("operator", "ADAM_OPTIMIZER")
    if operator not in ("ADAM_OPTIMIZER", "DML_OPERATOR_ADAM_OPTIMIZER"):
        raise MalformedDescriptor(f"operator = {_short(operator)} is not supported (only ADAM_OPTIMIZER)")
    for key in TENSOR_NAMES + tuple(_ATTRIBUTES):
        if key not in obj:
            raise MalformedDescriptor(f"{key} is missing")
    tensors = {attr: TensorDesc.from_dict(obj[name], name) for name, attr in _TENSOR_FIELDS.items()}
    attributes = {attr: obj[name] for name, attr in _ATTRIBUTES.items()}
    return AdamOptimizerDesc(
        **tensors,
        **attributes,
        bindings=_bindings_from_dict(obj.get("Bindings"), tensors),
        training_step_value=obj.get("TrainingStepValue"),
        feature_level=obj.get("feature_level", "3_0"),
    )


def _bindings_from_dict(obj: Any, tensors: Mapping[str, TensorDesc]) -> dict[str, Binding] | None:
    if obj is None:
        return None
    if not isinstance(obj, Mapping):
        raise MalformedDescriptor(f"Bindings must be a JSON object keyed by tensor name, got {_short(obj)}")
    _reject_unknown(obj, TENSOR_NAMES, "Bindings")
    result = {}
    for name, value in obj.items():
        if value is None:
            continue
        default_size = tensors[_TENSOR_FIELDS[name]].total_tensor_size_in_bytes
        result[name] = Binding.from_dict(value, f"Bindings.{name}", default_size)
    return result


def to_dict(desc: AdamOptimizerDesc) -> dict[str, Any]:
    """The JSON object of DESIGN.md §3, every field written, in a fixed order."""
    out: dict[str, Any] = {"operator": "ADAM_OPTIMIZER", "feature_level": desc.feature_level}
    for name, attr in _ATTRIBUTES.items():
        out[name] = getattr(desc, attr)
    for name, tensor in desc.tensors().items():
        out[name] = tensor.to_dict()
    if desc.bindings is not None:
        out["Bindings"] = {name: b.to_dict() for name, b in desc.bindings.items()}
    out["TrainingStepValue"] = desc.training_step_value
    return out


def loads(text: str | bytes) -> AdamOptimizerDesc:
    """Parse descriptor JSON; anything the C structs cannot hold raises :class:`MalformedDescriptor`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedDescriptor(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError, TypeError) as exc:  # bad UTF-8, too deep, huge integer literal
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise MalformedDescriptor(f"not JSON: {first}") from None
    return from_dict(obj)


def dumps(desc: AdamOptimizerDesc, *, indent: int | None = 2) -> str:
    """Descriptor JSON; ``loads(dumps(d)) == d`` for every descriptor without NaN attributes."""
    return _format_json(to_dict(desc), indent, 0)


def _format_json(value: Any, indent: int | None, level: int) -> str:
    """json.dumps with ``indent``, except that lists and objects of scalars stay on one line."""
    if indent is None:
        return json.dumps(value)
    if isinstance(value, dict) and value and not all(isinstance(v, (str, int, float)) for v in value.values()):
        pad = " " * (indent * (level + 1))
        items = [f"{pad}{json.dumps(k)}: {_format_json(v, indent, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * (indent * level) + "}"
    return json.dumps(value)


def load(source: str | os.PathLike | IO[str]) -> AdamOptimizerDesc:
    """Read descriptor JSON from a path or an open text file."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise MalformedDescriptor(f"cannot read {os.fspath(source)}: {reason}") from None
        return loads(text)
    return loads(source.read())


def dump(desc: AdamOptimizerDesc, target: str | os.PathLike | IO[str], *, indent: int | None = 2) -> None:
    """Write descriptor JSON to a path or an open text file (with a final newline)."""
    text = dumps(desc, indent=indent) + "\n"
    if isinstance(target, (str, os.PathLike)):
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        target.write(text)


# ---------------------------------------------------------------------------
# torch shapes and tensors
# ---------------------------------------------------------------------------


def _check_dimension_count(dimension_count: int) -> None:
    if isinstance(dimension_count, bool) or not isinstance(dimension_count, int):
        raise ValueError(f"dimension_count must be an int in 1..8, got {dimension_count!r}")
    if not 1 <= dimension_count <= DIMENSION_COUNT_MAX:
        raise ValueError(f"dimension_count must be in 1..{DIMENSION_COUNT_MAX}, got {dimension_count}")


def _shape_tuple(shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (shape,) if _as_int(shape) is not None else tuple(shape)
    ints = tuple(_as_int(d) for d in dims)
    for i, (d, n) in enumerate(zip(dims, ints)):
        if n is None or n < 0:
            raise ValueError(f"shape[{i}] must be a non-negative int, got {d!r}")
    return ints


def dml_sizes(shape: int | Sequence[int], dimension_count: int = 4) -> list[int]:
    """A torch shape as DirectML sizes of exactly ``dimension_count`` dimensions.

    Right-aligned with leading 1s (``(3, 5)`` -> ``[1, 1, 3, 5]``); extra leading
    dimensions are folded (multiplied) into the first one (``(2, 3, 4, 5, 6)`` ->
    ``[6, 4, 5, 6]``); a 0-d shape becomes all ones; an int is a 1-d shape.
    The element count is preserved.
    """
    _check_dimension_count(dimension_count)
    dims = _shape_tuple(shape)
    if len(dims) <= dimension_count:
        return [1] * (dimension_count - len(dims)) + list(dims)
    keep = dimension_count - 1
    return [math.prod(dims[: len(dims) - keep])] + list(dims[len(dims) - keep :])


def packed_strides(sizes: Sequence[int]) -> list[int]:
    """Row-major strides in elements of packed ``sizes`` (what ``Strides: null`` means)."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(sizes[i + 1], 1)
    return strides


_TORCH_DATA_TYPES = {
    "float32": "FLOAT32",
    "float16": "FLOAT16",
    "float64": "FLOAT64",
    "int64": "INT64",
    "int32": "INT32",
    "int16": "INT16",
    "int8": "INT8",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "bool": "UINT8",
}


def _torch_data_type(dtype: Any) -> str:
    """DML data type of a torch dtype; UNKNOWN for one DirectML has no type for (bfloat16, complex)."""
    name = str(dtype).rsplit(".", 1)[-1]
    return _TORCH_DATA_TYPES.get(name, "UNKNOWN")


def _fold_strides(shape: tuple[int, ...], strides: tuple[int, ...], dimension_count: int) -> list[int]:
    """Strides matching :func:`dml_sizes`; the folded leading dimensions must be mergeable."""
    if len(shape) <= dimension_count:
        span = shape[0] * strides[0] if shape else 1
        return [span] * (dimension_count - len(shape)) + list(strides)
    head = len(shape) - (dimension_count - 1)
    real = [i for i in range(head) if shape[i] != 1]
    if 0 not in shape:
        for a, b in zip(real, real[1:]):
            if strides[a] != shape[b] * strides[b]:
                raise ValueError(
                    f"cannot fold dimensions 0..{head - 1} of a tensor with shape {shape} and strides "
                    f"{strides} into one DirectML dimension; use a larger dimension_count or .contiguous()"
                )
    merged = strides[real[-1]] if real else strides[head - 1]
    return [merged] + list(strides[head:])


def describe_tensor(t: Any, dimension_count: int = 4, *, flags: int | str = FLAG_NONE) -> TensorDesc:
    """The ``DML_BUFFER_TENSOR_DESC`` of a torch tensor (strides in elements, from ``t.stride()``).

    float32 -> FLOAT32 and float16 -> FLOAT16; other dtypes map to their DML type
    (or UNKNOWN) and so fail the validator's ``data-type`` rule for ADAM_OPTIMIZER.
    The storage offset is not part of a tensor desc (it belongs to the binding).
    Padded leading dimensions get the stride that a packed tensor would have.
    """
    shape = tuple(int(d) for d in t.shape)
    strides = tuple(int(s) for s in t.stride())
    sizes = dml_sizes(shape, dimension_count)
    dml_strides = _fold_strides(shape, strides, dimension_count)
    return TensorDesc(
        data_type=_torch_data_type(t.dtype),
        sizes=tuple(sizes),
        strides=tuple(dml_strides),
        flags=flags,
    )


# ---------------------------------------------------------------------------
# What the optimizers describe: one flat buffer, updated in place
# ---------------------------------------------------------------------------

#: Default buffer names of :func:`adam_descriptor`, by role.
BUFFER_ROLES = ("parameters", "first_moment", "second_moment", "gradient", "training_step")
_ROLE_TENSORS = {
    "parameters": ("InputParametersTensor", "OutputParametersTensor"),
    "first_moment": ("InputFirstMomentTensor", "OutputFirstMomentTensor"),
    "second_moment": ("InputSecondMomentTensor", "OutputSecondMomentTensor"),
    "gradient": ("GradientTensor",),
    "training_step": ("TrainingStepTensor",),
}


def _data_type_of(data_type: Any) -> str:
    if isinstance(data_type, str):
        return parse_data_type(data_type, "data_type")
    name = _torch_data_type(data_type)
    if name == "UNKNOWN":
        raise ValueError(f"data_type {data_type!r} has no DirectML data type")
    return name


def adam_descriptor(
    numel_or_shape: int | Sequence[int],
    data_type: Any,
    *,
    learning_rate: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    training_step: int,
    buffer_names: Mapping[str, str] | None = None,
    dimension_count: int = 4,
    element_offset: int = 0,
    feature_level: str | None = None,
) -> AdamOptimizerDesc:
    """ADAM_OPTIMIZER over one flat buffer per state, updated in place.

    Every output is bound to exactly the byte range of its input (DirectML allows
    in-place execution when the ranges and the tensor descs are identical); the
    gradient and the UINT32 step scalar have their own buffers. ``buffer_names``
    overrides the names of the roles ``parameters, first_moment, second_moment,
    gradient, training_step``. ``element_offset`` places the range that many
    elements into the buffers (a chunk of :func:`split_for_dml`).
    ``feature_level`` defaults to 3_0 for 4 dimensions, else 4_0. A chunk above
    UINT32 elements cannot be held in one size: split it first.
    """
    dtype = _data_type_of(data_type)
    names = _buffer_names(buffer_names)
    sizes = tuple(dml_sizes(numel_or_shape, dimension_count))
    data = TensorDesc(dtype, sizes)
    step = TensorDesc("UINT32", (1,) * dimension_count)
    offset = _uint(element_offset, "element_offset", UINT64_MAX, "UINT64") * ELEMENT_SIZES[dtype]
    bindings: dict[str, Binding] = {}
    for role, tensor_names in _ROLE_TENSORS.items():
        desc = step if role == "training_step" else data
        role_offset = 0 if role == "training_step" else offset
        for name in tensor_names:
            bindings[name] = Binding(names[role], role_offset, desc.total_tensor_size_in_bytes)
    if feature_level is None:
        feature_level = "3_0" if dimension_count == 4 else "4_0"
    return AdamOptimizerDesc(
        input_parameters=data,
        input_first_moment=data,
        input_second_moment=data,
        gradient=data,
        training_step=step,
        output_parameters=data,
        output_first_moment=data,
        output_second_moment=data,
        learning_rate=learning_rate,
        beta1=beta1,
        beta2=beta2,
        epsilon=epsilon,
        bindings=bindings,
        training_step_value=training_step,
        feature_level=feature_level,
    )


def _buffer_names(buffer_names: Mapping[str, str] | None) -> dict[str, str]:
    names = {role: role for role in BUFFER_ROLES}
    for role, name in (buffer_names or {}).items():
        if role not in names:
            raise ValueError(f"buffer_names has unknown role {role!r} (roles: {', '.join(BUFFER_ROLES)})")
        names[role] = name
    return names


def split_for_dml(numel: int, max_elements: int = MAX_ELEMENTS, *, align: int = 16) -> list[int]:
    """Chunk sizes summing to ``numel``, each at most ``max_elements`` (2^32 - 1 by default).

    Every chunk but the last is a multiple of ``align`` elements (16 by default),
    so that consecutive chunks of one buffer start at byte offsets that are
    multiples of ``DML_MINIMUM_BUFFER_TENSOR_ALIGNMENT`` (16) for any element
    size. ``numel == 0`` gives ``[]``.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if align < 1 or max_elements < align:
        raise ValueError(f"need 1 <= align <= max_elements, got align={align}, max_elements={max_elements}")
    chunk = max_elements // align * align
    full, rest = divmod(numel, chunk)
    return [chunk] * full + ([rest] if rest else [])
