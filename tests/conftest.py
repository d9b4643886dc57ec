"""Shared test configuration: hypothesis profiles and determinism."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the whole suite inside the CI budget; "fuzz" is the long maintainer run
# (HYPOTHESIS_PROFILE=fuzz python -m pytest tests -k fuzz), see README.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
