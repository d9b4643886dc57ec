"""Benchmark workloads: named lists of parameter shapes (some frozen) and their tensors.

A :class:`Workload` is what one measurement steps over.  :func:`workload`
takes any name :func:`dml_optim.inventory.resolve_model` accepts, so
``bench --workloads`` takes the same names as every other command.  The
frozen-parameter rows use two workloads built here from module definitions:
:func:`lora` (16 frozen 512x512 Linear layers, each followed by a trainable
rank-8 adapter) and :func:`unfreezing` (16 Linear layers of which the top
``k`` are trainable), whose parameters are ``model.parameters()``, frozen
ones included.  The construction row steps :func:`linears` (16 trainable
Linear layers), the None-pattern row :func:`tensors` (40 x 128 x 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Workload", "workload", "lora", "unfreezing", "linears", "tensors", "default_workloads", "QUICK_WORKLOADS",
    "FROZEN_PREFIXES", "make_values", "make_params",
]

#: The speed rows' workloads per device type: real models' shapes, 2,000 small tensors, one large tensor
#: (64M elements on the CPU; 256M, 1 GiB in float32, on CUDA, where the targets' workloads come first).
#: The CPU's also has two mid-size buffers below ``backend="auto"``'s compile threshold (2**22 there):
#: one tensor of 256k and one of 1M elements, where ``auto`` runs eager.
_DEFAULT_WORKLOADS = {
    "cpu": ("resnet50", "bert-base-uncased", "gpt2", "many-small", "one-256k", "one-1m", "one-64m"),
    "cuda": ("gpt2", "one-256m", "resnet50", "bert-base-uncased", "many-small"),
}
#: The speed rows' workload of ``--quick``.
QUICK_WORKLOADS = ("many-small-256",)
#: How the frozen-parameter rows' workloads are named (:func:`lora`, :func:`unfreezing`).
FROZEN_PREFIXES = ("lora-", "unfreeze-")


def default_workloads(device_type: str) -> tuple[str, ...]:
    """The speed rows' default workloads on ``device_type`` (DirectML: the CPU's)."""
    return _DEFAULT_WORKLOADS.get(device_type, _DEFAULT_WORKLOADS["cpu"])


@dataclass(frozen=True)
class Workload:
    """A named list of parameter shapes; ``trainable`` marks which ones have ``requires_grad`` (None: all)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    source: str
    trainable: tuple[bool, ...] | None = None

    def is_trainable(self, index: int) -> bool:
        return self.trainable is None or self.trainable[index]

    @property
    def numel(self) -> int:
        """Elements of every tensor, frozen ones included."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def trainable_numel(self) -> int:
        """Elements a step updates."""
        return sum(math.prod(s) for i, s in enumerate(self.shapes) if self.is_trainable(i))

    def describe(self) -> dict:
        """The workload as the JSON document lists it."""
        return {"name": self.name, "source": self.source, "tensors": len(self.shapes), "elements": self.numel,
                "trainable_elements": self.trainable_numel}


def workload(name: str) -> Workload:
    """A workload: any model :func:`dml_optim.inventory.resolve_model` accepts.

    A built-in inventory (``resnet50``, ``many-small``: 2,000 x 1,024, ...), a
    synthetic name (``many-small-N``: N x 1,024; ``one-Nm`` / ``one-Nk``: one
    tensor of N * 2**20 / N * 2**10 elements, ``one-64m`` is 2**26), or the
    path of an inventory file.  ``ValueError`` (one line, listing the known
    names) otherwise.
    """
    from dml_optim.inventory import resolve_model

    inv = resolve_model(name)
    return Workload(inv.name, tuple(s for _, s in inv.parameters), inv.source)


def _from_module(name: str, source: str, model: torch.nn.Module) -> Workload:
    params = list(model.parameters())
    return Workload(name, tuple(tuple(p.shape) for p in params), source, tuple(p.requires_grad for p in params))


def lora(d: int = 512, r: int = 8, layers: int = 16) -> Workload:
    """The LoRA-shaped model: ``layers`` x (a frozen ``Linear(d, d)`` with bias, then a trainable rank-``r``
    adapter ``Linear(d, r)``, ``Linear(r, d)`` without bias), as ``model.parameters()`` lists it."""
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        base = torch.nn.Linear(d, d, device="meta").requires_grad_(False)
        blocks += [base, torch.nn.Linear(d, r, bias=False, device="meta"), torch.nn.Linear(r, d, bias=False, device="meta")]
    return _from_module(f"lora-{layers}x{d}-r{r}", f"{layers} x (frozen Linear({d}, {d}), trainable "
                        f"Linear({d}, {r}) + Linear({r}, {d}), no bias)", torch.nn.Sequential(*blocks))


def _linear_stack(d: int, layers: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(d, d, device="meta") for _ in range(layers)])


def unfreezing(k: int, d: int = 512, layers: int = 16) -> Workload:
    """``layers`` x ``Linear(d, d)`` with the top ``k`` layers trainable and the rest frozen."""
    if not 1 <= k <= layers:
        raise ValueError(f"unfreezing: k must be in [1, {layers}], got {k!r}")
    model = _linear_stack(d, layers)
    for layer in model[: layers - k]:
        layer.requires_grad_(False)
    return _from_module(f"unfreeze-{k}of{layers}x{d}", f"{layers} x Linear({d}, {d}), the top {k} trainable", model)


def linears(d: int = 512, layers: int = 16) -> Workload:
    """``layers`` x ``Linear(d, d)``, every parameter trainable (the construction row's model)."""
    return _from_module(f"linear-{layers}x{d}", f"{layers} x Linear({d}, {d})", _linear_stack(d, layers))


def tensors(count: int, shape: tuple[int, ...]) -> Workload:
    """``count`` trainable tensors of ``shape`` (the None-pattern row's parameters)."""
    dims = "x".join(map(str, shape))
    return Workload(f"{count}x{dims}", (tuple(shape),) * count, f"{count} tensors of {dims} elements")


def make_values(work: Workload, device: torch.device, dtype: torch.dtype, *, seed: int, scale: float,
                trainable_only: bool = False) -> list[torch.Tensor | None]:
    """Random-normal tensors with ``work``'s shapes (None for frozen ones when ``trainable_only``).

    Drawn on the device where it has a generator (CUDA: fast for 256M
    elements), else on the CPU and moved.
    """
    on_device = device.type == "cuda"
    gen = torch.Generator(device=device if on_device else "cpu").manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for i, shape in enumerate(work.shapes):
        if trainable_only and not work.is_trainable(i):
            out.append(None)
            continue
        t = torch.randn(shape, generator=gen, device=device if on_device else "cpu", dtype=torch.float32).mul_(scale)
        out.append(t.to(device=device, dtype=dtype))
    return out


def make_params(work: Workload, values: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Fresh parameters holding copies of ``values``, frozen where ``work`` says so."""
    return [torch.nn.Parameter(v.clone(), requires_grad=work.is_trainable(i)) for i, v in enumerate(values)]
