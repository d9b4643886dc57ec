"""Shared test configuration: hypothesis profiles and determinism."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the whole suite inside the CI budget; "fuzz" is the long maintainer run
# (HYPOTHESIS_PROFILE=fuzz python -m pytest tests -k fuzz), see README.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)  # (CI: the same examples every run; "fuzz" draws new ones)
settings.register_profile("fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The machine's vector width must decide no test (issue 47).  To run the suite as an AVX2 machine would, on an
# AVX-512 one: ATEN_CPU_CAPABILITY=avx2 (torch's own kernels; read by torch itself) and DML_OPTIM_TEST_SIMDLEN=256
# (inductor's compiled kernels, ``cpp.simdlen``, in this process; a test's subprocess compiles at the machine's
# width).  docs/contributing.md lists the runs to make before a change lands.
if os.environ.get("DML_OPTIM_TEST_SIMDLEN"):
    import torch._inductor.config as _inductor_config

    _inductor_config.cpp.simdlen = int(os.environ["DML_OPTIM_TEST_SIMDLEN"])


def pytest_sessionstart(session):
    """Load the stand-in DirectML device (``dml_optim.standin``) before any test runs, where it can be built.

    As a DirectML user's process imports torch-directml before training, the stand-in must be registered
    before the first ``backward()`` of the process: PyTorch's autograd engine sizes its device queues once, at
    its first backward, by the devices registered then, and a PrivateUse1 device registered later has no queue
    (an internal assert).  Where it cannot be built (no C++ compiler) its tests skip, saying why."""
    from dml_optim import standin

    session.config._standin = standin.available(load=True)


def pytest_report_header(config):
    """The machine the suite runs on: CPU model, vector extensions, threads, the widths set above, the stand-in."""
    from dml_optim.benchmark.machine import cpu_summary

    simdlen = os.environ.get("DML_OPTIM_TEST_SIMDLEN") or "the machine's"
    aten = os.environ.get("ATEN_CPU_CAPABILITY") or "the machine's"
    ok, why = getattr(config, "_standin", (False, "not loaded yet"))
    return [f"dml_optim tests on: {cpu_summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"ATen kernels: {aten} width; inductor simdlen: {simdlen}",
            f"stand-in DirectML device: {'loaded' if ok else 'unavailable'} ({why})"]


def _flushes_subnormals() -> bool:
    """This thread flushes subnormal floats to zero (x86 FTZ/DAZ)."""
    return 2.2250738585072014e-308 * 0.5 == 0.0


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _subnormals_stay_on():
    """A test that leaves flush-to-zero on fails here, at its source, instead of in some later test.

    torch 2.4's inductor builds CPU kernels with -ffast-math; with gcc < 13 loading one turns on
    flush-to-zero for the thread (docs/design.md §4).  Our compiled runner restores the caller's mode; a
    test that calls ``torch.compile`` itself must too.  The mode is restored either way, so one leak does
    not break every later test that needs subnormals (hypothesis refuses to draw floats then).
    """
    flushed = _flushes_subnormals()
    yield
    if _flushes_subnormals() and not flushed:
        torch.set_flush_denormal(False)
        pytest.fail("this test left flush-to-zero on for the thread (a torch.compile'd CPU kernel built with "
                    "-ffast-math?): restore it with torch.set_flush_denormal(False)")
