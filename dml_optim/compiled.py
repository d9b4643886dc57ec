"""The ``compiled`` backend: an optimizer's rule fused into one kernel by ``torch.compile``.

The eager backend runs a rule (``adam_``, ``adagrad_``, ``momentum_`` of
:mod:`dml_optim.functional`) as a chain of about ten element-wise ops over a
flat buffer, each op reading and writing whole buffers.  Here the *same*
function (the optimizer's ``_rule``, no second copy of the math) is traced by
``torch.compile``; inductor fuses it into one loop that reads ``x``, ``g`` and
the states once and writes ``x`` and the states once (Adam in float32: 16
bytes read, 12 written per parameter, the minimum).

What makes it compile once and never again:

* **Per-step coefficients are 0-d tensors.**  Whatever varies with the step
  counter or the learning rate (``step_size``, ``rate``, ``lr``,
  ``grad_scale``: the keys of ``opt._coefficients``) is written into a 0-d
  tensor preallocated per flat buffer (``fill_``/``copy_``: no host sync, no
  allocation) and the compiled graph reads it at run time.  A scheduler that
  changes ``lr`` every step causes no recompilation.
* **Group constants are specialized.**  ``alpha``, ``beta``, ``epsilon``,
  ``norm_coefficient``, ``mode`` ... are Python numbers baked into the kernel
  (so ``norm_coefficient == 0`` costs nothing).  Changing one of them between
  steps recompiles once for the new value.
* **Buffer sizes**: the first call compiles for its length; a call with
  another length (a second param group, a chunk, a run of parameters) makes
  dynamo recompile once with a symbolic length, which then serves every
  size.  (``dynamic=True`` from the start would also turn the Python-float
  constants into run-time inputs, which costs a tensor per float per call.)
* **One compile cache per (rule, dtype, device type, gated)**, shared by all
  optimizers in the process.  Dynamo keeps compiled code and its recompile
  limit per *code object*, so each key gets a code object of its own
  (:func:`_fresh_code`): one optimizer's specializations never evict
  another's, and ``torch._dynamo.config`` is left untouched.
* **Scratch buffers are not used**: the compiled rule is called with
  ``scratch=None`` so intermediates live in registers instead of being
  written to memory.

If compilation is unavailable (:func:`compile_available`) or fails (at the
first call, when dynamo and inductor actually run), the optimizer falls back
to the eager rule with one :class:`CompileFallbackWarning` per optimizer, and
the failure is remembered for that cache key so other optimizers do not retry.

Cost: on a fresh machine inductor's first CPU compile probes the compiler's
vector ISA support (10-40 s on a 2-core VM, depending on load; cached on disk under
``/tmp/torchinductor_$USER`` afterwards); each rule then takes 0.2 to 5 s.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import types
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils import _python_dispatch

__all__ = [
    "CompileFallbackWarning",
    "CompiledRunner",
    "compile_available",
    "compiled_rule",
    "runner_for",
    "fall_back",
    "fell_back",
    "clear_cache",
    "cache_info",
]


class CompileFallbackWarning(RuntimeWarning):
    """``backend="compiled"`` (or ``"auto"``) could not compile; the eager rule runs instead."""


#: ``torch.compile``, looked up through this name so tests can inject a failure.
_torch_compile = torch.compile

_CACHE: dict[tuple, Callable[..., None]] = {}
#: Cache keys whose compilation failed, with the reason.
_BROKEN: dict[tuple, str] = {}


def _is_compiling() -> bool:
    """True while dynamo traces the caller (e.g. a user's compiled training step)."""
    check = getattr(torch.compiler, "is_compiling", None) or getattr(torch._dynamo, "is_compiling", None)
    return bool(check and check())


def _dispatch_mode_active() -> bool:
    """A ``TorchDispatchMode`` (op recorder, FLOP counter, FakeTensorMode, ...) is active.

    Then the eager rule runs, so the mode sees real ops.  Calling the
    compiled function under a mode would make dynamo skip its frame, and
    keep skipping it after the mode exits (the compiled path would silently
    run the uncompiled Python for good).
    """
    return _python_dispatch._get_current_dispatch_mode() is not None


def _dynamo_supported() -> tuple[bool, str]:
    try:
        import torch._dynamo.eval_frame as eval_frame
    except Exception as exc:  # pragma: no cover - broken installs
        return False, f"torch._dynamo cannot be imported ({type(exc).__name__}: {exc})"
    check = getattr(eval_frame, "check_if_dynamo_supported", None)
    if check is None:  # pragma: no cover - future torch
        return True, ""
    try:
        check()
    except Exception as exc:
        return False, f"torch.compile is not supported here ({exc})"
    return True, ""


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU, or None."""
    candidates = [os.environ.get("CXX")] if os.environ.get("CXX") else []
    candidates += ["cl"] if sys.platform == "win32" else ["g++", "clang++", "c++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


@functools.lru_cache(maxsize=None)
def compile_available(device_type: str) -> tuple[bool, str]:
    """``(available, reason)``: whether the compiled backend can run on ``device_type``.

    Cheap static checks only (the device type, dynamo's support for this
    Python, a C++ compiler for the CPU, triton for CUDA); a failure that only
    shows when inductor runs is caught at the first call instead.
    """
    if device_type not in ("cpu", "cuda"):
        return False, f"torch.compile is not used on '{device_type}' devices (the eager op chain is native there)"
    ok, reason = _dynamo_supported()
    if not ok:
        return False, reason
    if device_type == "cpu":
        if sys.platform == "win32" and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
            return False, f"inductor does not support Windows CPUs in torch {torch.__version__}"
        if _cxx_compiler() is None:
            return False, "no C++ compiler found for inductor (set CXX or install g++/clang++; cl on Windows)"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (inductor needs it for CUDA kernels)"
    return True, ""


def _call_rule(opt, rule, x, g, states, scalars, scratch):
    rule(opt, x, g, states, scalars, scratch)


def _fresh_code(key_name: str) -> Callable[..., None]:
    """A copy of :func:`_call_rule` with a code object of its own.

    Dynamo attaches its cache (and counts recompilations against the limit)
    per code object; a distinct one per cache key keeps the keys apart.
    """
    code = _call_rule.__code__
    name = f"_call_rule_{key_name}"
    replace = {"co_name": name}
    if sys.version_info >= (3, 11):
        replace["co_qualname"] = name
    return types.FunctionType(code.replace(**replace), _call_rule.__globals__, name)


def _key_name(key: tuple) -> str:
    rule, dtype, device_type, gated = key
    owner = getattr(rule, "__qualname__", getattr(rule, "__name__", "rule")).replace(".", "_")
    return f"{owner}_{str(dtype).replace('torch.', '')}_{device_type}{'_gated' if gated else ''}"


def compiled_rule(rule: Callable, dtype: torch.dtype, device_type: str, *, gated: bool = False) -> Callable[..., None]:
    """The compiled ``fn(opt, rule, x, g, states, scalars, scratch)`` for one cache key.

    ``rule`` is an optimizer class's ``_rule`` function; ``gated`` says whether
    the group constants arrive as 0-d tensors (the skip-on-overflow path).
    """
    key = (rule, dtype, device_type, gated)
    fn = _CACHE.get(key)
    if fn is None:
        fn = _torch_compile(_fresh_code(_key_name(key)))
        _CACHE[key] = fn
    return fn


def clear_cache() -> None:
    """Forget compiled callables and remembered failures (dynamo's own caches stay)."""
    _CACHE.clear()
    _BROKEN.clear()
    _RUNNERS.clear()
    compile_available.cache_clear()


def cache_info() -> dict[str, Any]:
    """``{"compiled": [key names], "failed": {key name: reason}}`` for diagnostics."""
    return {
        "compiled": [_key_name(k) for k in _CACHE],
        "failed": {_key_name(k): why for k, why in _BROKEN.items()},
    }


# --------------------------------------------------------------------------
# per-optimizer, per-buffer runners
# --------------------------------------------------------------------------

#: Optimizers that fell back to eager, with the reason (warned once each).
_FALLEN_BACK: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
#: One runner per flat buffer.
_RUNNERS: "weakref.WeakKeyDictionary[Any, CompiledRunner]" = weakref.WeakKeyDictionary()


def fall_back(opt, device, reason: str) -> None:
    """Record that ``opt`` runs eager from now on; warn the first time."""
    if opt in _FALLEN_BACK:
        return
    _FALLEN_BACK[opt] = reason
    warnings.warn(
        f"dml_optim: {type(opt).__name__} cannot use the compiled backend on {device}: {reason}; "
        "running the eager backend instead (same results, more memory traffic)",
        CompileFallbackWarning,
        stacklevel=4,
    )


def fell_back(opt) -> str | None:
    """The reason ``opt`` fell back to eager, or None."""
    return _FALLEN_BACK.get(opt)


def runner_for(opt, flat) -> "CompiledRunner":
    """The (cached) compiled runner of ``opt``'s rule over ``flat``."""
    runner = _RUNNERS.get(flat)
    if runner is None or runner.opt_ref() is not opt:
        runner = CompiledRunner(opt, flat.device)
        _RUNNERS[flat] = runner
    return runner


def _denormals_flushed() -> bool:
    """True when this thread flushes subnormal floats to zero (x86 FTZ/DAZ)."""
    return sys.float_info.min * 0.5 == 0.0


class CompiledRunner:
    """Calls the compiled rule; a ``Runner`` ``(x, g, states, scalars, scratch) -> None``.

    Coefficients (the keys of ``opt._coefficients``) are copied into 0-d
    tensors owned by the runner (one per name and dtype), so the compiled
    graph sees the same tensor metadata every step.
    """

    #: The fused kernel needs no scratch (the optimizer then keeps only a small one).
    uses_scratch = False

    def __init__(self, opt, device: torch.device):
        self.opt_ref = weakref.ref(opt)
        self.device = device
        self.rule = type(opt)._rule
        group = opt.param_groups[0]
        self.coefficient_names = frozenset(opt._coefficients(group, 1))
        self._slots: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _slot(self, name: str, dtype: torch.dtype, value) -> torch.Tensor:
        slot = self._slots.get((name, dtype))
        if slot is None:
            slot = torch.zeros((), dtype=dtype, device=self.device)
            self._slots[(name, dtype)] = slot
        if isinstance(value, torch.Tensor):
            slot.copy_(value)
        else:
            slot.fill_(value)
        return slot

    def __call__(self, x: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor],
                 scalars: dict[str, Any], scratch: Sequence[torch.Tensor]) -> None:
        opt = self.opt_ref()
        if opt is None or opt in _FALLEN_BACK or _is_compiling() or _dispatch_mode_active():
            self._eager(opt, x, g, states, scalars, scratch)
            return
        coef_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        args = {}
        gated = False
        for name, value in scalars.items():
            if name in self.coefficient_names:
                value = self._slot(name, coef_dtype, value)
            elif isinstance(value, torch.Tensor):
                gated = True
            args[name] = value
        key = (self.rule, x.dtype, self.device.type, gated)
        if key in _BROKEN:
            fall_back(opt, self.device, _BROKEN[key])
            self._eager(opt, x, g, states, scalars, scratch)
            return
        fn = compiled_rule(self.rule, x.dtype, self.device.type, gated=gated)
        flushed = _denormals_flushed()
        try:
            self._invoke(fn, opt, x, g, list(states), args, [None] * len(scratch))
            if not flushed and _denormals_flushed():
                # torch 2.4's inductor builds CPU kernels with -ffast-math; with gcc < 13 that
                # links crtfastmath.o, whose constructor turns on flush-to-zero for the loading
                # thread: the caller's floating-point semantics must not change behind its back
                torch.set_flush_denormal(False)
        except Exception as exc:  # compile errors surface at the first call
            reason = f"compilation failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
            _BROKEN[key] = reason
            fall_back(opt, self.device, reason)
            self._eager(opt, x, g, states, scalars, scratch)

    def _eager(self, opt, x, g, states, scalars, scratch) -> None:
        """The eager rule; a compiled buffer's scratch is one chunk, too small for it,
        so the rule then allocates its temporaries (correct, if not allocation free)."""
        if scratch and scratch[0] is not None and scratch[0].numel() < x.numel():
            scratch = [None] * len(scratch)
        self.rule(opt, x, g, states, scalars, scratch)

    def _invoke(self, fn, opt, x, g, states, args, scratch) -> None:
        """Run the compiled graph: one fused kernel (the op-counting hook of the benchmark)."""
        fn(opt, self.rule, x, g, states, args, scratch)
