"""Atomic steps (issue 8, item 2).

Two kinds of failure inside ``step()``:

* validation-class errors (a bad hyperparameter in a later group, a bad
  gradient in the last parameter, a non-finite gradient with
  ``nonfinite="raise"``): raised before the first write, whatever the
  optimizer's ``atomic`` setting; the rule is never called;
* a failure injected in the middle of the update, after some flat buffers,
  runs of parameters, or chunks of a chunked-precision update were already
  written (the rule is wrapped to raise after its n-th call, or
  ``dml_optim.core.functional.adam_`` is patched).  Evidence, measured here: with
  the default ``atomic=False`` such a failure leaves the step half done (the
  exception gets a note saying so); with ``atomic=True`` parameters, states,
  gradients and step counters (host and device) are restored bit-exactly and
  the next step matches a run that never failed.

Every optimizer of the test matrix (``tests/matrix.py``, one case per
optimizer and device) runs every world with the case's backend (``eager``:
the rule is what ``fail_after`` wraps); the worlds fix their own dtypes
(float32, or float16 for the chunked and master-weight modes).

The ``fused`` backend (the default on the CPU for float32 and float64
buffers) never calls the rule: it calls torch's fused kernel
(``dml_optim.backends.fused``), which :func:`fail_fused_after` wraps instead (the plan
looks the kernel up on ``torch`` when it plans a step, so patching
``torch._fused_adamw_`` and the others reaches it), with the same evidence:
rolled back bit-exactly with ``atomic=True``, a note without.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import dml_optim.core.functional
import dml_optim.backends.eager as engine
from introspect import buffers, runs_in_chunks
from matrix import Case, case_of, classes
from test_bad_inputs import assert_same, make_params, new_grads, snapshot

ADAM = case_of("adam")


class Injected(RuntimeError):
    pass


_PATCHED: list = []


@pytest.fixture(autouse=True)
def _restore_rules():
    yield
    while _PATCHED:
        stop_failing(_PATCHED[-1][0])


def fail_after(opt, n: int, exc=Injected):
    """Wrap the optimizer's rule (``opt.owner.rule``, the :class:`~dml_optim.core.rule.Rule` its backends run): run
    the real element-wise update, and raise right after its ``n``-th call."""
    owner = opt.owner
    real = owner.rule
    calls = []

    def apply(*args, **kwargs):
        real.apply(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise exc("injected failure")

    owner.rule = dataclasses.replace(real, apply=apply)
    _PATCHED.append((owner, real))
    return calls


def fail_fused_after(monkeypatch, opt, ps, n: int, exc=Injected):
    """Wrap torch's fused kernels that ``opt``'s groups call: run the real kernel, and raise right after the
    ``n``-th kernel call of the step (all kernels counted together).  Returns the list of calls, each entry
    whether the parameters differed from their values when wrapped: what had been written by then."""
    ops = {type(opt).fused_kernel(group, 0)[0] for group in opt.param_groups}
    before = [p.detach().clone() for p in ps]
    calls: list[bool] = []
    for op in ops:
        real = getattr(torch, op)

        def kernel(*args, _real=real, **kwargs):
            _real(*args, **kwargs)
            calls.append(any(not torch.equal(p.detach(), b) for p, b in zip(ps, before)))
            if len(calls) == n:
                raise exc("injected failure in torch's fused kernel")

        monkeypatch.setattr(torch, op, kernel)
    return calls


def fused_calls_per_step(opt, ps) -> int:
    """How many fused kernel calls one step of ``opt`` makes (a step is taken)."""
    with pytest.MonkeyPatch.context() as mp:
        calls = fail_fused_after(mp, opt, ps, -1)
        opt.step()
    return len(calls)


def stop_failing(opt_or_owner) -> None:
    """Give the optimizer (or its owner) its real rule back."""
    owner = getattr(opt_or_owner, "owner", opt_or_owner)
    for i, (patched, real) in enumerate(_PATCHED):
        if patched is owner:
            owner.rule = real
            del _PATCHED[i]
            return


# -- worlds with several writes per step ----------------------------------------


def buffers_world(case: Case, **kw):
    """Three param groups = three flat buffers, one completed step."""
    ps = make_params(shapes=((2, 3), (4,), (5,)), device=case.device)
    opt = case.cls([{"params": [p]} for p in ps], lr=0.1, **{"backend": case.backend, **kw})
    opt.step()
    new_grads(ps)
    return ps, opt


def runs_world(case: Case, **kw):
    """One buffer whose params have different step counts: three runs per step."""
    ps = make_params(shapes=((3,), (4,), (2,), (5,)), device=case.device)
    opt = case.cls(ps, lr=0.1, **{"backend": case.backend, **kw})
    ps[1].grad = None
    opt.step()  # p1 stays at step 0: runs [p0], [p1], [p2, p3]
    new_grads(ps)
    return ps, opt


def chunked_world(case: Case, monkeypatch, **kw):
    """float16 parameters, float32 compute: the rule runs over 8-element chunks."""
    monkeypatch.setattr(engine, "CHUNK_ELEMENTS", 8)
    ps = make_params(shapes=((5, 6), (7,)), dtype=torch.float16, device=case.device)
    opt = case.cls(ps, lr=0.01, compute_dtype=torch.float32, state_dtype=torch.float32,
                   **{"backend": case.backend, **kw})
    opt.step()
    new_grads(ps)
    assert runs_in_chunks(opt)
    return ps, opt


def master_world(case: Case, **kw):
    ps = (make_params(shapes=((3, 3),), dtype=torch.float16, device=case.device)
          + make_params(shapes=((4,),), dtype=torch.float16, device=case.device))
    opt = case.cls([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.01, master_weights=True,
                   **{"backend": case.backend, **kw})
    opt.step()
    new_grads(ps)
    return ps, opt


WORLDS = {
    "buffers": lambda case, mp, **kw: buffers_world(case, **kw),
    "runs": lambda case, mp, **kw: runs_world(case, **kw),
    "chunks": lambda case, mp, **kw: chunked_world(case, mp, **kw),
    "master": lambda case, mp, **kw: master_world(case, **kw),
    "buffers-skip": lambda case, mp, **kw: buffers_world(case, nonfinite="skip", **kw),
    "runs-skip": lambda case, mp, **kw: runs_world(case, nonfinite="skip", **kw),
}


def _note(exc_info) -> str:
    return " ".join(getattr(exc_info.value, "__notes__", []))


@pytest.mark.parametrize("world", sorted(WORLDS))
@pytest.mark.parametrize("case", classes())
def test_injected_failure_is_rolled_back_with_atomic(case, world, monkeypatch):
    ps, opt = WORLDS[world](case, monkeypatch, atomic=True)
    twin_ps, twin = WORLDS[world](case, monkeypatch, atomic=True)
    assert {b for g in opt.resolved_backends() for b in g} == {"eager"}  # the rule runs: fail_after reaches it
    before = snapshot(ps, opt)
    calls = fail_after(opt, 2)
    with pytest.raises(Injected):
        opt.step()
    assert len(calls) == 2  # the failure came after two rule applications had written
    assert_same(before, snapshot(ps, opt))
    # and the optimizer goes on exactly like a twin that never failed
    stop_failing(opt)
    opt.step()
    twin.step()
    a, b = snapshot(ps, opt), snapshot(twin_ps, twin)
    del a["group_params"], b["group_params"]
    assert_same(a, b)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_injected_failure_without_atomic_is_partial_and_says_so(world, monkeypatch):
    """The default (atomic=False) does not roll back: the measured evidence for the option."""
    ps, opt = WORLDS[world](ADAM, monkeypatch)
    assert {b for g in opt.resolved_backends() for b in g} == {"eager"}
    before = snapshot(ps, opt)
    fail_after(opt, 2)
    with pytest.raises(Injected) as info:
        opt.step()
    with pytest.raises(AssertionError):  # something (params, states or the master copy) was written
        assert_same(before, snapshot(ps, opt))
    if sys.version_info >= (3, 11):  # BaseException.add_note exists from Python 3.11 on
        assert "partially updated" in _note(info) and "atomic=True" in _note(info)
    else:  # pragma: no cover - Python 3.10 has no exception notes
        assert not hasattr(info.value, "__notes__")


def test_failure_inside_functional_adam_is_rolled_back(monkeypatch):
    """Patch the math itself (``dml_optim.core.functional.adam_``), not the optimizer's hook."""
    ps, opt = buffers_world(ADAM, atomic=True)
    assert {b for g in opt.resolved_backends() for b in g} == {"eager"}  # (the fused kernel is not adam_)
    real = dml_optim.core.functional.adam_
    calls = []

    def adam_(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected out-of-memory")

    monkeypatch.setattr(dml_optim.core.functional, "adam_", adam_)
    before = snapshot(ps, opt)
    with pytest.raises(MemoryError):
        opt.step()
    assert len(calls) == 2
    assert_same(before, snapshot(ps, opt))


def test_keyboard_interrupt_mid_update_is_rolled_back(monkeypatch):
    ps, opt = chunked_world(ADAM, monkeypatch, atomic=True)
    before = snapshot(ps, opt)
    fail_after(opt, 3, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert_same(before, snapshot(ps, opt))


def test_failure_after_a_skipped_overflow_step_is_rolled_back(monkeypatch):
    """Gated path with a non-finite gradient: device counters and zeroed grads come back too."""
    ps, opt = buffers_world(ADAM, nonfinite="skip", atomic=True)
    ps[2].grad[0] = float("inf")
    before = snapshot(ps, opt)
    fail_after(opt, 3)
    with pytest.raises(Injected):
        opt.step()
    assert_same(before, snapshot(ps, opt))


# -- the fused backend: torch's kernel fails mid-step ------------------------------

#: The matrix's classes on the fused backend (all have a fused kernel for their default variant), CPU only.
#: (the optimizers torch has a fused CPU kernel of: not Lion)
FUSED_CASES = [pytest.param(dataclasses.replace(p.values[0], backend="fused"),
                            id=dataclasses.replace(p.values[0], backend="fused").id)
               for p in classes(devices=("cpu",)) if p.values[0].cls.rule.fused is not None]
#: Worlds a fused buffer runs: several buffers (one call each), and one buffer whose parameters are at two step
#: counts (stepped as ranges, no re-pack: one call per distinct keyword set, two for the Adams and Momentum).
FUSED_WORLDS = ("buffers", "runs")


def _fused_world(case: Case, world: str, monkeypatch, **kw):
    ps, opt = WORLDS[world](case, monkeypatch, **kw)
    assert opt.resolved_backends() == [["fused"] for _ in opt.param_groups], opt.resolved_backends()
    return ps, opt


def _fail_at(total: int) -> int:
    """The kernel call to fail after: the last but one (some buffers or runs written, one not), or the only one."""
    return max(1, total - 1)


@pytest.mark.parametrize("world", FUSED_WORLDS)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_failure_in_a_fused_kernel_is_rolled_back_with_atomic(case, world, monkeypatch):
    ps, opt = _fused_world(case, world, monkeypatch, atomic=True)
    twin_ps, twin = _fused_world(case, world, monkeypatch, atomic=True)
    count_ps, counted = _fused_world(case, world, monkeypatch, atomic=True)
    total = fused_calls_per_step(counted, count_ps)
    assert total >= 1 and (world != "buffers" or total == 3)  # a fused step calls torch's kernel: once per buffer
    before = snapshot(ps, opt)
    calls = fail_fused_after(monkeypatch, opt, ps, _fail_at(total))
    with pytest.raises(Injected):
        opt.step()
    assert len(calls) == _fail_at(total) and calls[-1]  # the kernel had written parameters when it failed
    assert_same(before, snapshot(ps, opt))
    # and the optimizer goes on exactly like a twin that never failed
    monkeypatch.undo()
    opt.step()
    twin.step()
    a, b = snapshot(ps, opt), snapshot(twin_ps, twin)
    del a["group_params"], b["group_params"]
    assert_same(a, b)
    assert opt.resolved_backends() == twin.resolved_backends() == [["fused"] for _ in opt.param_groups]


@pytest.mark.parametrize("world", FUSED_WORLDS)
def test_failure_in_a_fused_kernel_without_atomic_is_partial_and_says_so(world, monkeypatch):
    ps, opt = _fused_world(dataclasses.replace(ADAM, backend="fused"), world, monkeypatch)
    count_ps, counted = _fused_world(dataclasses.replace(ADAM, backend="fused"), world, monkeypatch)
    total = fused_calls_per_step(counted, count_ps)
    assert total >= 2  # the Adams call the kernel once per buffer, and once per step count (their eps)
    before = snapshot(ps, opt)
    calls = fail_fused_after(monkeypatch, opt, ps, total - 1)
    with pytest.raises(Injected) as info:
        opt.step()
    assert len(calls) == total - 1 and calls[-1]
    with pytest.raises(AssertionError):  # some parameters and states were written, not all
        assert_same(before, snapshot(ps, opt))
    if sys.version_info >= (3, 11):
        assert "partially updated" in _note(info) and "atomic=True" in _note(info)
    else:  # pragma: no cover - Python 3.10 has no exception notes
        assert not hasattr(info.value, "__notes__")


# -- validation-class errors: raised before any write ----------------------------


def multi_world(case: Case, **kw):
    """Two groups; group 0 holds two dtypes (two flat buffers), group 1 one; one step done."""
    dt2 = next(d for d in case.entry.dtypes if d != torch.float32)  # float64, or float16 for DmlAdam
    dev = case.device
    ps = (make_params(shapes=((2, 3), (4,)), device=dev) + make_params(shapes=((3,),), dtype=dt2, device=dev)
          + make_params(shapes=((5,), (6,)), device=dev))
    opt = case.cls([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05}], lr=0.01, **{"backend": case.backend, **kw})
    assert len(buffers(opt, 0)) == 2
    opt.step()
    new_grads(ps)
    return ps, opt


def _spoil_hyperparameter(ps, opt):
    opt.param_groups[1]["lr"] = -1.0


def _spoil_last_grad(ps, opt):
    saved = ps[-1].data
    ps[-1].data = torch.empty(7, device=saved.device)
    ps[-1].grad = torch.ones(7, device=saved.device)
    ps[-1].data = saved


def _spoil_last_grad_sparse(ps, opt):
    ps[-1].grad = torch.ones(6, device=ps[-1].device).to_sparse()


def _nonfinite_raise_in_last_group(ps, opt):
    opt.param_groups[1]["nonfinite"] = "raise"
    ps[-1].grad[3] = float("nan")


SPOILERS = {
    "hyperparameter-in-group-1": (_spoil_hyperparameter, ValueError, r"lr must be >= 0"),
    "grad-shape-of-last-param": (_spoil_last_grad, ValueError, r"param_groups\[1\]\['params'\]\[1\].*shape \(7,\)"),
    "sparse-grad-of-last-param": (_spoil_last_grad_sparse, TypeError, r"param_groups\[1\]\['params'\]\[1\].*sparse"),
    "nonfinite-raise-in-last-group": (_nonfinite_raise_in_last_group, FloatingPointError,
                                      r"non-finite gradient.*param_groups\[1\]\['params'\]\[1\]"),
}


@pytest.mark.parametrize("spoiler", sorted(SPOILERS))
@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
@pytest.mark.parametrize("case", classes())
def test_validation_errors_raise_before_any_write(case, nonfinite, spoiler):
    ps, opt = multi_world(case, nonfinite=nonfinite)  # atomic=False: nothing to roll back is needed
    assert {b for g in opt.resolved_backends() for b in g} == {"eager"}
    spoil, exc, match = SPOILERS[spoiler]
    spoil(ps, opt)
    calls = fail_after(opt, 10**9)  # counts rule calls
    before = snapshot(ps, opt)
    with pytest.raises(exc, match=match):
        opt.step()
    assert calls == []
    assert_same(before, snapshot(ps, opt))


#: The matrix's classes with the default backend (``auto``: torch's fused kernel for CPU float32/float64 buffers).
AUTO_CASES = [pytest.param(dataclasses.replace(p.values[0], backend="auto"),
                           id=dataclasses.replace(p.values[0], backend="auto").id)
              for p in classes(devices=("cpu",)) if p.values[0].cls.rule.fused is not None]


@pytest.mark.parametrize("spoiler", sorted(SPOILERS))
@pytest.mark.parametrize("case", AUTO_CASES)
def test_validation_errors_raise_before_any_fused_kernel_call(case, spoiler, monkeypatch):
    """The same spoilers with the default CPU backend on its fused kernels: raised before the first call."""
    ps, opt = multi_world(case)
    fused = [[b == "fused" for b in g] for g in opt.resolved_backends()]
    assert fused[1] == [True]  # the spoiled group runs torch's kernel (group 0's float16 DmlAdam buffer: eager)
    spoil, exc, match = SPOILERS[spoiler]
    spoil(ps, opt)
    calls = fail_fused_after(monkeypatch, opt, ps, 10**9)  # counts kernel calls
    before = snapshot(ps, opt)
    with pytest.raises(exc, match=match):
        opt.step()
    assert calls == []
    assert_same(before, snapshot(ps, opt))


def test_step_scaled_validates_before_unscaling():
    """step_scaled multiplies gradients by inv_scale: a bad group must stop it before that."""
    ps, opt = multi_world(ADAM)
    _spoil_hyperparameter(ps, opt)
    before = snapshot(ps, opt)
    with pytest.raises(ValueError, match="lr"):
        opt.step_scaled(torch.tensor(0.5))
    assert_same(before, snapshot(ps, opt))
