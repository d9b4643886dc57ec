"""Device detection never raises: every failure mode of docs/design.md §4, injected.

A fake ``torch_directml`` is put in ``sys.modules`` (or its import made to
fail with a ``sys.meta_path`` finder) with ``monkeypatch``, so these tests
do not depend on what is installed on the machine.  ``available()`` first
probes an un-imported plugin in a child interpreter (the real plugin can
segfault); in-process injections turn that probe off, and the probe itself is
tested with fake ``torch_directml`` packages written to disk.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import textwrap
import types

import pytest
import torch

import dml_optim
from dml_optim.cli import main
from dml_optim import dml  # dml.available, dml.backend_status (dml.device is the function)

DEVICE_MODULE = sys.modules["dml_optim.dml.device"]


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    """No cached probe result leaks between tests; sys.modules['torch_directml'] is restored."""
    monkeypatch.setitem(sys.modules, "torch_directml", None)  # records the original state for undo
    monkeypatch.delitem(sys.modules, "torch_directml")
    DEVICE_MODULE.probe_subprocess.cache_clear()
    yield
    DEVICE_MODULE.probe_subprocess.cache_clear()


class _FailingLoader(importlib.abc.Loader):
    def __init__(self, exc: BaseException):
        self.exc = exc

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.exc


class _FailingFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_directml`` and fails while executing it, like the real wheel on plain Linux."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def find_spec(self, name, path=None, target=None):
        if name == "torch_directml":
            return importlib.machinery.ModuleSpec(name, _FailingLoader(self.exc))
        return None


def _fake(count=1, count_exc=None, device_exc=None):
    mod = types.ModuleType("torch_directml")

    def device_count():
        if count_exc is not None:
            raise count_exc
        return count

    def device(index=0):
        if device_exc is not None:
            raise device_exc
        return torch.device("cpu")  # stands in for privateuseone:0

    mod.device_count = device_count
    mod.device = device
    mod.device_name = lambda index=0: "Fake DirectML Adapter"
    return mod


def _not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", None)  # import raises ModuleNotFoundError


def _import_oserror(monkeypatch):
    monkeypatch.setattr(DEVICE_MODULE, "PROBE_IN_SUBPROCESS", False)  # the finder lives in this process
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(OSError(
        "libd3d12.so: cannot open shared object file: No such file or directory"))] + sys.meta_path)


def _import_error_other(monkeypatch):
    monkeypatch.setattr(DEVICE_MODULE, "PROBE_IN_SUBPROCESS", False)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(ImportError(
        "cannot import name '_C' from partially initialized module"))] + sys.meta_path)


def _count_unknown_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", _fake(count_exc=RuntimeError(
        "Unknown error -2147467259\nException raised from device_count")))


def _zero_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", _fake(count=0))


def _device_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", _fake(device_exc=RuntimeError("adapter removed")))


#: (id, injector, words the reason must contain)
FAILURES = [
    ("not-installed", _not_installed, ["not installed"]),
    ("oserror-libd3d12", _import_oserror, ["OSError", "libd3d12.so"]),
    ("other-import-error", _import_error_other, ["ImportError", "partially initialized"]),
    ("device-count-unknown-error", _count_unknown_error, ["device_count", "RuntimeError", "Unknown error"]),
    ("zero-devices", _zero_devices, ["no DirectML device"]),
    ("device-raises", _device_raises, ["device()", "adapter removed"]),
]


@pytest.mark.parametrize("inject,words", [pytest.param(f, w, id=i) for i, f, w in FAILURES])
def test_available_reports_each_failure_without_raising(monkeypatch, inject, words):
    inject(monkeypatch)
    ok, reason = dml.available()
    assert ok is False
    for word in words:
        assert word in reason, reason
    assert "\n" not in reason  # one line, even for multi-line exception messages


@pytest.mark.parametrize("inject", [pytest.param(f, id=i) for i, f, _ in FAILURES])
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "no-cuda"])
def test_device_falls_back_to_cuda_then_cpu(monkeypatch, inject, cuda):
    inject(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert dml_optim.device() == torch.device("cuda" if cuda else "cpu")


def test_success_path_returns_the_directml_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", _fake(count=2))
    ok, reason = dml.available()
    assert ok is True
    assert "2 DirectML device(s)" in reason and "Fake DirectML Adapter" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # DirectML wins over CUDA
    assert dml_optim.device() == torch.device("cpu")  # what the fake's device() returns


def test_backend_status_lists_every_backend(monkeypatch):
    _import_oserror(monkeypatch)
    status = {name: (ok, why) for name, ok, why in dml.backend_status()}
    assert set(status) >= {"directml", "cuda", "cpu"}
    assert status["directml"][0] is False and "libd3d12.so" in status["directml"][1]
    assert status["cpu"][0] is True


def test_info_prints_torch_version_and_each_backend_with_reason(monkeypatch, capsys):
    _count_unknown_error(monkeypatch)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "unavailable" in lines["directml"] and "Unknown error" in lines["directml"]
    assert "cuda" in lines and "cpu" in lines
    assert "device: cpu" in out or "device: cuda" in out


def test_info_json(monkeypatch, capsys):
    _not_installed(monkeypatch)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    backends = {b["backend"]: b for b in info["backends"]}
    assert backends["directml"]["usable"] is False
    assert "not installed" in backends["directml"]["reason"]
    assert all(b["reason"] for b in info["backends"])
    assert info["device"] in ("cpu", "cuda")


def test_info_success_path_names_the_device(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_directml", _fake(count=1))
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    backends = {b["backend"]: b for b in info["backends"]}
    assert backends["directml"]["usable"] is True and "Fake DirectML Adapter" in backends["directml"]["reason"]


# --------------------------------------------------------------------------
# the child-interpreter probe, with fake packages on disk
# --------------------------------------------------------------------------

ON_DISK = {
    "oserror-at-import": (
        "raise OSError('libd3d12.so: cannot open shared object file: No such file or directory')\n",
        ["import torch_directml failed", "OSError", "libd3d12.so"],
    ),
    "device-count-unknown-error": (
        "def device_count():\n    raise RuntimeError('Unknown error \\x07\\x01garbage')\n",
        ["device_count() failed", "RuntimeError", "Unknown error"],
    ),
    "segfault-in-device-count": (
        "import os, resource, signal\n"
        "def device_count():\n"
        "    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n",
        ["crashed", "SIGSEGV"],
    ),
    "zero-devices": ("def device_count():\n    return 0\n", ["no DirectML device"]),
}


def _package(tmp_path, monkeypatch, source: str) -> None:
    pkg = tmp_path / "torch_directml"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(DEVICE_MODULE, "PROBE_IN_SUBPROCESS", True)


@pytest.mark.parametrize("source,words", [pytest.param(*v, id=k) for k, v in ON_DISK.items()])
def test_probe_in_child_interpreter_reports_failures(tmp_path, monkeypatch, source, words):
    _package(tmp_path, monkeypatch, source)
    ok, reason = dml.available()
    assert ok is False
    for word in words:
        assert word in reason, reason
    assert "torch_directml" not in sys.modules or sys.modules["torch_directml"] is None  # never imported here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dml_optim.device() == torch.device("cpu")


def test_probe_success_imports_the_plugin_and_uses_its_device(tmp_path, monkeypatch):
    _package(tmp_path, monkeypatch, """
        def device_count():
            return 1
        def device(index=0):
            return "cpu"  # stands in for privateuseone:0
        def device_name(index=0):
            return "Fake On-Disk Adapter"
    """)
    ok, reason = dml.available()
    assert ok is True and "Fake On-Disk Adapter" in reason
    assert dml_optim.device() == torch.device("cpu")
