"""Finding a usable DirectML device, and the fallback order DirectML → CUDA → CPU.

On plain Linux the torch-directml wheel (built for WSL) fails in stages:
``import torch_directml`` raises ``OSError: libd3d12.so: cannot open shared
object file``; with the package folder on ``LD_LIBRARY_PATH`` it imports, and
``device_count()`` raises ``RuntimeError: Unknown error ...``.  Every one of
these (and a missing package, a device count of 0, a failing ``device()``) is
reported as "DirectML unavailable: <reason>", never raised.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["available", "device", "backend_status"]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _load() -> tuple[Any, str]:
    """``(torch_directml module or None, reason)``."""
    try:
        module = importlib.import_module("torch_directml")
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_directml":
            return None, "torch-directml is not installed (pip install dml-optim[directml])"
        return None, f"import torch_directml failed: {_first_line(exc)}"
    except Exception as exc:  # OSError: libd3d12.so missing, and anything else
        return None, f"import torch_directml failed: {_first_line(exc)}"
    return module, ""


def available() -> tuple[bool, str]:
    """``(True, description)`` when a DirectML device is usable, else ``(False, reason)``.

    Never raises.
    """
    module, reason = _load()
    if module is None:
        return False, reason
    try:
        count = int(module.device_count())
    except Exception as exc:
        return False, f"torch_directml.device_count() failed: {_first_line(exc)}"
    if count < 1:
        return False, "torch_directml found no DirectML device"
    try:
        dev = module.device()
        name = module.device_name(0) if hasattr(module, "device_name") else str(dev)
    except Exception as exc:
        return False, f"torch_directml.device() failed: {_first_line(exc)}"
    return True, f"{count} DirectML device(s); default {dev} ({name})"


def device() -> torch.device:
    """The best usable device: DirectML, else CUDA, else CPU.  Never raises."""
    ok, _ = available()
    if ok:
        try:
            return torch.device(_load()[0].device())
        except Exception:
            pass
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def backend_status() -> list[tuple[str, bool, str]]:
    """``[(backend, usable, reason), ...]`` for directml, cuda, mps and cpu."""
    out = [("directml", *available())]
    try:
        cuda = torch.cuda.is_available()
        reason = f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}" if cuda else "torch.cuda.is_available() is False"
        if not cuda and torch.version.cuda is None:
            reason = "this torch build has no CUDA support"
    except Exception as exc:
        cuda, reason = False, _first_line(exc)
    out.append(("cuda", cuda, reason))
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps and mps.is_available())
    out.append(("mps", mps_ok, "available" if mps_ok else "not available on this machine"))
    out.append(("cpu", True, f"{torch.get_num_threads()} threads"))
    return out
