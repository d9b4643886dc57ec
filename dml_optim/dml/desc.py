"""The DirectML descriptor model: the structs of ``directml.h`` as frozen dataclasses.

Long by design: the two structs, their fields' rules and the binding table mirror ``directml.h`` in one place.

This module mirrors two structs of ``directml.h``:

* ``DML_BUFFER_TENSOR_DESC`` as :class:`TensorDesc` (``DataType, Flags,
  DimensionCount, Sizes, Strides, TotalTensorSizeInBytes,
  GuaranteedBaseOffsetAlignment``), and
* ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` as :class:`AdamOptimizerDesc` (eight
  tensors, the FLOAT attributes ``LearningRate, Beta1, Beta2, Epsilon``), plus
  what a binding table would hold (:class:`Binding`, one per tensor) and the
  value stored in the ``TrainingStepTensor``,

together with the DirectML constants they use, ``DMLCalcBufferTensorSize``
(:func:`calc_buffer_tensor_size`) and the meaning of ``Strides: null``
(:func:`packed_strides`).

The objects only refuse what the C structs cannot *hold* (a negative or
non-integer size, a size above UINT32, an unknown data-type name, a missing
tensor): that raises :class:`MalformedDescriptor`. Whether a representable
descriptor is *allowed* is :func:`dml_optim.dml.validate.validate`'s job.

This is the leaf of the descriptor modules and imports none of them:
:mod:`dml_optim.dml.desc_json` reads and writes the JSON form,
:mod:`dml_optim.dml.torch_bridge` describes torch shapes and tensors, and
:mod:`dml_optim.dml.builder` builds the optimizers' in-place descriptors.
Facts cited below come from the Microsoft Learn pages listed in docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dml_optim.core.packing import contiguous_strides

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
    "MalformedDescriptor",
    "TensorDesc",
    "Binding",
    "AdamOptimizerDesc",
    "calc_buffer_tensor_size",
    "packed_strides",
    "element_size",
    "parse_data_type",
    "parse_flags",
    "canonical_feature_level",
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
# DMLCalcBufferTensorSize and packed strides
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


def packed_strides(sizes: Sequence[int]) -> list[int]:
    """Row-major strides in elements of packed ``sizes`` (what ``Strides: null`` means; a size of 0 counts as 1)."""
    return list(contiguous_strides(tuple(sizes)))


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
