"""Choosing how a flat buffer's rule runs: ``eager``, ``compiled`` or ``fused``.

* ``eager``: the DirectML-native op chain of :mod:`dml_optim.core.functional`
  (about ten element-wise ops per step over the flat buffer).  Always used on
  DirectML (``privateuseone``), where every op is a native kernel and
  ``torch.compile`` has no backend.
* ``compiled`` (CPU, CUDA): the same step fused into one kernel by
  ``torch.compile`` (:mod:`dml_optim.backends.compiled`).  Falls back to eager with one
  :class:`~dml_optim.backends.compiled.CompileFallbackWarning` per optimizer when
  compilation is unavailable or fails.
* ``fused`` (CPU): torch's own fused CPU kernel of the same rule, called on
  the flat buffers (:mod:`dml_optim.backends.fused`).  Warns once and runs ``auto``'s
  choice where it cannot (another device, a precision mode, ...).
* ``auto``: eager on DirectML.  On the CPU, fused wherever it can run
  (:func:`fuses`): 1.0 to 3x faster than the compiled kernel called directly
  from 32k to 1M elements (AdamW, 2 threads: 14 vs 73 us at 32k, 0.24 vs 0.28
  ms at 1M), about as fast above, and nothing to compile.  Otherwise, on CPU
  and CUDA, compiled for buffers of
  :data:`AUTO_COMPILE_MIN_ELEMENTS` elements or more, where a first compile
  (seconds) is earned back quickly; a smaller CPU buffer (from
  :data:`AUTO_TIER_MIN_ELEMENTS`) starts eager and compiles once its eager
  steps have taken :data:`AUTO_COMPILE_AFTER_EAGER_S` in all (rent or buy:
  a short job never pays a compile, a long one loses at most about one
  compile's time on the slower path); quantized states and masked updates
  (parameters at several step counts) compile from thresholds of their own.

Measured on a 2-core CPU VM (AdamW, 8 tensors, 2 threads, torch 2.13): the
compiled step, called without its dynamo frame, beats the eager chain from
16k elements on (0.12 vs 0.20 ms at 16k, 0.53 vs 1.47 ms at 1M) and torch's
fused AdamW up to 1M elements (1.2 to 1.4x); a first compile takes about 5 s
with inductor's disk cache warm, 20 s cold.  On CUDA the eager chain's cost is
mostly kernel launches (about ten per step), which a fused kernel removes
whatever the size, so the threshold is lower.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dml_optim.backends import compiled as _compiled
from dml_optim.backends import fused as _fused
from dml_optim.core.options import BACKENDS

__all__ = ["AUTO_COMPILE_MIN_ELEMENTS", "AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED", "AUTO_COMPILE_MIN_ELEMENTS_MASKED",
           "AUTO_COMPILE_AFTER_EAGER_S", "AUTO_TIER_MIN_ELEMENTS", "resolve", "fuses", "tiers", "tier_due", "tiering_pending", "runner_for",
           "masked_runner", "compiles", "resolved_backend", "resolved_backends"]

#: ``backend="auto"`` compiles a flat buffer from this many elements on.
AUTO_COMPILE_MIN_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 20}
#: ... and a buffer of quantized states (``state_bits``) from this many: its eager chain is 40 to 50 ops per
#: state per chunk (decode, update, encode), which a fused kernel replaces at every size that pays a compile
#: (1M-element AdamW, 2 cores: 8-bit eager 37 ms per step on one thread, compiled a few ms)
AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED = {"cpu": 1 << 16, "cuda": 1 << 16}

#: ... and a smaller CPU buffer (from AUTO_TIER_MIN_ELEMENTS on) once its eager steps have taken this long in
#: all: the rent-or-buy rule.  A first compile costs about 5 s on a 2-core CPU with inductor's disk cache
#: warm (20 s cold), and the compiled step is 1.6 to 2.7x faster than the eager chain from 16k elements on
#: (AdamW, 2 threads: 0.12 vs 0.20 ms at 16k, 0.53 vs 1.47 ms at 1M); so a short job never pays a compile,
#: and a long one spends at most about one compile's time on the slower path.
AUTO_COMPILE_AFTER_EAGER_S = {"cpu": 5.0}
AUTO_TIER_MIN_ELEMENTS = {"cpu": 1 << 14}
#: ... and a masked update (parameters at several step counts, :func:`masked_runner`) from this many (CUDA, where
#: its per-element gathers are cheap: not measured on a GPU yet; the CPU steps such buffers one run at a time,
#: see ``optimizers.engine.MASKED_DEVICES``).
AUTO_COMPILE_MIN_ELEMENTS_MASKED = {"cuda": 1 << 16}

_RUNNERS: "weakref.WeakKeyDictionary[Any, _compiled.KernelRunner]" = weakref.WeakKeyDictionary()
#: Per buffer: (the settings token, dtype, device and bits it was decided for, why it cannot run fused or None).
_FUSABLE: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":", 1)[0]
    raise TypeError(f"device must be a torch.device or a string, got {device!r}")


def resolve(backend: str, device, numel: int, quantized: bool = False, eager_s: float = 0.0) -> str:
    """The backend (``"eager"`` or ``"compiled"``) that runs a flat buffer.

    ``backend`` is the optimizer's option, ``device`` the buffer's device (a
    ``torch.device`` or a string such as ``"privateuseone:0"``), ``numel``
    its element count, ``quantized`` whether it keeps quantized states,
    ``eager_s`` the wall time its eager steps took so far (the tiering of
    :data:`AUTO_COMPILE_AFTER_EAGER_S`).  ``"compiled"`` resolves to
    ``"eager"`` where compilation is unavailable (DirectML, no C++ compiler, ...).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "eager":
        return "eager"
    if backend == "fused":  # (a buffer the fused kernel cannot run: what auto runs)
        backend = "auto"
    device_type = _device_type(device)
    if not _compiled.compile_available(device_type)[0]:
        return "eager"
    if backend == "compiled":
        return "compiled"
    threshold = (AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED if quantized else AUTO_COMPILE_MIN_ELEMENTS).get(device_type)
    if threshold is not None and numel >= threshold:
        return "compiled"
    return "compiled" if tier_due(device_type, numel, quantized, eager_s) else "eager"


def fuses(opt, group: dict[str, Any], flat) -> bool:
    """Whether ``flat`` runs torch's fused kernel (:mod:`dml_optim.backends.fused`) under ``group``'s settings:
    ``backend`` is ``"fused"`` or ``"auto"`` and the buffer qualifies (``backend="fused"`` warns once where
    it does not).  Not while dynamo traces the step, nor under a dispatch mode other than the op counter
    (the audit records the op chain DirectML runs)."""
    backend = group["backend"]
    if backend != "auto" and backend != "fused":
        return False
    if _compiled._is_compiling() or (_compiled._dispatch_mode_active() and _compiled._counting_kernels() is None):
        return False
    token = (flat.settings, flat.dtype, flat.device, flat.bits)
    cached = _FUSABLE.get(flat)
    # (the settings token by identity, as everywhere: its values may be tensors, which == compares element-wise)
    if cached is None or flat.settings is None or cached[0][0] is not token[0] or cached[0][1:] != token[1:]:
        cached = (token, _fused.unsupported(opt, group, flat))
        if flat.settings is not None:
            _FUSABLE[flat] = cached
    if cached[1] is not None:
        if backend == "fused":
            _fused.warn_fallback(opt, cached[1])
        return False
    return True


def tiers(device_type: str, numel: int, quantized: bool) -> bool:
    """Whether ``auto`` counts the eager time of such a buffer, to compile it later (:func:`tier_due`)."""
    return not quantized and numel >= AUTO_TIER_MIN_ELEMENTS.get(device_type, 1 << 62)


def tier_due(device_type: str, numel: int, quantized: bool, eager_s: float) -> bool:
    """A buffer below the size threshold has run eagerly for as long as its first compile would take."""
    return tiers(device_type, numel, quantized) and eager_s >= AUTO_COMPILE_AFTER_EAGER_S[device_type]


def tiering_pending(opt) -> bool:
    """Some buffer of ``opt`` runs eagerly under ``auto`` now and will compile once it has run eagerly for
    :data:`AUTO_COMPILE_AFTER_EAGER_S` (a benchmark of the steady state steps it until this is False)."""
    return any(group["backend"] in ("auto", "fused") and tiers(flat.device.type, flat.numel, flat.bits is not None)
               and not tier_due(flat.device.type, flat.numel, flat.bits is not None, flat.eager_s)
               and resolved_backend(opt, group, flat) == "eager" and _compiled.compile_available(flat.device.type)[0]
               for gi, group in enumerate(opt.param_groups) for flat in opt._buffers_of(gi))


def runner_for(opt, group: dict[str, Any], flat) -> tuple[_compiled.KernelRunner | None, tuple | None]:
    """``(runner, key)``: the compiled runner of ``opt`` for ``flat`` and the kernel key of this step,
    or ``(None, None)`` when the buffer runs eager now.

    An explicit ``backend="compiled"`` that cannot compile here warns once per
    optimizer and runs eager.
    """
    backend = group["backend"]
    if backend == "eager" or _compiled.fell_back(opt) is not None:
        return None, None
    if _compiled._is_compiling() or (_compiled._dispatch_mode_active() and not _compiled._counting_kernels()):
        return None, None  # the eager rule, so a dispatch mode sees real ops (not a warning: meant to happen)
    runner = _RUNNERS.get(opt)
    if runner is None:
        runner = _RUNNERS[opt] = _compiled.KernelRunner(opt)
    if runner.resolved(group, flat) == "eager":
        if backend == "compiled":
            _compiled.fall_back(opt, flat.device, _compiled.compile_available(flat.device.type)[1])
        return None, None
    key = runner.key(group, flat)
    reason = _compiled._BROKEN.get(key)
    if reason is not None:  # another optimizer found this kernel broken: this one is told too, once
        _compiled.fall_back(opt, flat.device, reason)
        return None, None
    return runner, key


def masked_runner(opt, group: dict[str, Any], flat) -> _compiled.KernelRunner | None:
    """The compiled runner of ``opt`` for a masked update of ``flat`` (the engine's, for parameters at
    several step counts), or None when it runs eagerly.

    ``auto`` compiles it from :data:`AUTO_COMPILE_MIN_ELEMENTS_MASKED` elements on, below the
    threshold of a buffer's plain step: the eager masked update is about twice the ops of the plain
    rule (every varying scalar is a tensor), while one kernel reads the owner index and a table
    of a few values per parameter beside the operands.
    """
    backend = group["backend"]
    if backend == "eager" or _compiled.fell_back(opt) is not None:
        return None
    if _compiled._is_compiling() or (_compiled._dispatch_mode_active() and not _compiled._counting_kernels()):
        return None
    device_type = flat.device.type
    available, why = _compiled.compile_available(device_type)
    if not available:
        if backend == "compiled":
            _compiled.fall_back(opt, flat.device, why)
        return None
    if backend in ("auto", "fused") and flat.numel < AUTO_COMPILE_MIN_ELEMENTS_MASKED.get(device_type, 1 << 62):
        return None
    runner = _RUNNERS.get(opt)
    if runner is None:
        runner = _RUNNERS[opt] = _compiled.KernelRunner(opt)
    return runner


def compiles(opt, group: dict[str, Any], flat) -> bool:
    """Whether ``flat`` is a compiled buffer (its memory policy: no scratch), cheaply."""
    return (group["backend"] in ("auto", "compiled", "fused") and _compiled.fell_back(opt) is None
            and resolve(group["backend"], flat.device, flat.numel, flat.bits is not None, flat.eager_s) == "compiled")


def resolved_backend(opt, group: dict[str, Any], flat) -> str:
    """The backend ``flat`` runs with now (after any fallback; an invalid option: ``"eager"``,
    the next step refuses it).  ``"fused"`` is what its plain steps run: a step gated on a
    ``GradScaler``'s ``found_inf`` and one at a count beyond :data:`dml_optim.backends.fused.MAX_COUNT` (or whose
    kernel scalars leave the dtype's range) run the rule as :func:`resolve` decides, eager or compiled."""
    if group["backend"] in ("auto", "fused") and fuses(opt, group, flat):
        return "fused"
    if group["backend"] not in BACKENDS or group["backend"] == "eager" or _compiled.fell_back(opt) is not None:
        return "eager"
    if resolve(group["backend"], flat.device, flat.numel, flat.bits is not None, flat.eager_s) == "eager":
        return "eager"
    runner = _RUNNERS.get(opt) or _compiled.KernelRunner(opt)
    return "eager" if runner.key(group, flat) in _compiled._BROKEN else "compiled"


def resolved_backends(opt) -> list[list[str]]:
    """For each param group, the backend each of its flat buffers runs with now."""
    return [[resolved_backend(opt, group, flat) for flat in opt._buffers_of(gi)]
            for gi, group in enumerate(opt.param_groups)]
