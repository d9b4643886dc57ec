"""Regressions for defects found in the final code review."""

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dml_optim
from introspect import buffers, runs_in_chunks


def test_raise_mode_ignores_the_stale_gradient_slot_of_a_parameter_without_grad():
    """An inf left in the flat gradient slot of a parameter whose grad was later set to
    None must not make every following step raise (with an empty parameter list)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = dml_optim.Adam([a, b], lr=0.1, nonfinite="raise")
    (a.sum() + (b * math.inf).sum()).backward()
    with pytest.raises(FloatingPointError, match=r"\['params'\]\[1\]"):
        opt.step()
    a.grad = b.grad = None
    a.sum().backward()
    opt.step()  # b has no gradient now: nothing non-finite is left to report
    assert torch.isfinite(a).all() and not torch.equal(a.detach(), torch.ones(3))
    assert torch.equal(b.detach(), torch.ones(3))


@pytest.mark.parametrize("kwargs", [dict(nonfinite="skip"), dict(nonfinite="raise"), dict(master_weights=True)])
def test_a_buffer_of_empty_parameters_steps(kwargs):
    dtype = torch.float16 if kwargs.get("master_weights") else torch.float32
    p = torch.nn.Parameter(torch.empty(0, dtype=dtype))
    q = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    opt = dml_optim.Adam([p, q] if not kwargs.get("master_weights") else [p], lr=0.1, **kwargs)
    p.grad = torch.empty(0, dtype=dtype)
    q.grad = torch.ones(2, dtype=dtype)
    opt.step()
    assert p.numel() == 0


def test_compiled_buffer_stepped_under_a_dispatch_mode_does_not_resize_its_scratch():
    """Under a TorchDispatchMode the compiled runner uses the eager rule; the compact
    scratch of a compiled buffer must not be resized (warning + allocation each step)."""

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    p = torch.nn.Parameter(torch.randn(2**20 + 5))
    p.grad = torch.randn_like(p)
    opt = dml_optim.Adam([p], lr=0.01, backend="compiled")
    reference = dml_optim.Adam([torch.nn.Parameter(p.detach().clone())], lr=0.01, backend="eager")
    reference.param_groups[0]["params"][0].grad = p.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with Passthrough():
            opt.step()
    reference.step()
    assert all(s.numel() <= 2**20 for s in buffers(opt)[0].scratch)
    torch.testing.assert_close(p.detach(), reference.param_groups[0]["params"][0].detach())


def test_dml_descriptors_refuse_moments_in_another_dtype():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = dml_optim.DmlAdam([p], state_dtype=torch.float32, epsilon=1e-4)
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="one data type"):
        opt.dml_descriptors()


@pytest.mark.parametrize("value, exc", [("3", ValueError), (torch.ones(2), ValueError), (float("nan"), ValueError)])
def test_bad_step_assignment_is_a_clear_error(value, exc):
    p = torch.nn.Parameter(torch.ones(2))
    opt = dml_optim.Adam([p])
    with pytest.raises(exc, match="step"):
        opt.state[p]["step"] = value


@pytest.mark.parametrize("argv", [
    ["compare", "--steps", "2", "--out", "{file}"],
    ["bench", "--quick", "--out", "{file}/sub/result.json"],
])
def test_an_unusable_out_path_is_a_usage_error_before_any_work(tmp_path, capsys, argv):
    from dml_optim.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main([a.replace("{file}", str(blocker)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--out" in err[0]
