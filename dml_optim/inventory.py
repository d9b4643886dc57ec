"""Parameter-shape inventories of real models.

An inventory is the list of ``(name, shape)`` pairs that a model's
``named_parameters()`` yields, plus its total parameter count, stored as JSON
under ``shapes/models/`` in the repository (see ``shapes/models/generate.py``,
which rebuilds them). Benchmarks and tests use them to build realistic sets of
parameters without downloading any model::

    from dml_optim.inventory import builtin_inventories, load_inventory, make_params

    inv = load_inventory(builtin_inventories()["resnet50"])
    params = make_params(inv, generator=torch.Generator().manual_seed(0))

File format::

    {"name": str, "source": str, "total_parameters": int,
     "parameters": [{"name": "conv1.weight", "shape": [64, 3, 7, 7]}, ...]}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Inventory", "load_inventory", "builtin_inventories", "make_params"]

_MODELS_DIR = Path(__file__).resolve().parent.parent / "shapes" / "models"


@dataclass(frozen=True)
class Inventory:
    """The parameter shapes of one model.

    Attributes:
        name: short model name, e.g. ``"resnet50"``.
        source: the architecture and configuration the shapes follow.
        total_parameters: the model's published parameter count.
        parameters: ``(name, shape)`` pairs in ``named_parameters()`` order.
    """

    name: str
    source: str
    total_parameters: int
    parameters: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        """Sum of the element counts of all tensors."""
        return sum(math.prod(shape) for _, shape in self.parameters)

    @property
    def num_tensors(self) -> int:
        """Number of parameter tensors."""
        return len(self.parameters)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_inventory(path: str | os.PathLike[str]) -> Inventory:
    """Read and validate an inventory JSON file.

    Raises:
        ValueError: the file is not valid JSON, a field is missing or has the
            wrong type, a shape has a non-positive dimension, a parameter name
            repeats, or the shapes do not add up to ``total_parameters``. The
            message names the file and the field.
        OSError: the file cannot be read.
    """
    path = Path(path)

    def bad(field: str, problem: str) -> ValueError:
        return ValueError(f"{path}: field {field!r}: {problem}")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")

    for field in ("name", "source", "total_parameters", "parameters"):
        if field not in data:
            raise bad(field, "missing")
    name, source, total, entries = data["name"], data["source"], data["total_parameters"], data["parameters"]
    if not isinstance(name, str) or not name:
        raise bad("name", f"expected a non-empty string, got {name!r}")
    if not isinstance(source, str):
        raise bad("source", f"expected a string, got {source!r}")
    if not _is_int(total) or total < 0:
        raise bad("total_parameters", f"expected a non-negative integer, got {total!r}")
    if not isinstance(entries, list):
        raise bad("parameters", f"expected a list, got {type(entries).__name__}")

    params: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"parameters[{i}]"
        if not isinstance(entry, dict):
            raise bad(where, f"expected an object with 'name' and 'shape', got {entry!r}")
        pname = entry.get("name")
        if not isinstance(pname, str) or not pname:
            raise bad(f"{where}.name", f"expected a non-empty string, got {pname!r}")
        if pname in seen:
            raise bad(f"{where}.name", f"duplicate parameter name {pname!r}")
        seen.add(pname)
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d > 0 for d in shape):
            raise bad(f"{where}.shape", f"expected a list of positive integers, got {shape!r} (parameter {pname!r})")
        params.append((pname, tuple(shape)))

    inventory = Inventory(name=name, source=source, total_parameters=total, parameters=tuple(params))
    if inventory.numel != total:
        raise bad(
            "total_parameters",
            f"{total} does not match the sum of the shapes, {inventory.numel} ({inventory.num_tensors} tensors)",
        )
    return inventory


def builtin_inventories() -> dict[str, Path]:
    """Map model name (file stem) to path for the inventories in the repository's ``shapes/models``.

    The folder is found relative to this module, so this works from a source
    checkout (including an editable install); an installed wheel does not ship
    ``shapes/`` and gets an empty dict.
    """
    if not _MODELS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(_MODELS_DIR.glob("*.json"))}


def make_params(
    inventory: Inventory,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
) -> list[torch.nn.Parameter]:
    """Random-normal parameters with the inventory's shapes, in its order.

    Values are drawn as float32 from N(0, scale**2), then cast to ``dtype`` and
    moved to ``device``. With a ``generator`` they are drawn on the generator's
    device, so a seeded generator gives the same values whatever ``device`` and
    ``dtype`` are (up to the cast); without one they are drawn on ``device``
    from the global RNG.

    Raises:
        ValueError: ``dtype`` is not a floating-point type.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"make_params: dtype must be a floating-point type, got {dtype}")
    device = torch.device(device)
    draw_on = generator.device if generator is not None else device
    params = []
    for _, shape in inventory.parameters:
        values = torch.randn(shape, generator=generator, device=draw_on, dtype=torch.float32)
        if scale != 1.0:
            values.mul_(scale)
        params.append(torch.nn.Parameter(values.to(device=device, dtype=dtype)))
    return params
