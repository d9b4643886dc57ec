"""The device dml_optim's commands and :func:`dml_optim.device` pick: DirectML, else CUDA, else the CPU; the
stand-in DirectML device when ``DML_OPTIM_STANDIN=1`` asks for it.

:func:`dml_optim.dml.device.device` finds a real DirectML device (torch-directml) and falls back to CUDA, then
the CPU.  On Linux and in CI there is no DirectML; there :mod:`dml_optim.standin` gives a device with
DirectML's semantics (no storage, the plugin's CPU fallbacks counted, no bfloat16), and this module lets the
environment choose it for a whole run, without changing a script:

* ``DML_OPTIM_STANDIN=1`` (any value but empty and ``0``): :func:`device` is the stand-in (built on first use),
  ``dml-optim train`` trains on it, ``dml-optim info`` lists it.  Where it cannot load (no C++ compiler, a real
  torch-directml imported in the process) a warning says why, once, and the usual choice follows.

May import: any layer (a loose module at the package's top).
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["STANDIN_VARIABLE", "DEVICES", "standin_requested", "directml", "device", "resolve", "backend_status",
           "fallback_counter"]

#: The device names ``dml-optim train --device`` takes (``auto``: :func:`device`).
DEVICES = ("auto", "cpu", "cuda", "privateuseone")

#: The environment variable that asks for the stand-in DirectML device.
STANDIN_VARIABLE = "DML_OPTIM_STANDIN"
_WARNED: list[str] = []


def standin_requested() -> bool:
    """``DML_OPTIM_STANDIN`` asks for the stand-in (set to anything but empty or ``0``)."""
    return os.environ.get(STANDIN_VARIABLE, "").strip() not in ("", "0")


def directml() -> tuple[bool, str, torch.device | None]:
    """``(usable, description or reason, device)`` of the DirectML device a run uses: the stand-in when
    ``DML_OPTIM_STANDIN`` asks for it and it loads, else the real plugin's (:func:`dml_optim.dml.device.available`).
    Never raises."""
    from dml_optim.dml.device import available

    if standin_requested():
        from dml_optim import standin

        ok, why = standin.available(load=True)
        if ok:
            return True, f"the stand-in DirectML device, {STANDIN_VARIABLE}=1", standin.device()
        if why not in _WARNED:
            _WARNED.append(why)
            warnings.warn(f"{STANDIN_VARIABLE} is set but the stand-in DirectML device is unavailable: {why}; "
                          "choosing the device as without it", RuntimeWarning, stacklevel=3)
    ok, why = available()
    if not ok:
        return False, why, None
    import sys

    try:
        return True, why, torch.device(sys.modules["torch_directml"].device())
    except Exception as exc:  # pragma: no cover - the plugin answered the probe, then failed
        return False, f"torch_directml.device() failed: {type(exc).__name__}: {exc}", None


def device() -> torch.device:
    """The best usable device: DirectML (the stand-in under ``DML_OPTIM_STANDIN=1``), else CUDA, else CPU.
    Never raises."""
    from dml_optim.dml.device import fallback_device

    ok, _, found = directml()
    if ok and found is not None:
        return found
    return fallback_device()


def backend_status() -> list[tuple[str, bool, str]]:
    """``[(backend, usable, reason), ...]``: directml, the stand-in, cuda, mps and cpu
    (:func:`dml_optim.dml.device.backend_status`, with the stand-in's line after DirectML's)."""
    from dml_optim import standin
    from dml_optim.dml.device import backend_status as status

    rows = status()
    ok, why = standin.available(load=standin_requested())
    use = "used (DML_OPTIM_STANDIN=1)" if standin_requested() else f"set {STANDIN_VARIABLE}=1 to use it"
    line = ("standin", ok, f"{why}; {use}" if ok else why)
    return rows[:1] + [line] + rows[1:]


def resolve(name: str = "auto") -> torch.device:
    """The device for ``--device name``; ``ValueError`` naming the value and why it is unusable.

    ``auto`` is :func:`device` (DirectML, else CUDA, else CPU; the stand-in DirectML device under
    ``DML_OPTIM_STANDIN=1``); ``privateuseone`` is DirectML's (or the stand-in's) or an error.
    """
    if name == "auto":
        return device()
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch.cuda.is_available() is False"
            raise ValueError(f"device 'cuda' is not usable: {why}")
        return torch.device("cuda")
    if name == "privateuseone":
        ok, reason, found = directml()
        if not ok:
            raise ValueError(f"device 'privateuseone' (DirectML) is not usable: {reason}")
        return found
    raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")


def fallback_counter(on: torch.device):
    """On the stand-in DirectML device: its fallback counts reset now, and a function that reads them (the ops
    the dispatch table sends to the CPU, and those it does not know), so that a run reports what DirectML
    would have run on the CPU, forward and backward included; None on any other device."""
    from dml_optim import standin

    if not standin.is_standin(on):
        return None
    standin.reset()
    return lambda: {**standin.fallbacks(), **standin.unknown()}
