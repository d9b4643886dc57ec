"""Where ``torch.compile`` can run, and how the compiled backend configures inductor.

:func:`compile_available` (cheap static checks, cached), the inductor options of a kernel
(:func:`_options`: precision casts emulated, dynamic OpenMP threads on the CPU), and the subnormal mode
a CPU kernel may change behind its caller's back (:func:`_denormals_flushed`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["compile_available", "start_thread_pool"]


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



def _options(device: str) -> dict[str, bool] | None:
    """Inductor options of a kernel for ``device`` (None: the defaults)."""
    options = {}
    # inductor keeps a fused kernel's intermediates in float32 and skips casts to float16/bfloat16
    # unless told to emulate them; Kahan summation reads back the rounded parameters, and every
    # low-precision store should round as the eager rule does
    if _emulates_casts():
        options["emulate_precision_casts"] = True
    # A CPU kernel decides at compile time whether to run its loop on OpenMP threads, from the
    # first call's length and torch.get_num_threads(); lengths are dynamic, so a kernel first
    # compiled for a small buffer (or one thread, or found so in inductor's disk cache) would run
    # every later buffer on one thread: resnet50's Momentum step took 27 ms instead of 18 on two
    # cores.  With dynamic threads the loop is always parallel and OpenMP sizes it at run time.
    if device.startswith("cpu") and _has_cpp_option("dynamic_threads"):
        options["cpp.dynamic_threads"] = True
    return options or None


def _has_option(name: str) -> bool:
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(config, name)


def _has_cpp_option(name: str) -> bool:
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(getattr(config, "cpp", None), name)


def _emulates_casts() -> bool:
    """Inductor can round intermediate low-precision casts (``emulate_precision_casts``, torch >= 2.5)."""
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(config, "emulate_precision_casts")



@functools.lru_cache(maxsize=None)
def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return counters  # (one object for the process; a reset clears it, it is not replaced)


def _frames_compiled() -> int:
    """Frames dynamo has compiled so far in this process (a new one: a compile or a recompile)."""
    return _dynamo_counters()["frames"]["total"]


def _denormals_flushed() -> bool:
    """True when this thread flushes subnormal floats to zero (x86 FTZ/DAZ)."""
    return sys.float_info.min * 0.5 == 0.0


#: The CPU's intra-op worker threads were started before any kernel module was loaded (:func:`start_thread_pool`).
_POOL_STARTED: list[bool] = []


def start_thread_pool() -> None:
    """Start torch's intra-op worker threads (one parallel op, once) before the first CPU kernel module loads: a
    module built with -ffast-math (torch 2.4's inductor, gcc < 13) turns flush-to-zero on in the loading thread,
    which the compiled backend's launch turns off again, but worker threads started while it is on inherit it and
    keep it (every parallel op of the caller's would then flush subnormals in some of its threads)."""
    if _POOL_STARTED:
        return
    _POOL_STARTED.append(True)
    with torch.no_grad(), _disable_current_modes():  # (not the step's work: no op counter sees it)
        torch.ones(1 << 20).add_(1)
