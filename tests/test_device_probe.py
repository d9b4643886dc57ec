"""DirectML detection through the child-process probe, with fake plugins.

Each fake ``torch_directml`` package is written to a temporary folder put on
both this interpreter's ``sys.path`` and the child's ``PYTHONPATH``, so the
real probe subprocess imports it.  The crash case reproduces what the real
torch-directml 0.2.5 does on Linux about two times in three (a segmentation
fault inside ``device_count()``), which no in-process ``try`` could catch.
"""

import importlib
import os
import sys
import textwrap

import pytest
import torch

# dml_optim.dml re-exports the function device(), which shadows the submodule's name
dml_device = importlib.import_module("dml_optim.dml.device")

FAKES = {
    "crash": """
        import os, signal
        def device_count():
            os.kill(os.getpid(), signal.SIGSEGV)
    """,
    "import_oserror": """
        raise OSError("libd3d12.so: cannot open shared object file: No such file or directory")
    """,
    "count_raises": """
        def device_count():
            raise RuntimeError("Unknown error -1796928016")
    """,
    "no_device": """
        def device_count():
            return 0
    """,
    "device_raises": """
        def device_count():
            return 1
        def device(i=None):
            raise RuntimeError("adapter lost")
        def device_name(i):
            return "Fake GPU"
    """,
    "works": """
        def device_count():
            return 1
        def device(i=None):
            return "cpu"
        def device_name(i):
            return "Fake GPU"
    """,
}

EXPECTED = {
    "crash": (False, "crashed the probe process (SIGSEGV)"),
    "import_oserror": (False, "import torch_directml failed: OSError: libd3d12.so"),
    "count_raises": (False, "device_count() failed: RuntimeError: Unknown error"),
    "no_device": (False, "found no DirectML device"),
    "device_raises": (False, "torch_directml.device() failed: RuntimeError: adapter lost"),
    "works": (True, "1 DirectML device(s); default cpu (Fake GPU)"),
}


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
    def install(kind: str):
        pkg = tmp_path / kind / "torch_directml"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(textwrap.dedent(FAKES[kind]))
        monkeypatch.syspath_prepend(str(tmp_path / kind))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / kind), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.delitem(sys.modules, "torch_directml", raising=False)
        dml_device.probe_subprocess.cache_clear()
        return pkg

    yield install
    dml_device.probe_subprocess.cache_clear()
    sys.modules.pop("torch_directml", None)


@pytest.mark.parametrize("kind", sorted(FAKES))
def test_probe_reports_every_failure_mode_without_raising(fake_plugin, kind):
    fake_plugin(kind)
    ok, reason = dml_device.available()
    want_ok, want_text = EXPECTED[kind]
    assert ok is want_ok
    assert want_text in reason
    chosen = dml_device.device()
    if want_ok:
        assert chosen == torch.device("cpu")  # what the fake plugin's device() names
    else:
        assert chosen.type in ("cpu", "cuda")
    if kind == "crash":
        assert "torch_directml" not in sys.modules  # never imported into this process


def test_probe_result_is_cached_per_process(fake_plugin):
    fake_plugin("no_device")
    first = dml_device.probe_subprocess()
    assert dml_device.probe_subprocess() is first
    assert dml_device.probe_subprocess.cache_info().hits >= 1


def test_not_installed_is_reported_without_a_probe(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_directml", raising=False)
    monkeypatch.setattr(dml_device.importlib.util, "find_spec", lambda name: None)

    def no_probe():
        raise AssertionError("no probe expected when the package is absent")

    monkeypatch.setattr(dml_device, "probe_subprocess", no_probe)
    assert dml_device.available() == (False, f"torch-directml is not installed ({dml_device.install_hint()})")


def test_backend_status_lists_every_backend_with_a_reason(fake_plugin):
    fake_plugin("count_raises")
    status = {name: (ok, why) for name, ok, why in dml_device.backend_status()}
    assert set(status) == {"directml", "cuda", "mps", "cpu"}
    assert status["directml"][0] is False and "device_count() failed" in status["directml"][1]
    assert status["cpu"][0] is True
    assert all(why for _, why in status.values())
