"""Finding a usable DirectML device, and the fallback order DirectML → CUDA → CPU.

On plain Linux the torch-directml wheel (built for WSL) fails in stages:
``import torch_directml`` raises ``OSError: libd3d12.so: cannot open shared
object file``; with the package folder on ``LD_LIBRARY_PATH`` it imports, and
``device_count()`` raises ``RuntimeError: Unknown error <garbage>`` -- or, as
measured here with torch-directml 0.2.5.dev240914 on torch 2.4.1, crashes the
interpreter with a segmentation fault in about two runs out of three.

A crash cannot be caught, so unless the plugin is already imported, the first
check runs in a child interpreter (once per process, cached): import, count,
name.  Only when that child succeeds is the plugin imported here.  Every
failure -- not installed, import error, exception, crash, timeout, no device --
is reported as ``(False, reason)``; nothing here raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
from functools import lru_cache
from typing import Any

import torch

__all__ = ["available", "device", "fallback_device", "backend_status", "install_hint", "probe_subprocess", "PROBE_IN_SUBPROCESS", "PROBE_TIMEOUT_S"]

#: Probe torch-directml in a child interpreter before importing it here.
PROBE_IN_SUBPROCESS = True
#: Seconds the child probe may take (it imports torch).
PROBE_TIMEOUT_S = 120

_PROBE = r"""
import json, sys
def out(**kw):
    print(json.dumps(kw)); sys.stdout.flush(); sys.exit(0)
def first(exc):
    lines = str(exc).strip().splitlines()
    return (type(exc).__name__ + ": " + (lines[0] if lines else "")).rstrip(": ")
try:
    import torch_directml
except Exception as exc:
    out(ok=False, reason="import torch_directml failed: " + first(exc))
try:
    count = int(torch_directml.device_count())
except Exception as exc:
    out(ok=False, reason="torch_directml.device_count() failed: " + first(exc))
if count < 1:
    out(ok=False, reason="torch_directml found no DirectML device")
try:
    dev = torch_directml.device()
    name = torch_directml.device_name(0)
except Exception as exc:
    out(ok=False, reason="torch_directml.device() failed: " + first(exc))
out(ok=True, reason="%d DirectML device(s); default %s (%s)" % (count, dev, name))
"""


def install_hint() -> str:
    """What to do about a missing torch-directml on this platform (hint text only; it probes nothing).

    The plugin has wheels for x86_64 CPython 3.8-3.12 on Windows and on WSL
    (Linux whose kernel release names Microsoft) and works nowhere else, so
    only there does the hint suggest installing it; the ``directml`` extra's
    environment marker (pyproject.toml) makes the same choice.
    """
    system = platform.system()
    if system != "Windows" and not (system == "Linux" and "microsoft" in platform.release().lower()):
        return "DirectML runs only on Windows and WSL"
    if platform.machine().lower() not in ("amd64", "x86_64"):
        return f"torch-directml has no wheels for {platform.machine()}; it needs x86_64"
    if tuple(int(v) for v in platform.python_version_tuple()[:2]) >= (3, 13):
        return f"torch-directml has no wheels for Python {platform.python_version()}; it needs 3.8 to 3.12"
    return 'pip install "dml-optim[directml]"'


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@lru_cache(maxsize=1)
def probe_subprocess() -> tuple[bool, str]:
    """Run the DirectML probe in a child interpreter; never raises.  Cached per process (``probe_subprocess.cache_clear()``
    forgets the result: a test that installs a fake plugin)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True,
            timeout=PROBE_TIMEOUT_S, env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired:
        return False, f"the torch_directml probe did not finish within {PROBE_TIMEOUT_S} s"
    except Exception as exc:
        return False, f"could not run the torch_directml probe: {_first_line(exc)}"
    if done.returncode < 0:
        return False, (
            f"torch_directml crashed the probe process ({_signal_name(done.returncode)}); "
            "its native library cannot initialise DirectML here"
        )
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
        return bool(result["ok"]), str(result["reason"])
    except Exception:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"the torch_directml probe failed (exit {done.returncode}): {detail}"


def _load() -> tuple[Any, str]:
    """``(torch_directml module or None, reason)``, imported in this process."""
    try:
        module = importlib.import_module("torch_directml")
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_directml":
            return None, f"torch-directml is not installed ({install_hint()})"
        return None, f"import torch_directml failed: {_first_line(exc)}"
    except Exception as exc:  # OSError: libd3d12.so missing, and anything else
        return None, f"import torch_directml failed: {_first_line(exc)}"
    return module, ""


def _check_in_process(module) -> tuple[bool, str]:
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


def available() -> tuple[bool, str]:
    """``(True, description)`` when a DirectML device is usable, else ``(False, reason)``.

    Never raises, never crashes the interpreter (see the module docstring).
    """
    module = sys.modules.get("torch_directml")
    if module is None:
        try:
            installed = importlib.util.find_spec("torch_directml") is not None
        except Exception as exc:  # a broken finder or package metadata
            return False, f"looking for torch_directml failed: {_first_line(exc)}"
        if not installed:
            return False, f"torch-directml is not installed ({install_hint()})"
        if PROBE_IN_SUBPROCESS:
            ok, reason = probe_subprocess()
            if not ok:
                return False, reason
        module, reason = _load()
        if module is None:
            return False, reason
    return _check_in_process(module)


def device() -> torch.device:
    """The best usable device: DirectML, else CUDA, else CPU.  Never raises."""
    ok, _ = available()
    if ok:
        try:
            return torch.device(sys.modules["torch_directml"].device())
        except Exception:
            pass
    return fallback_device()


def fallback_device() -> torch.device:
    """The device when DirectML is not usable: CUDA, else CPU.  Never raises."""
    try:
        if torch.cuda.is_available():
            return torch.device("cuda")
    except Exception:
        pass
    return torch.device("cpu")


def backend_status() -> list[tuple[str, bool, str]]:
    """``[(backend, usable, reason), ...]`` for directml, cuda, mps and cpu."""
    out = [("directml", *available())]
    try:
        cuda = torch.cuda.is_available()
        if cuda:
            reason = f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"
        elif torch.version.cuda is None:
            reason = "this torch build has no CUDA support"
        else:
            reason = "torch.cuda.is_available() is False (no driver or no GPU)"
    except Exception as exc:
        cuda, reason = False, _first_line(exc)
    out.append(("cuda", cuda, reason))
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps and mps.is_available())
    out.append(("mps", mps_ok, "available" if mps_ok else "not available on this machine"))
    out.append(("cpu", True, f"{torch.get_num_threads()} threads"))
    return out
