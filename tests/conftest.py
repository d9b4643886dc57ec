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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
