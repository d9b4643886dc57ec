"""Bytes per parameter of each precision configuration, read from the optimizer's own tensors.

:func:`measure` builds an optimizer in a :class:`~dml_optim.precision.configs.Config`
over the built-in MLP widened to about a million parameters
(:data:`HIDDEN`), takes one step (states, master copy, compensation buffer
and scratch are allocated then) and adds up the bytes of the tensors
:meth:`~dml_optim.FlatOptimizer.flat_buffers` reports: parameters,
gradients, states, master copy, Kahan compensation, scratch.  Eager backend,
the op chain DirectML runs.  :func:`memory_table` is the README's table;
``tests/test_memory_table.py`` rebuilds it and compares, and
``python -m dml_optim.precision.memory`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dml_optim.job import toy
from dml_optim.precision.configs import CONFIGS, Config
from dml_optim.precision.optimizers import make_optimizer
from dml_optim.core.quant import tensors_of

__all__ = ["HIDDEN", "OPTIMIZERS", "Footprint", "measure", "memory_table"]

#: Hidden width of the measured MLP (32-1000-1000-10: 1,044,010 parameters, just below one 2**20-element chunk).
HIDDEN = 1000
#: The optimizers of the table (registry names).
OPTIMIZERS = ("adam", "adamw")


@dataclass(frozen=True)
class Footprint:
    """Bytes per parameter of one optimizer in one configuration, by what holds them."""

    optimizer: str
    config: str
    parameters: int
    params: float
    grads: float
    states: float
    master: float
    kahan: float
    scratch: float

    @property
    def held(self) -> float:
        """Everything but the scratch: what grows with the model in every configuration."""
        return self.params + self.grads + self.states + self.master + self.kahan

    @property
    def total(self) -> float:
        return self.held + self.scratch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(optimizer: str, config: Config, hidden: int = HIDDEN) -> Footprint:
    """The :class:`Footprint` of ``optimizer`` in ``config`` after one step on the MLP of width ``hidden``."""
    model = toy.make_model(0, hidden, dtype=config.param_dtype)
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params, config)
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(config.param_dtype)
    opt.step()
    buffers = opt.flat_buffers()
    n = sum(p.numel() for p in params)  # parameters (a quantized buffer adds padding: counted as memory)
    per = lambda tensors: _bytes(tensors) / n
    return Footprint(
        optimizer, config.name, n,
        params=per(b.data for b in buffers),
        grads=per(b.grad for b in buffers),
        states=per(t for b in buffers for s in b.states.values() for t in tensors_of(s)),
        master=per(b.master for b in buffers),
        kahan=per(b.kahan for b in buffers),
        scratch=per(t for b in buffers for t in b.scratch),
    )


def _cell(value: float) -> str:
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def memory_table(rows: Sequence[Footprint] | None = None) -> str:
    """The README's Markdown table of ``rows`` (default: every optimizer of :data:`OPTIMIZERS` in every
    configuration, measured now)."""
    rows = rows if rows is not None else [measure(name, config) for name in OPTIMIZERS for config in CONFIGS.values()]
    lines = [f"Bytes per parameter, measured on {rows[0].parameters:,} parameters (the built-in MLP at width "
             f"{HIDDEN}, 32-{HIDDEN}-{HIDDEN}-10) after one step, eager backend:", "",
             "| optimizer | configuration | parameters | gradients | states | master copy | compensation | scratch "
             "| total | total without scratch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in rows:
        cells = [f.params, f.grads, f.states, f.master, f.kahan, f.scratch]
        lines.append(f"| {f.optimizer} | `{f.config}` | " + " | ".join(_cell(v) for v in cells)
                     + f" | {_cell(f.total)} | **{_cell(f.held)}** |")
    return "\n".join(lines)


#: The configurations a DirectML user chooses between, best accuracy first (the README's training-bytes table).
TRAINING_CONFIGS = ("fp32", "fp16-master", "fp16-kahan", "fp32-8bit", "fp32-4bit", "fp16-kahan-8bit", "fp16-kahan-4bit")


def training_bytes_table(rows: Sequence[Footprint] | None = None) -> str:
    """The README's table of whole-training bytes per parameter (parameters, gradients, optimizer state and
    master copy or compensation; the bounded scratch left out) of AdamW in :data:`TRAINING_CONFIGS`."""
    rows = rows if rows is not None else [measure("adamw", CONFIGS[c]) for c in TRAINING_CONFIGS]
    lines = ["| AdamW configuration | parameters | gradients | optimizer state | master copy or compensation | "
             "bytes per parameter | 1B parameters need |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for f in rows:
        lines.append(f"| `{f.config}`: {CONFIGS[f.config].description} | {_cell(f.params)} | {_cell(f.grads)} | "
                     f"{_cell(f.states)} | {_cell(f.master + f.kahan)} | **{_cell(f.held)}** | "
                     f"{f.held:.1f} GB |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(training_bytes_table() if sys.argv[1:] == ["training"] else memory_table())
