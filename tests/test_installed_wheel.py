"""The installed package works like the checkout (issue item 1).

Builds the wheel once, installs it with ``--no-deps --no-index`` into a fresh
virtual environment, and runs the shape-based commands from a folder outside
the repository, as a new user would: built-in model names, the installed
example descriptors, and output files under ``./dml-optim-out``.

Nothing is downloaded: torch, numpy and tqdm come from the environment
running the tests, through a ``.pth`` file in the new environment (only their
folder is added to ``sys.path``; the ``.pth`` files there, such as an editable
install of this repository, are not processed, and the new environment's own
site-packages comes first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy
import pytest
import torch
import tqdm

ROOT = Path(__file__).resolve().parent.parent
BUILT_IN = {"resnet50", "bert-base-uncased", "gpt2", "vit-b-16", "tiny-mlp", "many-small"}


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (so the build leaves nothing in the checkout)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "dml_optim", src / "dml_optim", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    # when this environment can build wheels itself (setuptools >= 70.1 has bdist_wheel; older ones
    # need the `wheel` package), build without an isolated build environment: nothing is downloaded
    can_build = importlib.util.find_spec("setuptools") is not None and (
        importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
        or importlib.util.find_spec("wheel") is not None)
    offline = ["--no-build-isolation", "--no-index"] if can_build else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "--quiet", "-w", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("dml_optim-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    """``(bin folder, site-packages)`` of a new environment with only the wheel installed."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (torch, numpy, tqdm))
    (purelib / "_dml_optim_test_deps.pth").write_text("\n".join(deps) + "\n", encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(wheel)])
    return bindir, purelib


@pytest.mark.slow
def test_wheel_installed_in_a_fresh_venv_runs_the_shape_commands_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "dml_optim/data/shapes/models/resnet50.json" in names
    assert "dml_optim/data/shapes/descriptors/valid-minimal.json" in names
    assert "dml_optim/data/shapes/descriptors/README.md" in names
    assert not [n for n in names if n.split("/")[0] == "shapes"]  # never a top-level `shapes` (a PyPI package)

    bindir, purelib = _fresh_venv(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert ROOT not in elsewhere.resolve().parents
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    dml_optim = shutil.which("dml-optim", path=str(bindir))
    assert dml_optim is not None

    examples = purelib / "dml_optim" / "data" / "shapes" / "descriptors"  # the installed copy, not the checkout's
    jobs = {  # side by side: each imports torch
        "info": ["info", "--json"],
        "example": ["validate", str(examples / "valid-minimal.json")],
        "audit": ["audit", "--optimizer", "momentum", "--model", "resnet50", "--json"],
        "validate": ["validate", "--model", "gpt2"],
        "compare": ["compare", "--workload", "tiny-mlp", "--steps", "2", "--configs", "fp32,fp16",
                    "--streams", "synthetic"],
        "bench": ["bench", "--quick", "--optimizers", "momentum"],
    }
    procs = {name: subprocess.Popen([dml_optim, *argv], cwd=elsewhere, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, argv in jobs.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"dml-optim {name} exited {proc.returncode}:\n{out[-2000:]}\n{err[-3000:]}"
        done[name] = out

    info = json.loads(done["info"])
    assert BUILT_IN <= set(info["models"]["names"])
    assert Path(info["example_descriptors"]) == examples
    assert done["example"].strip().endswith("valid at feature level 3_0 (0 errors, 0 warnings)")
    audit = json.loads(done["audit"])
    assert (audit["model"], audit["tensors"], audit["parameters"]) == ("resnet50", 161, 25_557_032)
    assert done["validate"].splitlines()[-1] == "gpt2: valid at feature level 3_0 (0 errors, 0 warnings)"
    assert (elsewhere / "dml-optim-out" / "compare" / "report.json").is_file()
    assert len(list((elsewhere / "dml-optim-out" / "bench").glob("cpu-*-quick.json"))) == 1
    assert sorted(p.name for p in elsewhere.iterdir()) == ["dml-optim-out"]  # no ./bench/results, no ./compare-report
