"""The descriptor builder: the ADAM_OPTIMIZER descriptors the optimizers execute.

:func:`adam_descriptor` builds the in-place
:class:`~dml_optim.dml.desc.AdamOptimizerDesc` of one flat buffer per state
(parameters, moments), every output bound to exactly its input's byte range,
with the gradient and the step scalar in buffers of their own (one buffer
per role of :data:`BUFFER_ROLES`, named after it unless renamed). :func:`split_for_dml` cuts a buffer
too large for one tensor desc (over 2^32 - 1 elements) into aligned chunks.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dml_optim.dml.desc import (
    ELEMENT_SIZES,
    MAX_ELEMENTS,
    UINT64_MAX,
    AdamOptimizerDesc,
    Binding,
    TensorDesc,
    _uint,
    parse_data_type,
)
from dml_optim.dml.torch_bridge import _torch_data_type, dml_sizes

__all__ = ["BUFFER_ROLES", "adam_descriptor", "split_for_dml"]

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
