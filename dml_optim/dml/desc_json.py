"""The JSON codec of ADAM_OPTIMIZER descriptors: text and dicts to and from the model.

Turns the JSON form of a ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` (docs/design.md §3)
into a :class:`~dml_optim.dml.desc.AdamOptimizerDesc` and back
(:func:`from_dict`/:func:`to_dict`, :func:`loads`/:func:`dumps`,
:func:`load`/:func:`dump`), one tensor desc or binding at a time included. The
format uses directml.h's field names::

    {"operator": "ADAM_OPTIMIZER", "feature_level": "3_0",
     "LearningRate": 0.001, "Beta1": 0.9, "Beta2": 0.999, "Epsilon": 1e-8,
     "InputParametersTensor": {"DataType": "FLOAT32", "Sizes": [1, 1, 1, 1024]},
     ... the other seven tensors ...,
     "Bindings": {"InputParametersTensor": {"Buffer": "w", "Offset": 0, "Size": 4096}},
     "TrainingStepValue": 1}

The top-level keys ``expect`` and ``description`` are ignored by the loader
(the ``shapes/descriptors`` corpus keeps its expectations there); any other
unknown key is malformed, so that a typo (``"Beta_1"``) is never silently
ignored. Everything the C structs cannot hold, and text that is not JSON,
raises :class:`~dml_optim.dml.desc.MalformedDescriptor`.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any, Mapping, Sequence

from dml_optim.dml.desc import (
    FLAG_NONE,
    FLAG_OWNED_BY_DML,
    TENSOR_NAMES,
    _ATTRIBUTES,
    _TENSOR_FIELDS,
    AdamOptimizerDesc,
    Binding,
    MalformedDescriptor,
    TensorDesc,
    _short,
)

__all__ = [
    "flags_to_json",
    "tensor_desc_to_dict",
    "tensor_desc_from_dict",
    "binding_to_dict",
    "binding_from_dict",
    "from_dict",
    "to_dict",
    "loads",
    "dumps",
    "load",
    "dump",
]

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


def flags_to_json(flags: int) -> str | int:
    """``"NONE"``, ``"OWNED_BY_DML"``, or the raw int when unknown bits are set."""
    if flags == FLAG_NONE:
        return "NONE"
    if flags == FLAG_OWNED_BY_DML:
        return "OWNED_BY_DML"
    return flags


def tensor_desc_to_dict(t: TensorDesc) -> dict[str, Any]:
    """The JSON object of a ``DML_BUFFER_TENSOR_DESC`` (docs/design.md §3, all fields written)."""
    return {
        "DataType": t.data_type,
        "Flags": flags_to_json(t.flags),
        "DimensionCount": t.dimension_count,
        "Sizes": list(t.sizes),
        "Strides": None if t.strides is None else list(t.strides),
        "TotalTensorSizeInBytes": t.total_tensor_size_in_bytes,
        "GuaranteedBaseOffsetAlignment": t.guaranteed_base_offset_alignment,
    }


def tensor_desc_from_dict(obj: Any, where: str = "tensor") -> TensorDesc:
    """A :class:`TensorDesc` from a JSON object; field names in errors are prefixed with ``where``."""
    if not isinstance(obj, Mapping):
        raise MalformedDescriptor(f"{where} must be a JSON object (a DML_BUFFER_TENSOR_DESC), got {_short(obj)}")
    _reject_unknown(obj, _TENSOR_KEYS, where)
    for key in ("DataType", "Sizes"):
        if key not in obj:
            raise MalformedDescriptor(f"{where}.{key} is missing")
    try:
        return TensorDesc(
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


def binding_to_dict(b: Binding) -> dict[str, Any]:
    """The JSON object of a binding: ``{"Buffer", "Offset", "Size"}``."""
    return {"Buffer": b.buffer, "Offset": b.offset, "Size": b.size}


def binding_from_dict(obj: Any, where: str, default_size: int) -> Binding:
    """A :class:`Binding` from ``{"Buffer", "Offset"=0, "Size"=default_size}``.

    ``default_size`` is the tensor's ``TotalTensorSizeInBytes``; field names in
    errors are prefixed with ``where``.
    """
    if not isinstance(obj, Mapping):
        raise MalformedDescriptor(f"{where} must be a JSON object with Buffer, Offset, Size, got {_short(obj)}")
    _reject_unknown(obj, _BINDING_KEYS, where)
    if "Buffer" not in obj:
        raise MalformedDescriptor(f"{where}.Buffer is missing")
    try:
        return Binding(obj["Buffer"], obj.get("Offset", 0), obj.get("Size", default_size))
    except MalformedDescriptor as exc:
        raise MalformedDescriptor(f"{where}.{exc}") from None



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
    tensors = {attr: tensor_desc_from_dict(obj[name], name) for name, attr in _TENSOR_FIELDS.items()}
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
        result[name] = binding_from_dict(value, f"Bindings.{name}", default_size)
    return result


def to_dict(desc: AdamOptimizerDesc) -> dict[str, Any]:
    """The JSON object of docs/design.md §3, every field written, in a fixed order."""
    out: dict[str, Any] = {"operator": "ADAM_OPTIMIZER", "feature_level": desc.feature_level}
    for name, attr in _ATTRIBUTES.items():
        out[name] = getattr(desc, attr)
    for name, tensor in desc.tensors().items():
        out[name] = tensor_desc_to_dict(tensor)
    if desc.bindings is not None:
        out["Bindings"] = {name: binding_to_dict(b) for name, b in desc.bindings.items()}
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
