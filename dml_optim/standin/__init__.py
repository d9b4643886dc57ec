"""A stand-in DirectML device for Linux and CI.

``torch-directml`` loads only on Windows and WSL; elsewhere ``import torch_directml``
fails (``OSError: libd3d12.so``).  This subpackage builds a small C++ extension
(``standin.cpp``, compiled with :func:`torch.utils.cpp_extension.load` on first use)
that registers the PrivateUse1 backend so that ``torch.device("privateuseone:0")``
tensors behave like torch-directml 0.2.5's, computing on the CPU:

* **No storage.**  Each tensor is an ATen ``OpaqueTensorImpl`` whose handle is a CPU
  tensor, as in torch-directml: ``t.data_ptr()`` raises ``RuntimeError: Cannot access
  data pointer of Tensor that doesn't have storage``, ``t.untyped_storage()`` raises
  ``NotImplementedError: Cannot access storage of OpaqueTensorImpl`` and
  ``torch._C._has_storage(t)`` is False; sizes, strides, ``storage_offset()`` and
  ``_version`` answer.  Views (``view``, slicing, ``as_strided``...) share memory.
* **The recorded dispatch table** (``dml_optim/data/torch-directml-dispatch.tsv``)
  decides what happens to each operator that reaches the stand-in's CPU fallback.
  One the real plugin runs through *its* CPU fallback (``fallback...``) is counted
  (:func:`fallbacks`), warned about once with the plugin's wording (``The operator
  'aten::X' is not currently supported on the DML backend and will fall back to run
  on the CPU. This may have performance implications.``, naming the op the plugin's
  fallback sees: for ``lerp_.Scalar`` that is ``aten::lerp.Scalar_out``, its
  ``fallback via`` entry) and refused under ``strict=True``.  Ops the table marks
  ``native``, ``structured`` or ``composite`` run silently.  An op absent from the
  table (newer torch versions have ops 2.4.1 had not) is *unknown*: counted apart
  (:func:`unknown`), warned about once with the stand-in's own wording and otherwise
  treated as a fallback (refused under ``strict=True``).
* **float64**: ``configure(float64=False)`` models the DirectML GPUs without FP64
  (Intel integrated, Arc): creating or copying a float64 tensor on the device, or
  an op receiving a float64 device tensor, raises ``RuntimeError: The GPU device
  does not support Double (Float64) operations!``.  A CPU float64 0-dim tensor (a
  Python float wrapped by torch) is refused by the ops the plugin runs with kernels
  of its own (``1.0 - x``: the plugin's ``rsub.Scalar`` wraps the float and runs
  ``rsub.Tensor``, which the stand-in reproduces: refused) but accepted
  by the structured ops whose ``.out`` kernel is native (``1.0 + x``: ``add.Tensor``
  "native via aten::add.out") and by fallback ops (they run on the CPU).
* **bfloat16** is always refused (``RuntimeError: Invalid or unsupported data type
  BFloat16 ...``): the real plugin ends the process there.
* **Random numbers** come from a device generator (``torch.Generator("privateuseone")``
  works, ``torch.manual_seed`` seeds the device's default one); its state is a CPU
  generator's, so a seed gives the same numbers as the CPU, but the device's stream
  is separate from the CPU's.  ``configure(generator=False)`` reproduces plugins
  before 0.2.5: ``torch.Generator("privateuseone")`` raises ``RuntimeError: Device
  type PRIVATEUSEONE is not supported for torch.Generator() api.`` (random ops
  still draw from the device's default generator).
* **Mixed devices**: an op the plugin has a kernel for refuses a non-0-dim CPU
  tensor argument next to device tensors (``Expected all tensors to be on the same
  device ...``), as torch's own backends do; fallback ops and ``Tensor?[]`` index
  lists accept CPU tensors.

Usage::

    from dml_optim import standin
    ok, why = standin.available(load=True)   # never raises
    dev = standin.device()                   # privateuseone:0; builds on first use
    with standin.configured(float64=False):
        ...
    standin.fallbacks()                      # {"aten::lerp.Scalar_out": 3, ...}

Importing this module compiles and registers nothing.  ``python -m dml_optim.standin``
builds ahead of time (CI).  The build goes to ``$DML_OPTIM_STANDIN_CACHE`` (default
``~/.cache/dml_optim/standin``) ``/<torch version>-<hash of the sources>``, under a
file lock, so it is redone only when torch or the sources change; a build found there
loads without a compiler or ninja (a CI test job after its build step).

Loading the stand-in changes the whole process, for good: it registers the
PrivateUse1 backend, a ``torch.privateuseone`` device module and PrivateUse1 hooks.
On torch with ``torch.accelerator`` (2.6+) it also renames the backend to its own
name, ``privateuseone`` (the autograd engine refuses PrivateUse1 tensors until the
backend is "registered" that way), so ``torch.accelerator.is_available()`` turns True
and libraries that pick the accelerator (accelerate's ``PartialState().device``)
pick ``privateuseone``; on torch 2.9+ a do-nothing allocator (never "initialized",
so ``torch.accelerator.empty_cache()`` is a no-op) serves torch.accelerator's
memory functions.  It refuses to load next to another PrivateUse1 backend (a real
``torch_directml`` imported in the process).

Not modelled: DirectML's own numerics (results are the CPU's, bit for bit), its
memory limits, asynchronous execution, torch-directml's renamed
``torch_directml.device()`` helpers, and the ops torch-directml implements itself
where torch has a composite: those run torch's decomposition here, so the
counts and the float64 rule see the decomposed ops (``rsub.Scalar`` and the
convolution hooks are the exceptions, given kernels that do what the plugin does).

May import: dml.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

__all__ = ["Settings", "available", "loaded", "is_standin", "device", "fallbacks", "unknown", "reset", "configure",
           "configured", "settings", "cache_dir"]

_NAME = "dml_optim_standin"
_SOURCES = ("standin.cpp",)
_CFLAGS = ("-O1",)
_lock = threading.RLock()
_ext = None
_failure: str | None = None  # why building or loading failed in this process (not retried)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The stand-in's settings (see :func:`configure`)."""

    strict: bool = False  # a fallback op raises instead of warning
    float64: bool = True  # False: a GPU without FP64 (Intel integrated, Arc)
    generator: bool = True  # False: torch.Generator("privateuseone") raises, as before torch-directml 0.2.5


_settings = Settings()


def _source_paths() -> list[Path]:
    here = Path(__file__).resolve().parent
    return [here / name for name in _SOURCES]


def cache_dir() -> Path:
    """The build folder: ``$DML_OPTIM_STANDIN_CACHE`` (or ``~/.cache/dml_optim/standin``)
    ``/<torch version>-<hash>``, the hash of the sources, the flags and the Python version."""
    digest = hashlib.sha256()
    for path in _source_paths():
        digest.update(path.read_bytes())
    digest.update(repr((_CFLAGS, sys.version_info[:2], sys.platform)).encode())
    root = os.environ.get("DML_OPTIM_STANDIN_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "dml_optim" / "standin"
    return base / f"{torch.__version__}-{digest.hexdigest()[:16]}"


def _prerequisites() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} is not on PATH"
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except Exception as exc:  # noqa: BLE001 - a torch without cpp_extension
        return f"torch.utils.cpp_extension is unavailable: {type(exc).__name__}: {exc}"
    if not is_ninja_available():
        return "ninja is not installed (torch.utils.cpp_extension.load needs it: pip install ninja)"
    return None


def _foreign_backend() -> str | None:
    """Another PrivateUse1 backend in this process (only asked before the stand-in loads)."""
    if sys.modules.get("torch_directml") is not None:
        return "torch_directml is imported in this process and owns the PrivateUse1 backend"
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        return f"the PrivateUse1 backend was renamed to {name!r} by another extension in this process"
    try:
        taken = torch._C._dispatch_has_kernel_for_dispatch_key("aten::empty.memory_format", "PrivateUse1")
    except Exception:  # noqa: BLE001 - an older/newer torch without this query: assume free
        taken = False
    if taken or hasattr(torch, "privateuseone"):
        return "another extension has already registered a PrivateUse1 backend in this process"
    return None


def _first_error(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.lower().startswith("error building extension"):
            return line
    return lines[0] if lines else type(exc).__name__


def _table_entries() -> list[tuple[str, bool, str, bool]]:
    """``(op, is_fallback, name_the_plugin_warns_with, cpu_float64_scalar_ok)`` for every table row."""
    from dml_optim.dml.dispatch import dispatch_table

    table = dispatch_table()
    structured_out = {how.split(" via ", 1)[1].strip() for how in table.values() if how.startswith("native via ")}
    entries = []
    for op, how in table.items():
        fallback = how.startswith("fallback")
        warn_as = how.split(" via ", 1)[1].strip() if fallback and " via " in how else op
        f64_ok = fallback or how.startswith("native via ") or op in structured_out
        entries.append((op, fallback, warn_as, f64_ok))
    return entries


def _built_library() -> Path | None:
    """The extension already built in :func:`cache_dir` (the folder's name pins torch and the sources)."""
    path = cache_dir() / f"{_NAME}.so"
    return path if path.is_file() else None


def _import_built(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build():
    from torch.utils import cpp_extension

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _prerequisites() is not None and _built_library() is not None:
                return _import_built(_built_library())  # built before (CI's build step); no compiler needed
            return cpp_extension.load(name=_NAME, sources=[str(p) for p in _source_paths()],
                                      build_directory=str(folder), extra_cflags=list(_CFLAGS), verbose=False)
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _load():
    """Builds (first use) and loads the extension, registers the backend; raises RuntimeError."""
    global _ext, _failure
    with _lock:
        if _ext is not None:
            return _ext
        why = _failure or _foreign_backend() or (_prerequisites() if _built_library() is None else None)
        if why:
            raise RuntimeError(f"dml_optim.standin unavailable: {why}")
        try:
            ext = _build()
        except Exception as exc:  # noqa: BLE001 - compiler errors, ninja, import errors
            _failure = f"building the stand-in failed: {_first_error(exc)}"
            raise RuntimeError(f"dml_optim.standin unavailable: {_failure}") from exc
        try:
            ext._init(_table_entries())
            _apply(ext, _settings)
            from dml_optim.standin import _torch_module

            _torch_module._extension = ext
            torch._register_device_module("privateuseone", _torch_module)
            if hasattr(torch, "accelerator"):
                # newer torch (torch.accelerator, 2.6+) treats PrivateUse1 as the accelerator only once
                # the backend is "registered" by a rename (the autograd engine needs it): rename it to
                # its own name, which keeps the device type "privateuseone"
                torch.utils.rename_privateuse1_backend("privateuseone")
                if str(torch.device("privateuseone", 0)) != "privateuseone:0":
                    raise RuntimeError(f"renaming changed the device to {torch.device('privateuseone', 0)}")
        except Exception as exc:  # noqa: BLE001
            _failure = f"registering the stand-in failed: {type(exc).__name__}: {exc}"
            raise RuntimeError(f"dml_optim.standin unavailable: {_failure}") from exc
        _ext = ext
        return ext


def _apply(ext, s: Settings) -> None:
    ext._configure(bool(s.strict), bool(s.float64), bool(s.generator))


def available(load: bool = False) -> tuple[bool, str]:
    """``(True, how)`` when the stand-in is loaded, or (``load=False``) when it can be
    built and loaded here; ``(False, why)`` otherwise: no C++ compiler or ninja, a
    failed build (its first error line), another PrivateUse1 backend in this process.
    ``load=True`` builds and loads it to be sure.  Never raises."""
    try:
        if _ext is not None:
            return True, f"loaded (built in {cache_dir()})"
        if load:
            _load()
            return True, f"loaded (built in {cache_dir()})"
        why = _failure or _foreign_backend() or (_prerequisites() if _built_library() is None else None)
        if why:
            return False, why
        if _built_library() is not None:
            return True, f"built in {cache_dir()}, not loaded yet"
        return True, f"can be built and loaded (build folder {cache_dir()})"
    except RuntimeError as exc:
        return False, str(exc).removeprefix("dml_optim.standin unavailable: ")
    except Exception as exc:  # noqa: BLE001 - never raises
        return False, f"{type(exc).__name__}: {exc}"


def loaded() -> bool:
    """The stand-in is loaded in this process (it owns the PrivateUse1 backend)."""
    return _ext is not None


def is_standin(device) -> bool:
    """``device`` (a ``torch.device`` or a string) is the stand-in's: a ``privateuseone`` device while it is
    loaded."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    return kind == "privateuseone" and _ext is not None


def device() -> torch.device:
    """``torch.device("privateuseone:0")``, building and loading the stand-in on first use.

    Raises ``RuntimeError("dml_optim.standin unavailable: <reason>")`` when it cannot."""
    _load()
    return torch.device("privateuseone", 0)


def fallbacks() -> dict[str, int]:
    """The ops run through the CPU fallback that the recorded table marks ``fallback``,
    with their counts since the last :func:`reset` (``{"aten::lerp.Scalar_out": 2}``).

    The names are those of the ops that reached the stand-in's fallback.  For a
    structured op torch itself (2.4.1 and newer) forwards the functional and in-place
    forms to the ``.out`` kernel on PrivateUse1, so ``x.lerp_(y, 0.5)`` and
    ``torch.lerp(x, y, 0.5)`` both count as ``aten::lerp.Scalar_out``, the name the
    real plugin warns with; an op the table lists as ``fallback via aten::X`` that
    reaches the fallback under its own name is counted under that name."""
    return dict(_ext._counts()[0]) if _ext is not None else {}


def unknown() -> dict[str, int]:
    """The ops run through the CPU fallback that are absent from the recorded table, with counts."""
    return dict(_ext._counts()[1]) if _ext is not None else {}


def reset() -> None:
    """Clears the counts and the set of ops already warned about (the next call of each warns again)."""
    if _ext is not None:
        _ext._reset()


def settings() -> Settings:
    """The current settings."""
    return _settings


def configure(*, strict: bool | None = None, float64: bool | None = None, generator: bool | None = None) -> Settings:
    """Changes the settings given (None leaves one as is); returns the previous :class:`Settings`.

    ``strict``: a fallback (or unknown) op raises instead of warning.  ``float64``:
    False refuses float64 on the device like a GPU without FP64.  ``generator``:
    False makes ``torch.Generator("privateuseone")`` raise, as before torch-directml
    0.2.5.  Restore with ``configure(**dataclasses.asdict(previous))`` or use
    :func:`configured`.  Does not build or load the stand-in."""
    global _settings
    with _lock:
        previous = _settings
        changes = {k: bool(v) for k, v in (("strict", strict), ("float64", float64), ("generator", generator))
                   if v is not None}
        _settings = dataclasses.replace(previous, **changes)
        if _ext is not None:
            _apply(_ext, _settings)
        return previous


@contextlib.contextmanager
def configured(*, strict: bool | None = None, float64: bool | None = None, generator: bool | None = None):
    """``with configured(strict=True): ...`` — :func:`configure` for the block, restored after."""
    previous = configure(strict=strict, float64=float64, generator=generator)
    try:
        yield _settings
    finally:
        configure(**dataclasses.asdict(previous))
