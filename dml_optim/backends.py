"""Choosing how a rule runs over a flat buffer: ``eager`` or ``compiled``.

* ``eager``: the DirectML-native op chain of :mod:`dml_optim.functional`
  (about ten element-wise ops per step over the flat buffer).  Always used on
  DirectML (``privateuseone``), where every op is a native kernel and
  ``torch.compile`` has no backend.
* ``compiled`` (CPU, CUDA): the same rule fused into one kernel by
  ``torch.compile`` (:mod:`dml_optim.compiled`).  Falls back to eager with one
  :class:`~dml_optim.compiled.CompileFallbackWarning` per optimizer when
  compilation is unavailable or fails.
* ``auto``: eager on DirectML and for buffers below
  :data:`AUTO_COMPILE_MIN_ELEMENTS` elements (small models: a first compile
  costs seconds, which a small buffer never earns back); compiled for larger
  buffers on CPU and CUDA when compilation is available.

Threshold (measured with ``bench/run.py``, see ``bench/README.md``): on a
2-core CPU VM the fused kernel beats the eager chain from about 2M elements
on (Adam at 4M elements: 7.3 ms eager, 2.5 ms compiled; at 25.6M: 54 ms vs
17 ms), while a first compile costs seconds (3-26 s for the first rule of a
process, 10-40 s once per machine for inductor's ISA probe, well under 1 s
from inductor's disk cache).  At 4M elements (16 MB in float32: far above
``dml-optim train``'s model and the test suite's, far below resnet50's 25.6M
parameters) a step saves ~5 ms, so a compile pays for itself in about a
thousand steps; smaller buffers stay eager.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dml_optim import compiled as _compiled

__all__ = [
    "BACKEND_CHOICES",
    "AUTO_COMPILE_MIN_ELEMENTS",
    "resolve",
    "rule_runner",
    "resolved_backends",
]

BACKEND_CHOICES = ("auto", "eager", "compiled")

#: ``backend="auto"`` compiles a flat buffer from this many elements on (CPU and CUDA).
AUTO_COMPILE_MIN_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 22}

Runner = Callable[..., None]


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":", 1)[0]
    raise TypeError(f"device must be a torch.device or a string, got {device!r}")


def resolve(backend: str, device, numel: int) -> str:
    """The backend (``"eager"`` or ``"compiled"``) that runs a flat buffer.

    ``backend`` is the optimizer's option, ``device`` the buffer's device (a
    ``torch.device`` or a string such as ``"privateuseone:0"``), ``numel``
    its element count.  ``"compiled"`` resolves to ``"eager"`` where
    compilation is unavailable (DirectML, no C++ compiler, ...); the optimizer
    warns about that once (see :func:`rule_runner`).
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    if backend == "eager":
        return "eager"
    device_type = _device_type(device)
    if not _compiled.compile_available(device_type)[0]:
        return "eager"
    if backend == "compiled":
        return "compiled"
    threshold = AUTO_COMPILE_MIN_ELEMENTS.get(device_type)
    return "compiled" if threshold is not None and numel >= threshold else "eager"


def rule_runner(opt, group: dict[str, Any], flat) -> Runner:
    """A callable ``(x, g, states, scalars, scratch) -> None`` applying ``opt``'s rule to ``flat``.

    Eager: ``opt._rule`` itself.  Compiled: a cached
    :class:`~dml_optim.compiled.CompiledRunner` of the same rule.  An
    explicit ``backend="compiled"`` that cannot compile warns once per
    optimizer and returns the eager rule.
    """
    backend = group["backend"]
    if backend == "eager" or _compiled.fell_back(opt) is not None:
        return opt._rule
    if resolve(backend, flat.device, flat.numel) == "eager":
        if backend == "compiled":
            _compiled.fall_back(opt, flat.device, _compiled.compile_available(flat.device.type)[1])
        return opt._rule
    return _compiled.runner_for(opt, flat)


def resolved_backends(opt) -> list[list[str]]:
    """For each param group, the backend each of its flat buffers runs with now."""
    out = []
    for group, flats in zip(opt.param_groups, opt._flats):
        names = []
        for flat in flats:
            runner = rule_runner(opt, group, flat) if _compiled.fell_back(opt) is None else opt._rule
            names.append("compiled" if isinstance(runner, _compiled.CompiledRunner) else "eager")
        out.append(names)
    return out
