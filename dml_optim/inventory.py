"""Parameter-shape inventories of real models, and the one resolver of model names.

An inventory is the list of ``(name, shape)`` pairs that a model's
``named_parameters()`` yields, plus its total parameter count.  The package
ships inventories of real models as data (``dml_optim/data/shapes/models/``,
rebuilt by ``tools/generate_inventories.py``), next to the example
DirectML descriptors (``dml_optim/data/shapes/descriptors/``); both are read
with :mod:`importlib.resources`, so they work from an installed wheel as from
a checkout.  Benchmarks and tests use the inventories to build realistic sets
of parameters without downloading any model::

    from dml_optim.inventory import make_params, resolve_model

    inv = resolve_model("resnet50")            # a built-in name, or a path to an inventory JSON
    params = make_params(inv, generator=torch.Generator().manual_seed(0))

:func:`resolve_model` is what every command's model argument goes through
(``audit --model``, ``validate --model``, ``compare --workload``, ``bench
--workloads``): a built-in name (:func:`builtin_inventories`), a synthetic
name (``many-small-N``: N tensors of 1,024 elements; ``one-Nk`` / ``one-Nm``:
one tensor of N * 2**10 / N * 2**20 elements), or a path to an inventory file.

File format::

    {"name": str, "source": str, "total_parameters": int,
     "parameters": [{"name": "conv1.weight", "shape": [64, 3, 7, 7]}, ...]}
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Inventory", "SYNTHETIC_PATTERNS", "load_inventory", "builtin_inventories", "models_dir", "descriptors_dir",
    "known_models", "resolve_model", "make_params",
]

#: Synthetic model names :func:`resolve_model` accepts besides the built-in files.
SYNTHETIC_PATTERNS = ("many-small-N", "one-Nk", "one-Nm")
_MANY_SMALL = re.compile(r"many-small-([1-9][0-9]*)")
_ONE = re.compile(r"one-([1-9][0-9]*)([km])")


def _shapes_dir() -> Path:
    # pip installs packages as folders, so the resource is a real path (printed by `dml-optim info`)
    return Path(str(resources.files("dml_optim") / "data" / "shapes"))


def models_dir() -> Path:
    """The folder of the built-in model inventories (``<package>/data/shapes/models``)."""
    return _shapes_dir() / "models"


def descriptors_dir() -> Path:
    """The folder of the example ``DML_ADAM_OPTIMIZER_OPERATOR_DESC`` files (``<package>/data/shapes/descriptors``).

    One case per validator rule, each with the exit status and rule ids that
    ``dml-optim validate`` must produce (see the README.md there).
    """
    return _shapes_dir() / "descriptors"


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
    """Map model name (file stem) to path for the inventories installed with the package."""
    return {p.stem: p for p in sorted(models_dir().glob("*.json"))}


def known_models() -> list[str]:
    """The model names :func:`resolve_model` accepts: the built-in ones, then the synthetic patterns."""
    return [*builtin_inventories(), *SYNTHETIC_PATTERNS]


def _synthetic(name: str) -> Inventory | None:
    many = _MANY_SMALL.fullmatch(name)
    if many:
        count = int(many.group(1))
        params = tuple((f"t{i:04d}.weight", (1024,)) for i in range(count))  # as many-small.json
        return Inventory(name, f"synthetic: {count:,} tensors of 1,024 elements", count * 1024, params)
    one = _ONE.fullmatch(name)
    if one:
        n = int(one.group(1)) << (20 if one.group(2) == "m" else 10)
        return Inventory(name, f"synthetic: one tensor of {n:,} elements", n, (("weight", (n,)),))
    return None


def resolve_model(model: str | os.PathLike[str]) -> Inventory:
    """The inventory that a model argument names: a built-in name, a synthetic name, or a file.

    ``model`` is read as a path when it ends in ``.json`` or contains a path
    separator, and as a name otherwise (names take precedence over a file of
    the same name in the working directory).

    Raises:
        ValueError: a one-line message: the name is unknown (the message lists
            the known names), the file does not exist or cannot be read, or it
            is not a valid inventory (see :func:`load_inventory`).
    """
    text = os.fspath(model)
    looks_like_path = text.endswith(".json") or os.sep in text or (os.altsep is not None and os.altsep in text)
    if not looks_like_path:
        builtin = builtin_inventories()
        if text in builtin:
            return load_inventory(builtin[text])
        synthetic = _synthetic(text)
        if synthetic is not None:
            return synthetic
    path = Path(text)
    if not path.is_file():
        what = "no such inventory file" if looks_like_path else "unknown model"
        raise ValueError(f"{what} {text!r}: give a built-in model ({', '.join(known_models())}) "
                         "or the path of an inventory JSON file")
    try:
        return load_inventory(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None


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
