"""The low-bit row: 8-bit and 4-bit AdamW state beside torch's fused FP32 AdamW and the peers that have it.

One AdamW over one tensor of 16M elements (``one-16m``; 1M with ``--quick``),
every candidate on its own copy of the same values and gradients, timed
round-robin in one process (:func:`~dml_optim.benchmark.timing.round_robin`):

* ``torch fused``: ``torch.optim.AdamW(fused=True)``, FP32 state (8 bytes per parameter);
* ``dml_optim 8-bit`` / ``dml_optim 4-bit``: ``dml_optim.AdamW(state_bits=...)``, the backend
  ``auto`` picks (recorded), in the codebook new states use (``quant.active_codebook()``);
* ``dml_optim 8-bit blockwise-1`` / ``blockwise-2``: the same with its states made in that earlier codebook
  (the first: dynamic exponent; the second: asinh and power codes, table gathers in the compiled kernel), side
  by side in the same rounds with the third (``dml_optim 8-bit``: fourth-root codes);
* ``bitsandbytes AdamW8bit``, ``torchao AdamW8bit``, ``torchao AdamW4bit``: where the package is
  installed (the ``peers`` extra: ``pip install ".[peers]"``), else the row says "not installed".

Each row has ``ms_per_step`` (the median), ``ms_min``/``ms_max`` (the fastest and the slowest sample),
``round_ms`` (each round's sample), ``ratio_to_fused`` (torch fused's time over the candidate's, round by
round: :func:`~dml_optim.benchmark.timing.rows_ratio`; above 1 is faster) with ``ratio_spread`` (its
quartiles over rounds) and ``state_bytes_per_param``: the optimizer state's bytes (codes, scales, and any
full-precision state) per parameter, read from the optimizer's own tensors.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable

import torch

from dml_optim.benchmark.common import error_text
from dml_optim.benchmark.timing import round_robin, rows_ratio, wall_seconds

__all__ = ["CANDIDATES", "measure_lowbit", "NUMEL", "QUICK_NUMEL"]

NUMEL = 1 << 24
QUICK_NUMEL = 1 << 20
CANDIDATES = ("torch fused", "dml_optim 8-bit", "dml_optim 4-bit", "dml_optim 8-bit blockwise-1",
              "dml_optim 8-bit blockwise-2", "bitsandbytes AdamW8bit", "torchao AdamW8bit", "torchao AdamW4bit")
_PACKAGE = {"bitsandbytes AdamW8bit": "bitsandbytes", "torchao AdamW8bit": "torchao", "torchao AdamW4bit": "torchao"}
_HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def _build(name: str, params: list[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    if name == "torch fused":
        return torch.optim.AdamW(params, fused=True, **_HYPER)
    if name.startswith("dml_optim"):
        import dml_optim

        return dml_optim.AdamW(params, state_bits=int(name.split()[1].split("-")[0]), **_HYPER)
    if name == "bitsandbytes AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **_HYPER)
    from torchao.optim import AdamW4bit, AdamW8bit

    return (AdamW8bit if name.endswith("8bit") else AdamW4bit)(params, **_HYPER)


@contextlib.contextmanager
def _codebook(name: str):
    """New states in the codebook a candidate names (``... blockwise-N``), else the active one."""
    from dml_optim.core import quant

    book = f"dml-optim-{name.split()[-1]}" if "blockwise" in name else quant.active_codebook()
    with quant.use_codebook(book):
        yield


def _unavailable(name: str, device: torch.device) -> str | None:
    package = _PACKAGE.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"not installed (pip install {package}, or the peers extra)"
    if name.startswith("dml_optim"):
        return None
    if name == "torch fused" and device.type not in ("cpu", "cuda"):
        return f"torch has no fused AdamW on {device.type}"
    return None


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (torchao's quantized states)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The optimizer state's bytes (step counters left out): ours from the flat buffers, the others from
    ``opt.state``."""
    if hasattr(opt, "flat_buffers"):
        from dml_optim.core.quant import tensors_of

        return sum(t.numel() * t.element_size() for i in opt.flat_buffers() for s in i.states.values()
                   for t in tensors_of(s))
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _tensor_bytes(value)
    return total


def measure_lowbit(device: torch.device, dtype: torch.dtype, settings: dict, log: Callable[[str], None],
                   quick: bool = False) -> dict[str, Any]:
    """The low-bit row: ``{"workload", "numel", "rows": [...]}`` (n/a candidates with the reason)."""
    from dml_optim.backends.choose import resolve

    numel = QUICK_NUMEL if quick else NUMEL
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(numel, generator=gen) * 0.02).to(device=device, dtype=dtype)
    grad = (torch.randn(numel, generator=gen) * 1e-3).to(device=device, dtype=dtype)
    rows, steps, first = {}, {}, {}
    opts = {}
    for name in CANDIDATES:
        row = {"candidate": name, "available": False, "reason": _unavailable(name, device), "ms_per_step": None,
               "ratio_to_fused": None, "ratio_spread": None, "state_bytes_per_param": None, "first_step_ms": None,
               "backend": None}
        rows[name] = row
        if row["reason"] is not None:
            log(f"  low-bit {name:24} n/a ({row['reason']})")
            continue
        try:
            p = torch.nn.Parameter(values.clone())
            p.grad = grad.clone()
            opt = _build(name, [p], device)
            with _codebook(name):  # (states are made at the first step)
                first[name] = wall_seconds(opt.step, device, probe=p)
            opts[name] = opt
            steps[name] = opt.step
            row["available"] = True
            if name.startswith("dml_optim"):
                row["backend"] = resolve("auto", device, numel, quantized=True)
        except Exception as exc:  # a peer that does not run here (no kernel for this device, ...): recorded
            row["reason"] = error_text(exc)
            log(f"  low-bit {name:24} n/a ({row['reason']})")
    timed = round_robin(steps, lambda fn, inner: wall_seconds(fn, device, inner), settings, first)
    for name, opt in opts.items():
        row = rows[name]
        row.update(ms_per_step=timed[name]["seconds"] * 1e3, first_step_ms=first[name] * 1e3,
                   ms_min=timed[name]["min_seconds"] * 1e3, ms_max=timed[name]["max_seconds"] * 1e3,
                   round_ms=[s * 1e3 for s in timed[name]["round_seconds"]],
                   state_bytes_per_param=state_bytes(opt) / numel, samples=timed[name]["samples"])
    fused = rows["torch fused"]
    for row in rows.values():
        if row["ms_per_step"] is not None and fused["ms_per_step"] is not None:
            row["ratio_to_fused"], row["ratio_spread"] = rows_ratio(fused, row)
    for row in rows.values():
        if row["available"]:
            log(f"  low-bit {row['candidate']:24} {row['ms_per_step']:9.2f} ms  {row['state_bytes_per_param']:.3g} "
                "bytes of state per parameter")
    return {"optimizer": "adamw", "workload": f"one-{numel >> 20}m", "numel": numel, "rows": list(rows.values())}
