"""Extras and hints that fit the platform (issue item 4).

torch-directml works only on Windows and under WSL (x86_64, CPython 3.8-3.12).
The ``directml`` extra's environment marker installs it only there, and the
hint that ``train`` and ``info`` print suggests installing it only there; on
plain Linux and macOS they say, once, that DirectML does not run there.
"""

from __future__ import annotations

import importlib
import platform
import re
from pathlib import Path

import pytest

dml_device = importlib.import_module("dml_optim.dml.device")  # the module (the package exports a function of that name)

ROOT = Path(__file__).resolve().parent.parent

#: (id, sys_platform, platform.system(), release, machine, Python version, plugin installable)
PLATFORMS = [
    ("plain-linux", "linux", "Linux", "6.1.0-18-amd64", "x86_64", "3.11.7", False),
    ("wsl2", "linux", "Linux", "5.15.153.1-microsoft-standard-WSL2", "x86_64", "3.11.7", True),
    ("wsl1", "linux", "Linux", "4.4.0-19041-Microsoft", "x86_64", "3.10.12", True),
    ("windows", "win32", "Windows", "10", "AMD64", "3.12.4", True),
    ("windows-py313", "win32", "Windows", "10", "AMD64", "3.13.0", False),
    ("windows-arm", "win32", "Windows", "11", "ARM64", "3.12.4", False),
    ("macos", "darwin", "Darwin", "23.5.0", "arm64", "3.12.4", False),
]


def _directml_marker():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    markers = pytest.importorskip("packaging.markers")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["directml"]
    (requirement,) = extra
    name, marker = requirement.split(";", 1)
    assert name.strip() == "torch-directml"
    return markers.Marker(marker)


@pytest.mark.parametrize("sys_platform,system,release,machine,python,installable",
                         [p[1:] for p in PLATFORMS], ids=[p[0] for p in PLATFORMS])
def test_directml_extra_installs_the_plugin_only_where_it_works(sys_platform, system, release, machine, python,
                                                                installable):
    env = {"sys_platform": sys_platform, "platform_system": system, "platform_release": release,
           "platform_machine": machine, "python_version": ".".join(python.split(".")[:2]),
           "python_full_version": python}
    assert _directml_marker().evaluate(env) is installable


@pytest.mark.parametrize("sys_platform,system,release,machine,python,installable",
                         [p[1:] for p in PLATFORMS], ids=[p[0] for p in PLATFORMS])
def test_install_hint_suggests_pip_only_where_the_extra_installs_the_plugin(monkeypatch, sys_platform, system, release,
                                                                           machine, python, installable):
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "release", lambda: release)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "python_version", lambda: python)
    monkeypatch.setattr(platform, "python_version_tuple", lambda: tuple(python.split(".")))
    hint = dml_device.install_hint()
    assert ("pip install" in hint) is installable, hint
    if system in ("Darwin",) or (system == "Linux" and "icrosoft" not in release):
        assert hint == "DirectML runs only on Windows and WSL"


def test_no_install_advice_on_this_machine_unless_the_plugin_can_work_here():
    if platform.system() == "Windows" or "microsoft" in platform.release().lower():
        pytest.skip("Windows or WSL: the pip hint is the right advice here")
    ok, reason = dml_device.available()
    if ok:
        pytest.skip("DirectML is usable here")
    assert "pip install" not in reason
    assert "dml-optim[directml]" not in reason


def test_train_header_mentions_directml_once_and_gives_no_pip_advice_off_windows(capsys):
    from dml_optim.cli import main

    if platform.system() == "Windows" or "microsoft" in platform.release().lower():
        pytest.skip("Windows or WSL: the pip hint is the right advice here")
    assert main(["train", "--steps", "2", "--json"]) == 0
    err = capsys.readouterr().err
    assert len(re.findall("DirectML", err)) <= 2  # "not DirectML: ... DirectML runs only on ..." on one line
    assert "pip install" not in err
