"""The torch bridge: torch shapes, dtypes and tensors as DirectML tensor descs.

:func:`dml_sizes` maps a torch shape onto a fixed DirectML dimension count
(padding with leading 1s or folding leading dimensions), and
:func:`describe_tensor` gives the ``DML_BUFFER_TENSOR_DESC``
(:class:`~dml_optim.dml.desc.TensorDesc`) of a torch tensor, its dtype mapped
to a ``DML_TENSOR_DATA_TYPE`` and its strides taken from ``t.stride()``.
torch itself is never imported: tensors and dtypes are read through their
attributes, so this module costs nothing to import.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dml_optim.dml.desc import DIMENSION_COUNT_MAX, FLAG_NONE, TensorDesc, _as_int

__all__ = ["dml_sizes", "describe_tensor"]


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
