"""Run ONNX ``ai.onnx.preview.training`` optimizer nodes through :mod:`dml_optim.core.functional`.

``run_node(node, inputs)`` executes one ``NodeProto`` of ``Adagrad``,
``Momentum`` or ``Adam`` (domain ``ai.onnx.preview.training``, version 1)
on NumPy inputs and returns NumPy outputs, in the ONNX input and output
order.  ONNX Runtime implements none of these three operators (they exist
only in the ONNX spec and in ``onnx.reference``), so this module makes
``dml-optim`` a working, device-capable implementation of them.

Attributes and their defaults are the operator schemas' (``onnx/defs/training/defs.cc``):

* ``Adagrad``: ``decay_factor=0``, ``epsilon=1e-6``, ``norm_coefficient=0``.
  (docs/design.md §2 lists ``epsilon=0``; the schema, and so ``onnx.reference``,
  default it to ``1e-6``.  A node is run as the schema says.)
* ``Momentum``: ``alpha``, ``beta``, ``mode`` (``"standard"`` or
  ``"nesterov"``), ``norm_coefficient``; all required.
* ``Adam``: ``alpha=0.9``, ``beta=0.999``, ``epsilon=1e-6``,
  ``norm_coefficient=0``, ``norm_coefficient_post=0``.

Attributes are FLOAT (float32) in ONNX, defaults included, so every numeric
attribute reaches :mod:`dml_optim.core.functional` as its float32 value (``0.9`` is
``0.8999999761581421``), whether the node sets it or not.

.. warning:: ONNX ``Adam`` adds ``epsilon`` to the *uncorrected*
   ``sqrt(H_new)``; ``torch.optim.Adam`` adds it to the bias-corrected one.
   They agree only when ``epsilon == 0``.

Needs the ``onnx`` extra (``pip install dml-optim[onnx]``); ``onnx`` is
imported only when :func:`run_node` is called.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from dml_optim.core import functional

__all__ = ["DOMAIN", "OP_TYPES", "run_node"]

#: The ONNX domain of the three training operators.
DOMAIN = "ai.onnx.preview.training"

_REQUIRED = object()  # marker: the attribute has no default


def _float32(value: float) -> float:
    """The value an ONNX FLOAT attribute holds for ``value``."""
    return float(np.float32(value))


# op type -> (function, names of the input groups after R and T, attributes with their defaults)
_OPS: dict[str, tuple[Any, tuple[str, ...], dict[str, object]]] = {
    "Adagrad": (
        functional.adagrad,
        ("X", "G", "H"),
        {"decay_factor": 0.0, "epsilon": _float32(1e-6), "norm_coefficient": 0.0},
    ),
    "Momentum": (
        functional.momentum,
        ("X", "G", "V"),
        {"alpha": _REQUIRED, "beta": _REQUIRED, "mode": _REQUIRED, "norm_coefficient": _REQUIRED},
    ),
    "Adam": (
        functional.adam,
        ("X", "G", "V", "H"),
        {
            "alpha": _float32(0.9),
            "beta": _float32(0.999),
            "epsilon": _float32(1e-6),
            "norm_coefficient": 0.0,
            "norm_coefficient_post": 0.0,
        },
    ),
}

#: The operator types :func:`run_node` executes.
OP_TYPES = tuple(_OPS)

_STRING_ATTRIBUTES = frozenset({"mode"})


def _import_onnx():
    try:
        import onnx
    except ImportError as exc:
        raise ImportError(
            "dml_optim.onnx needs the 'onnx' package: pip install dml-optim[onnx]"
        ) from exc
    return onnx


def _attributes(onnx, node, op_type: str, defaults: dict[str, object]) -> dict[str, object]:
    """The node's attributes merged with the spec's defaults, type-checked."""
    given: dict[str, object] = {}
    for attr in node.attribute:
        name = attr.name
        if name not in defaults:
            raise ValueError(
                f"{op_type}: unknown attribute {name!r} (allowed: {', '.join(sorted(defaults))})"
            )
        if name in given:
            raise ValueError(f"{op_type}: attribute {name!r} is given twice")
        if name in _STRING_ATTRIBUTES:
            expected = onnx.AttributeProto.STRING
        else:
            expected = onnx.AttributeProto.FLOAT
        if attr.type != expected:
            raise ValueError(
                f"{op_type}: attribute {name!r} must be of type "
                f"{onnx.AttributeProto.AttributeType.Name(expected)}, got "
                f"{onnx.AttributeProto.AttributeType.Name(attr.type)}"
            )
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{op_type}: attribute {name!r} is not valid UTF-8: {value!r}") from None
        given[name] = value
    merged = {}
    for name, default in defaults.items():
        if name in given:
            merged[name] = given[name]
        elif default is _REQUIRED:
            raise ValueError(f"{op_type}: required attribute {name!r} is missing")
        else:
            merged[name] = default
    return merged


def _to_tensor(value, name: str, device: torch.device) -> torch.Tensor:
    array = np.asarray(value)
    try:
        # A copy: the caller's arrays are never shared with (or changed by) the computation.
        tensor = torch.tensor(array)
    except TypeError as exc:
        raise TypeError(f"input {name}: cannot convert dtype {array.dtype} to a tensor") from exc
    return tensor.to(device)


def run_node(node, inputs: Sequence[Any], device: torch.device | str | None = None) -> list[np.ndarray]:
    """Execute one ONNX training-optimizer node; return its outputs as NumPy arrays.

    Args:
        node: an ``onnx.NodeProto`` with ``domain == "ai.onnx.preview.training"``
            and ``op_type`` one of ``Adagrad``, ``Momentum``, ``Adam``.
        inputs: ``R, T, X..., G..., states...`` in the node's input order
            (NumPy arrays or Python/NumPy scalars).  ``R`` is a float scalar,
            ``T`` an integer scalar, the rest float arrays.
        device: where to compute (a ``torch.device`` or a string such as
            ``"cuda"``); ``None`` means the CPU.

    Returns:
        ``[X_new..., states_new...]`` in the node's output order, each with
        the dtype of the corresponding input tensor.

    Raises:
        ValueError: another domain or op type, an unknown or missing required
            attribute, an attribute of the wrong type, or an input/output
            count that does not fit the operator.
        TypeError: ``node`` is not a ``NodeProto``, or an input has an unusable
            type.  Invalid values (shapes, dtypes, hyperparameters) raise
            what :mod:`dml_optim.core.functional` raises.
    """
    onnx = _import_onnx()
    if not isinstance(node, onnx.NodeProto):
        raise TypeError(f"node must be an onnx.NodeProto, got {type(node).__name__}")
    op_type = node.op_type
    if node.domain != DOMAIN:
        raise ValueError(
            f"node {op_type!r} has domain {node.domain!r}; run_node runs only domain {DOMAIN!r} "
            f"(op types {', '.join(OP_TYPES)})"
        )
    if op_type not in _OPS:
        raise ValueError(f"unsupported op type {op_type!r} in domain {DOMAIN!r}; supported: {', '.join(OP_TYPES)}")
    function, groups, defaults = _OPS[op_type]
    attributes = _attributes(onnx, node, op_type, defaults)

    inputs = list(inputs)
    group_names = ", ".join(g + "..." for g in groups)
    n_tensors = len(inputs) - 2
    if n_tensors <= 0 or n_tensors % len(groups):
        raise ValueError(
            f"{op_type}: expected 2 + a positive multiple of {len(groups)} inputs "
            f"(R, T, {group_names}), got {len(inputs)}"
        )
    if len(node.input) != len(inputs):
        raise ValueError(f"{op_type}: the node names {len(node.input)} inputs, but {len(inputs)} were given")
    n_outputs = n_tensors // len(groups) * (len(groups) - 1)
    if len(node.output) != n_outputs:
        raise ValueError(
            f"{op_type}: with {len(inputs)} inputs the node must have {n_outputs} outputs, "
            f"it names {len(node.output)}"
        )

    device = torch.device("cpu") if device is None else torch.device(device)
    names = list(node.input)
    tensors = [_to_tensor(value, repr(name), device) for value, name in zip(inputs, names)]
    outputs = function(tensors[0], tensors[1], *tensors[2:], **attributes)
    return [out.detach().cpu().numpy() for out in outputs]
