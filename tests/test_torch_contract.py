"""The rest of torch.optim's ``Optimizer`` contract, against torch.optim itself (issue 22).

* torch's own test inputs (``torch.testing._internal.common_optimizers``:
  ``optim_inputs_func`` and ``optim_error_inputs_func``) for every optimizer with
  a torch twin: ``AdamW`` ↔ ``torch.optim.AdamW``, ``SGD`` ↔ ``torch.optim.SGD``,
  ``Adagrad`` ↔ ``torch.optim.Adagrad``, unchanged, run against the twin;
* ONNX Momentum's ``beta`` and torch's ``dampening`` for the betas that do not
  survive ``1 - (1 - beta)`` in floating point;
* ``copy.deepcopy`` and pickling (alone and with the model), stepped after the
  copy, against the twin copied the same way;
* the four state-dict hooks, in torch's order;
* named parameters, duplicate parameters, torch's param-group keys, and
  checkpoints moving between the two libraries without a warning.

Tolerances are the arithmetic's: where the two libraries run the same float
operations in the same order the result must be bit-identical (``EXACT``);
where they do not, the bound says which operations differ and by how many
units in the last place (each override's comment).

The twin is the torch implementation our buffers actually run
(:func:`_twin_flags`): on the CPU, float32 and float64 buffers of the default
``backend="auto"`` run torch's own fused kernel (``dml_optim.backends.fused``), so
their twin is torch.optim's ``fused=True`` and every comparison is exact;
``backend="eager"`` (and the dtypes the fused kernel does not take) runs our
op chain, whose twin is torch's single-tensor implementation
(``foreach=False``), as documented (SGD and Adagrad bit for bit).
"""

from __future__ import annotations

import copy
import functools
import io
import math
import warnings

import pytest
import torch

import dml_optim
from dml_optim.optimizers import registry
from matrix import ENTRIES
from tolerances import TOL

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers",
    reason="torch's optim_db needs the expecttest package (pip install -e '.[test]' installs it)",
)
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

#: registry name of ours -> the torch.optim twin whose optim_db inputs it takes unchanged
TWINS = {"adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
EXACT = dict(rtol=0, atol=0)
STEPS = 10


def _optim_info(torch_name: str):
    return next(i for i in common_optimizers.optim_db if i.optim_cls.__name__ == torch_name)


#: Mixed shapes, one of them non-contiguous (a transposed leaf, the last), as torch's tests use.
MIXED = ((6, 5), (5,), (3, 2, 2), (), (4, 7))
#: The same kinds of shapes (the last one transposed), every one a multiple of 16 elements (64 bytes in
#: float32).  torch's fused CPU kernels step a tensor in tasks of whole 64-byte cache lines, each with a
#: vector loop over all but its last ``size % vector width`` elements and a scalar loop over those, and the
#: scalar loop rounds differently (the compiler contracts its ``a * b + c * d`` into fused multiply-adds:
#: about half the elements of a random buffer differ by a rounding after one momentum step).  Which
#: elements take the scalar loop depends on where they sit in the tensor the kernel is given: torch.optim
#: gives it each parameter, our fused backend the flat buffer of a group.  With every parameter a multiple
#: of 16 elements, every element takes the vector loop in both (16 is a multiple of the vector width in
#: float32 and float64, SSE to AVX-512 and NEON), and the two are the same kernel on the same elements.
ALIGNED = ((8, 4), (16,), (2, 4, 2), (2, 8), (4, 8))


def _params(dtype, seed=0, shapes=MIXED):
    """``shapes`` as parameters, the last one non-contiguous (a transposed leaf)."""
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes[:-1]]
    ps.append(torch.randn(shapes[-1], generator=gen, dtype=torch.float64).to(dtype).t())  # non-contiguous
    return [torch.nn.Parameter(p) for p in ps]


def _grads(params, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def _twin_grad(g, q):
    """``g`` as the twin's gradient of ``q``: in ``q``'s memory layout, as autograd's AccumulateGrad lays out
    a parameter's gradient.  torch.optim's fused CPU kernels assume that layout and pair the elements of a
    parameter and of its gradient in memory order: a transposed parameter with a contiguous gradient is
    stepped with its gradient transposed, silently (torch 2.4.1 and 2.13; on CUDA the kernel refuses
    "params, grads, ... must have same dtype, device, and layout", pytorch/pytorch#106951 and #149367).  Our
    parameters are rebound as contiguous views of the flat buffer, so ours takes any gradient layout."""
    return torch.empty_strided(q.shape, q.stride(), dtype=q.dtype).copy_(g)


def _copy_kwargs(kwargs):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in kwargs.items()}


def _inputs(torch_name: str, dtype):
    info = _optim_info(torch_name)
    return [pytest.param(torch_name, dtype, oi, id=f"{torch_name}-{str(dtype)[6:]}-{oi.desc.replace(' ', '_')}")
            for oi in info.optim_inputs_func(device="cpu", dtype=dtype)]


DTYPES = (torch.float64, torch.float32, torch.bfloat16)
OPTIM_INPUTS = [p for name in TWINS.values() for d in DTYPES for p in _inputs(name, d)]
#: ``None``: our default (``backend="auto"``: torch's fused kernel on the CPU for float32/float64); ``"eager"``:
#: our op chain, which must stay bit for bit torch's single-tensor SGD and Adagrad (README, SGD's docstring)
BACKENDS = (None, "eager")


def _backend_options(backend) -> dict:
    return {} if backend is None else {"backend": backend}


def _twin_flags(opt) -> dict:
    """torch.optim's keywords for the implementation ``opt``'s flat buffers run now: ``fused=True`` where they
    run torch's fused kernel (``dml_optim.backends.fused``: the same kernel, called on our flat buffers), else
    ``foreach=False`` (the single-tensor implementation, the one our eager op chain follows).  Every buffer
    must run the same one, or no single twin is the right reference."""
    resolved = {b for group in opt.resolved_backends() for b in group}
    assert len(resolved) == 1, f"buffers on several backends, no single twin: {opt.resolved_backends()}"
    (backend,) = resolved
    assert backend in ("fused", "eager"), f"{backend}: not what these small CPU buffers should run"
    return dict(fused=True) if backend == "fused" else dict(foreach=False)


def _tolerance(torch_name: str, dtype, kwargs, twin: dict, shapes) -> dict:
    """What the arithmetic allows between our flat step and the twin's."""
    if twin.get("fused"):
        if shapes == ALIGNED:
            # our fused backend calls torch's own kernel with torch's own keywords (AdamW, SGD, Adagrad: the
            # hyperparameters map one to one), and every element takes the kernel's vector loop in both
            # (ALIGNED): the same float operations in the same order, bit-identical
            return EXACT
        # the elements one side steps in the kernel's scalar loop and the other in its vector loop (ALIGNED's
        # comment) differ by the contracted multiply-adds of the scalar loop: a rounding of an intermediate
        # per step, at most about an ulp of the operands (measured: under 0.9 eps after 10 steps, AdamW and
        # SGD with momentum; Adagrad equal)
        eps = torch.finfo(dtype).eps
        return dict(rtol=STEPS * 2 * eps, atol=STEPS * 2 * eps)
    if dtype == torch.bfloat16:
        # every op rounds to bfloat16 (8 bits): where our op order differs from torch's (AdamW:
        # epsilon scaled into the bias correction; Adagrad's weight decay into the regularized gradient)
        # one rounding of 2**-8 relative can differ per step
        return dict(rtol=STEPS * 2**-8, atol=STEPS * 2**-8)
    if torch_name == "AdamW":
        # step_size * V / (sqrt(H) + eps * c2) instead of torch's (lr / c1) * V / (sqrt(H) / c2 + eps):
        # a few roundings per step in another order (docs/design.md §2: 1e-16 in float64, 1 ulp in float32)
        eps = torch.finfo(dtype).eps
        return dict(rtol=STEPS * 8 * eps, atol=STEPS * 8 * eps)
    if torch_name == "SGD" and kwargs.get("nesterov"):
        # torch adds G + momentum * B, then scales by lr; we add lr * G and lr * momentum * B: two
        # roundings in another order per step
        eps = torch.finfo(dtype).eps
        return dict(rtol=STEPS * 4 * eps, atol=STEPS * 4 * eps)
    return EXACT  # the same operations in the same order: bit-identical


def _with_backend(inputs):
    """Each input three ways: our default on ALIGNED shapes (torch's fused kernel for float32 and float64:
    bit for bit torch's fused=True), our default on MIXED shapes (the same, within the scalar loop's
    roundings), and the eager backend on MIXED shapes (torch's single-tensor implementation)."""
    out = []
    for p in inputs:
        torch_name, dtype, optim_input = p.values
        for backend, shapes, tag in ((None, ALIGNED, "default-aligned"), (None, MIXED, "default"),
                                     ("eager", MIXED, "eager")):
            if dtype == torch.bfloat16 and tag != "default":
                continue  # the default runs bfloat16 eagerly already (asserted in the test): the same run again
            out.append(pytest.param(torch_name, dtype, optim_input, backend, shapes, id=f"{p.id}-{tag}"))
    return out


@pytest.mark.parametrize("torch_name, dtype, optim_input, backend, shapes", _with_backend(OPTIM_INPUTS))
def test_torch_optim_db_inputs_step_like_the_twin(torch_name, dtype, optim_input, backend, shapes):
    """Each of torch's own inputs, unchanged (per-group lr added as a second group), steps like torch: our
    default like the implementation it runs (torch's fused kernel on the CPU for float32 and float64), and
    the eager backend like torch's single-tensor implementation."""
    ours_cls = registry.get(next(k for k, v in TWINS.items() if v == torch_name))
    theirs_cls = getattr(torch.optim, torch_name)
    ours_p, ref_p = _params(dtype, shapes=shapes), _params(dtype, shapes=shapes)

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05}]

    ours = ours_cls(groups(ours_p), **_copy_kwargs(optim_input.kwargs), **_backend_options(backend))
    twin = _twin_flags(ours)
    if backend == "eager" or dtype == torch.bfloat16:
        assert twin == dict(foreach=False)  # our op chain (the fused kernel takes float32 and float64 only)
    elif hasattr(torch, "_fused_adamw_"):  # torch >= 2.4 has the fused CPU kernels: the default runs them
        assert twin == dict(fused=True)
    try:
        ref = theirs_cls(groups(ref_p), **_copy_kwargs(optim_input.kwargs), **twin)
    except (RuntimeError, ValueError) as exc:
        # torch.optim validates fused=True against its other keywords (it refuses e.g. differentiable=True, and
        # some versions a Tensor lr or some dtypes); our fused backend calls the kernel itself, so it may run
        # an input torch.optim will not run fused: there is no torch configuration of that kernel to compare
        # with, and this input is compared the documented way instead, our eager chain against torch's
        # single-tensor implementation (none of the CPU inputs of torch 2.4.1 or 2.13 is refused)
        if not twin.get("fused"):
            raise
        print(f"torch.optim.{torch_name}(fused=True) refuses {optim_input.kwargs}: {exc}; compared eager instead")
        ours_p = _params(dtype, shapes=shapes)
        ours = ours_cls(groups(ours_p), **_copy_kwargs(optim_input.kwargs), backend="eager")
        twin = _twin_flags(ours)
        ref = theirs_cls(groups(ref_p), **_copy_kwargs(optim_input.kwargs), **twin)
    tol = _tolerance(torch_name, dtype, optim_input.kwargs, twin, shapes)
    for step in range(STEPS):
        for p, q, g in zip(ours_p, ref_p, _grads(ours_p, step)):
            p.grad, q.grad = g.clone(), _twin_grad(g, q)
        ours.step()
        ref.step()
    assert _twin_flags(ours) == twin  # the same implementation all along
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), **tol)
    ours_state, ref_state = ours.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(ours_state) == sorted(ref_state)
    for k, entry in ref_state.items():
        for name, value in entry.items():
            if name == "step":
                assert float(ours_state[k][name]) == float(value)
            else:
                torch.testing.assert_close(ours_state[k][name], value, **tol)


def _error_inputs(torch_name: str):
    info = _optim_info(torch_name)
    out = []
    for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = e.optimizer_error_input
        out.append(pytest.param(torch_name, e, id=f"{torch_name}-{oi.desc.replace(' ', '_')}"))
    return out


ERROR_INPUTS = [p for name in TWINS.values() for p in _error_inputs(name)]


def _raises_like(cls, error_input):
    """Run ``error_input`` against ``cls`` as torch's test_errors does; return what was raised or warned."""
    oi = error_input.optimizer_error_input
    params = oi.params if oi.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    kwargs = _copy_kwargs(oi.kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = cls(params, **kwargs)
            if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
                opt.step()
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            return type(exc), str(exc)
    for w in caught:
        if issubclass(w.category, error_input.error_type):
            return w.category, str(w.message)
    return None, ""


@pytest.mark.parametrize("torch_name, error_input", ERROR_INPUTS)
def test_torch_optim_db_error_inputs_raise_torchs_error_type(torch_name, error_input):
    """Each of torch's error inputs raises (or warns) torch's type here too (our message may be clearer)."""
    expected = error_input.error_type
    theirs, _ = _raises_like(getattr(torch.optim, torch_name), error_input)
    assert theirs is not None and issubclass(theirs, expected), "the input no longer errors in this torch"
    ours_cls = registry.get(next(k for k, v in TWINS.items() if v == torch_name))
    ours, message = _raises_like(ours_cls, error_input)
    assert ours is not None and issubclass(ours, expected), f"got {ours}: {message}"


# -- ONNX Momentum's beta and torch's dampening ------------------------------------------------------

BETAS = (0.05, 0.1, 0.2, 0.3, 0.7, 1.0)


def _run(make_ours, make_ref, dtype, steps=30):
    """``make_ref(params, twin)`` gets :func:`_twin_flags` of ours: the twin runs what our buffers run.  ALIGNED
    shapes, where torch's fused kernel steps our flat buffer's elements as it steps each parameter's."""
    ours_p, ref_p = _params(dtype, shapes=ALIGNED), _params(dtype, shapes=ALIGNED)
    ours = make_ours(ours_p)
    twin = _twin_flags(ours)
    ref = make_ref(ref_p, twin)
    for step in range(steps):
        for p, q, g in zip(ours_p, ref_p, _grads(ours_p, step)):
            p.grad, q.grad = g.clone(), _twin_grad(g, q)
        ours.step()
        ref.step()
    assert _twin_flags(ours) == twin
    return ours, ours_p, ref_p, twin


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "default")
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=str)
@pytest.mark.parametrize("beta", BETAS)
def test_momentum_beta_equals_sgd_dampening(beta, dtype, backend):
    """``Momentum(beta=b)`` constructs (no round-trip disagreement), shows ``dampening = 1 - b``, and steps
    like ``SGD(dampening=1 - b)``; ``Momentum(dampening=d)`` is ``SGD(dampening=d)`` bit for bit (the twin:
    torch's fused SGD where our buffers run it, the default on the CPU; its single-tensor SGD for eager)."""
    damp = 1.0 - beta
    options = _backend_options(backend)
    ours, ours_p, ref_p, twin = _run(lambda ps: dml_optim.Momentum(ps, lr=0.01, alpha=0.9, beta=beta, **options),
                                     lambda ps, twin: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=damp,
                                                                      **twin),
                                     dtype)
    if backend == "eager":
        assert twin == dict(foreach=False)
    group = ours.param_groups[0]
    assert group["beta"] == beta and group["dampening"] == damp  # both names, each as given or derived
    # eager: SGD's gradient factor is 1 - (1 - b), which differs from b by at most 2**-53 (one rounding of
    # 1 - b; the subtraction from 1 is then exact): the buffer and the parameters drift apart by at most
    # steps * 2**-53 / b relative (float32 rounds both factors to the same float).  Fused: our kernel call
    # gets dampening = 1 - b, the very float the twin gets, and computes 1 - dampening as torch's does: exact
    bound = 30 * 2 * 2**-53 / beta if dtype == torch.float64 and not twin.get("fused") else 0.0
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=bound, atol=bound)
    ours, ours_p, ref_p, twin = _run(lambda ps: dml_optim.Momentum(ps, lr=0.01, alpha=0.9, dampening=damp, **options),
                                     lambda ps, twin: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=damp,
                                                                      **twin),
                                     dtype)
    assert ours.param_groups[0]["dampening"] == damp
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), **EXACT)


@pytest.mark.parametrize("beta", BETAS)
def test_momentum_beta_and_dampening_given_together_agree(beta):
    """Both names, consistent: kept as given; a scheduler writing either name later takes effect."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = dml_optim.Momentum(p, lr=0.01, beta=beta, dampening=1.0 - beta)
    assert opt.param_groups[0]["beta"] == beta and opt.param_groups[0]["dampening"] == 1.0 - beta
    opt.param_groups[0]["dampening"] = 0.25
    p[0].grad = torch.ones(3)
    opt.step()
    assert opt.param_groups[0]["beta"] == 0.75
    with pytest.raises(TypeError, match="disagree"):
        dml_optim.Momentum(p, lr=0.01, beta=0.6, dampening=0.5)


@pytest.mark.parametrize("ours, theirs", [(1e-16, 8e-16), (0.0, 5e-16), (3e-20, 3.1e-20)])
def test_a_one_to_one_alias_given_two_different_small_values_is_refused(ours, theirs):
    """The tolerance that lets ``beta = 1 - dampening`` read back is in ulps of the values involved,
    not an absolute 1e-15: ``eps`` and ``epsilon`` that differ 8x are a contradiction."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises((TypeError, ValueError), match="disagree"):
        dml_optim.Adagrad(p, lr=0.1, epsilon=ours, eps=theirs)
    opt = dml_optim.Adagrad(p, lr=0.1, epsilon=theirs, eps=theirs)
    with pytest.raises((TypeError, ValueError), match="disagree"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "epsilon": ours, "eps": theirs})


# -- deepcopy and pickling ------------------------------------------------------------------------------

#: The optimizers with a torch.optim twin: these tests step ours beside torch's (Lion has none; its copies and
#: hooks run the same base-class code as every other optimizer's)
TWINNED = sorted(name for name, e in ENTRIES.items() if e.torch_class is not None)


def _twin_hyper(name):
    """The matrix's default variant of ``name`` and its torch twin keywords (all have an exact twin)."""
    e = ENTRIES[name]
    v = next(v for v in e.variants if e.twin_kwargs(v.hyper) is not None)
    return dict(v.hyper), e.twin_kwargs(v.hyper), e.torch_class


def _dtype(name):
    """The widest dtype of ``name`` in the matrix (DmlAdam: float32; DirectML has no float64)."""
    return ENTRIES[name].dtypes[0]


def _model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


COPIES = {
    "deepcopy-together": lambda m, o: copy.deepcopy((m, o)),
    "pickle-together": lambda m, o: _pickled((m, o)),
}


def _pickled(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("name", TWINNED)
def test_copied_with_its_model_steps_like_the_twin_copied_the_same_way(name, how):
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    dtype = _dtype(name)
    ours_m, ref_m = _model(dtype=dtype), _model(dtype=dtype)
    ours = registry.build(name, ours_m.parameters(), atomic=True, checks="fast", **hyper)
    ours.note = "kept"
    ref = torch_cls(ref_m.parameters(), foreach=False, **twin_kwargs)
    _train(ours_m, ours, 3, seed=1)
    _train(ref_m, ref, 3, seed=1)
    before = [p.detach().clone() for p in ours_m.parameters()]
    before_state = copy.deepcopy(ours.state_dict())
    (ours_m2, ours2), (ref_m2, ref2) = COPIES[how](ours_m, ours), COPIES[how](ref_m, ref)
    assert (ours2.atomic, ours2.checks, ours2.pack_via, ours2.note) == (True, "fast", ours.pack_via, "kept")
    _train(ours_m2, ours2, 4, seed=2)
    _train(ref_m2, ref2, 4, seed=2)
    for p, q in zip(ours_m2.parameters(), ref_m2.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL[dtype])
    # the copy stepped its own parameters: the original's are untouched, and so is its state
    for p, b in zip(ours_m.parameters(), before):
        assert torch.equal(p.detach(), b)
    for k, entry in before_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours.state_dict()["state"][k][key], value), (k, key)
    # and the original still steps like the twin's original
    _train(ours_m, ours, 2, seed=3)
    _train(ref_m, ref, 2, seed=3)
    for p, q in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL[dtype])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", TWINNED)
def test_copied_alone_steps_its_own_parameters_like_the_twin(name, how):
    """``copy.deepcopy(opt)`` alone copies the parameters too (as torch.optim's does): the copy
    steps the copies, the original and its parameters are untouched."""
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    dtype = _dtype(name)
    ours_m, ref_m = _model(dtype=dtype), _model(dtype=dtype)
    ours = registry.build(name, ours_m.parameters(), **hyper)
    ref = torch_cls(ref_m.parameters(), foreach=False, **twin_kwargs)
    _train(ours_m, ours, 2, seed=1)
    _train(ref_m, ref, 2, seed=1)
    before = [p.detach().clone() for p in ours_m.parameters()]
    dup = copy.deepcopy if how == "deepcopy" else _pickled
    ours2, ref2 = dup(ours), dup(ref)
    ours_ps = [p for g in ours2.param_groups for p in g["params"]]
    ref_ps = [p for g in ref2.param_groups for p in g["params"]]
    for step in range(3):
        for p, q, g in zip(ours_ps, ref_ps, _grads(ours_ps, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours2.step()
        ref2.step()
    for p, q in zip(ours_ps, ref_ps):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL[dtype])
    for p, b in zip(ours_m.parameters(), before):
        assert torch.equal(p.detach(), b)


# -- the four state-dict hooks ------------------------------------------------------------------------


def _hook_log(opt, log):
    opt.register_state_dict_pre_hook(lambda o: log.append("state_dict pre"))
    opt.register_state_dict_pre_hook(lambda o: log.append("state_dict pre (prepended)"), prepend=True)

    def post(o, sd):
        log.append("state_dict post")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.125) for g in sd["param_groups"]]
        return sd  # the hook's result is what state_dict() returns

    opt.register_state_dict_post_hook(post)

    def load_pre(o, sd):
        log.append("load pre")
        sd["param_groups"] = [dict(g, lr=0.25) for g in sd["param_groups"]]
        return sd  # the hook's result is what gets loaded

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: log.append(f"load post lr={o.param_groups[0]['lr']}"))


@pytest.mark.parametrize("name", TWINNED)
def test_the_four_state_dict_hooks_run_where_torch_runs_them(name):
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    ours_m, ref_m = _model(dtype=_dtype(name)), _model(dtype=_dtype(name))
    ours = registry.build(name, ours_m.parameters(), **hyper)
    ref = torch_cls(ref_m.parameters(), foreach=False, **twin_kwargs)
    logs = {}
    for key, opt in (("ours", ours), ("torch", ref)):
        log = logs[key] = []
        _hook_log(opt, log)
        sd = opt.state_dict()
        assert sd["param_groups"][0]["lr"] == 0.125
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.25
    assert logs["ours"] == logs["torch"] == [
        "state_dict pre (prepended)", "state_dict pre", "state_dict post", "load pre", "load post lr=0.25"]


@pytest.mark.parametrize("name", TWINNED)
def test_step_hooks_and_global_step_hooks_run_like_torchs(name):
    """The per-optimizer and the global (``torch.optim.optimizer``) step hooks, in torch's order, with the
    step's parameters already updated when the post hooks run."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    logs = {}
    for key, make in (("ours", lambda ps: registry.build(name, ps, **hyper)),
                      ("torch", lambda ps: torch_cls(ps, foreach=False, **twin_kwargs))):
        model = _model(dtype=_dtype(name))
        opt = make(model.parameters())
        first = next(model.parameters())
        log = logs[key] = []
        before = first.detach().clone()
        handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: log.append("global pre")),
            register_optimizer_step_post_hook(lambda o, a, k: log.append("global post")),
            opt.register_step_pre_hook(lambda o, a, k: log.append(f"pre changed={not torch.equal(first, before)}")),
            opt.register_step_post_hook(lambda o, a, k: log.append(f"post changed={not torch.equal(first, before)}")),
        ]
        try:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        finally:
            for h in handles:
                h.remove()
        opt.step()  # removed: nothing more is logged
    assert logs["ours"] == logs["torch"] == ["global pre", "pre changed=False", "post changed=True", "global post"]


def test_a_step_pre_hook_rewrites_the_call_and_a_bad_result_raises_like_torchs():
    """A pre hook returning ``(args, kwargs)`` replaces the call (here: adds a closure), and one returning
    anything else raises torch's RuntimeError before the step writes anything."""
    results = {}
    for key, cls in (("ours", dml_optim.AdamW), ("torch", torch.optim.AdamW)):
        model = _model(dtype=torch.float64)
        opt = cls(model.parameters(), lr=0.1, **({} if key == "ours" else {"foreach": False}))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        called = []
        handle = opt.register_step_pre_hook(lambda o, a, k: (a, {"closure": lambda: called.append(1) or 7.0}))
        loss = opt.step()
        handle.remove()
        before = [p.detach().clone() for p in model.parameters()]
        handle = opt.register_step_pre_hook(lambda o, a, k: "not a tuple")
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            opt.step()
        handle.remove()
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        results[key] = (loss, called, [p.detach().clone() for p in model.parameters()])
    assert results["ours"][:2] == results["torch"][:2] == (7.0, [1])
    for a, b in zip(results["ours"][2], results["torch"][2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _one_step_log(opt, p):
    """What one step's hooks saw: each hook's name with the args and kwargs it was given."""
    log = []
    handles = [opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", a, k))),
               opt.register_step_post_hook(lambda o, a, k: log.append(("post", a, k)))]
    p.grad = torch.ones(4)
    opt.step()
    for h in handles:
        h.remove()
    return log


def _decorated(step):
    @functools.wraps(step)  # (copies step's attributes: ``hooked`` included, so torch does not wrap it again)
    def logged(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        return step(self, *args, **kwargs)
    return logged


def test_a_subclass_or_patched_step_runs_each_hook_once_per_step(monkeypatch):
    """However a subclass's ``step`` reaches ours (an override that torch wraps, a ``functools.wraps``
    decorator, the class patched after construction), every hook runs once a step, given ``(opt,)`` and ``{}``
    as torch.optim's are, and the step equals a plain AdamW's."""
    class Override(dml_optim.AdamW):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().step(closure)

    class Decorated(dml_optim.AdamW):
        step = _decorated(dml_optim.AdamW.step)

    class Patched(dml_optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    def run(cls, patch=False):
        p = torch.nn.Parameter(torch.ones(4))
        opt = cls([p], lr=0.1)
        if patch:  # (after construction: torch's wrapper of the class's step is what gets decorated)
            monkeypatch.setattr(cls, "step", _decorated(cls.step))
        return opt, p, [_one_step_log(opt, p) for _ in range(2)]

    plain, p_plain, plain_log = run(dml_optim.AdamW)
    twin_p = torch.nn.Parameter(torch.ones(4))
    twin = torch.optim.AdamW([twin_p], lr=0.1, foreach=False)
    assert _one_step_log(twin, twin_p) == [("pre", (twin,), {}), ("post", (twin,), {})]
    assert plain_log == [[("pre", (plain,), {}), ("post", (plain,), {})]] * 2
    for cls, patch in ((Override, False), (Decorated, False), (Patched, True)):
        opt, p, log = run(cls, patch)
        assert log == [[("pre", (opt,), {}), ("post", (opt,), {})]] * 2, cls.__name__
        assert getattr(opt, "calls", 2) == 2 and torch.equal(p, p_plain), cls.__name__


def test_the_step_range_is_seen_by_the_profiler_and_trace_observers_without_torchs_context_manager(
        monkeypatch, tmp_path):
    """The step is the range ``Optimizer.step#AdamW.step`` under ``torch.profiler`` and for an execution-trace
    observer, as torch.optim's is; it is entered without ``record_function`` (torch.optim's wrapper enters that
    context manager every step: about 15 us on the 2-core VM, profiler or not)."""
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = dml_optim.AdamW([p], lr=0.1)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#AdamW.step" in {e.name for e in prof.events()}
    observer = torch.profiler.ExecutionTraceObserver()
    path = tmp_path / "trace.json"
    observer.register_callback(str(path))
    observer.start()
    try:
        opt.step()
    finally:
        observer.stop()
        observer.unregister_callback()
    assert "Optimizer.step#AdamW.step" in path.read_text()
    entered = []
    real = torch.autograd.profiler.record_function

    def spy(*args, **kwargs):
        entered.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", spy)
    opt.step()
    assert entered == []
    twin = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1, foreach=False)
    twin.param_groups[0]["params"][0].grad = torch.ones(4)
    twin.step()
    assert entered == [("Optimizer.step#AdamW.step",)]  # (the spy sees what torch's wrapper enters)


# -- named parameters, duplicates, torch's keys, checkpoints both ways -----------------------------------


def _torch_takes_names() -> bool:
    try:
        torch.optim.SGD([("w", torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("name", sorted(TWINS))
def test_named_parameters_are_taken_and_saved_like_torch(name):
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    ours_m, ref_m = _model(), _model()
    ours = registry.build(name, ours_m.named_parameters(), **hyper)
    names = [n for n, _ in ours_m.named_parameters()]
    assert ours.param_groups[0]["param_names"] == names
    assert ours.param_groups[0]["params"] == list(ours_m.parameters())
    _train(ours_m, ours, 2, seed=1)
    sd = ours.state_dict()
    assert sd["param_groups"][0]["param_names"] == names
    if not _torch_takes_names():
        pytest.skip(f"torch {torch.__version__} has no named parameters (torch >= 2.6): ours is checked above")
    ref = torch_cls(ref_m.named_parameters(), foreach=False, **twin_kwargs)
    _train(ref_m, ref, 2, seed=1)
    assert ref.state_dict()["param_groups"][0]["param_names"] == names
    for p, q in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL[torch.float64])
    # a named checkpoint loads into an unnamed optimizer and gives it the names, as torch's does
    plain = registry.build(name, _model().parameters(), **hyper)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["param_names"] == names


def test_a_parameter_listed_twice_in_a_group_warns_like_torch_and_is_kept_once():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt = dml_optim.AdamW([p, q, p])
    assert opt.param_groups[0]["params"] == [p, q]
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        named = dml_optim.SGD([("a", p), ("b", q), ("a2", p)], lr=0.1)
    assert named.param_groups[0]["param_names"] == ["a", "b"]


@pytest.mark.parametrize("name", sorted(TWINS))
def test_param_groups_and_defaults_carry_torchs_keys_with_torchs_values(name):
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    ours = registry.build(name, _model().parameters(), **hyper)
    ref = torch_cls(_model().parameters(), **twin_kwargs)
    for key, value in ref.defaults.items():
        assert key in ours.defaults and key in ours.param_groups[0], key
        assert ours.defaults[key] == value, (key, ours.defaults[key], value)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_checkpoints_load_in_either_library_without_a_warning(name):
    hyper, twin_kwargs, torch_cls = _twin_hyper(name)
    ours_m, ref_m = _model(), _model()
    ours = registry.build(name, ours_m.parameters(), **hyper)
    ref = torch_cls(ref_m.parameters(), foreach=False, **twin_kwargs)
    _train(ours_m, ours, 3, seed=1)
    _train(ref_m, ref, 3, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        into_torch = torch_cls(_model().parameters(), foreach=False, **twin_kwargs)
        into_torch.load_state_dict(_pickled(ours.state_dict()))
        into_ours = registry.build(name, _model().parameters(), **hyper)
        into_ours.load_state_dict(_pickled(ref.state_dict()))
    for a, b in ((into_torch, ref), (into_ours, ours)):
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        for k in sb:
            for key in sb[k]:
                if key in sa[k] and key != "step":
                    torch.testing.assert_close(sa[k][key], sb[k][key], **TOL[torch.float64])


def test_foreach_fused_are_kept_and_differentiable_and_the_rule_flag_refused():
    p = [torch.nn.Parameter(torch.ones(2))]
    opt = dml_optim.AdamW(p, foreach=True, fused=False)
    assert (opt.param_groups[0]["foreach"], opt.param_groups[0]["fused"]) == (True, False)
    with pytest.raises(TypeError, match="differentiable=True"):
        dml_optim.SGD(p, differentiable=True)
    if "decoupled_weight_decay" in opt.defaults:
        opt.param_groups[0]["decoupled_weight_decay"] = False
        p[0].grad = torch.ones(2)
        with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
            opt.step()


def test_complex_parameters_are_refused_with_the_reason():
    """Chosen: refused (docs/design.md §5): DirectML has no view_as_real/view_as_complex kernel, so a
    complex parameter cannot be a view of a real flat buffer there; the message says what to do."""
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    for cls in (dml_optim.AdamW, dml_optim.SGD, dml_optim.Adagrad):
        with pytest.raises(TypeError, match=r"complex.*view_as_real.*torch\.view_as_complex"):
            cls([p], lr=0.1)


def test_nesterov_needs_momentum_and_zero_dampening_as_in_torch():
    p = [torch.nn.Parameter(torch.ones(2))]
    for kw in (dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)):
        with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
            dml_optim.SGD(p, lr=0.1, **kw)
        with pytest.raises(ValueError):
            torch.optim.SGD(p, lr=0.1, **kw)


def test_sgd_defaults_are_torchs():
    import inspect

    ours = {k: v.default for k, v in inspect.signature(dml_optim.SGD).parameters.items()
            if v.default is not inspect.Parameter.empty}
    theirs = {k: v.default for k, v in inspect.signature(torch.optim.SGD).parameters.items()
              if v.default is not inspect.Parameter.empty}
    for key, value in theirs.items():
        if key == "lr" and not isinstance(value, float):
            continue  # very old torch: lr required
        assert key in ours and ours[key] == value and math.isclose(float(ours[key] or 0), float(value or 0)), key


_AWKWARD = (0.0, 0.05, 0.1, 0.2, 0.3, 0.7, 0.9, 0.95, 0.999, 1.0, 1e-3, 3e-8)


def _valid(h):
    out = []
    for v in _AWKWARD:
        try:
            out.append(h.check(v))
        except (TypeError, ValueError):
            pass
    return out


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_every_torch_alias_takes_every_valid_value_under_both_names(name):
    """The audit of issue 22, item 1, as a test: for every alias (``betas``, ``dampening``, ``lr_decay``,
    ``eps``, ``weight_decay``, ``momentum``, ``nesterov``), values whose conversion is not exact in
    floating point are taken under our name, under torch's, and under both, and a step with the
    torch name written back as read changes nothing of ours."""
    cls = registry.get(name)
    dtype = _dtype(name)
    for alias in cls.spec.torch.aliases:
        hs = [cls.spec.hyperparameter(n) for n in alias.ours]
        if any(h.kind != "float" for h in hs):
            continue
        for v in _valid(hs[0]):
            ours = dict.fromkeys(alias.ours, v) if len(hs) == 1 else {alias.ours[0]: v, alias.ours[1]: _valid(hs[1])[-1]}
            hyper = {"lr": 0.01, **ours}
            p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
            opt = registry.build(name, [p], **hyper)
            group = opt.param_groups[0]
            theirs = group[alias.torch]
            assert all(group[n] == ours[n] for n in alias.ours), (alias.torch, v)
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=dtype))], alias.torch: theirs,
                                 **ours})  # both names, consistent: accepted
            group[alias.torch] = theirs  # a scheduler writing back what it read
            p.grad = torch.ones(3, dtype=dtype)
            opt.step()
            assert all(group[n] == ours[n] for n in alias.ours), (alias.torch, v)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_old_sgd_checkpoint_with_momentum_buffer_none_loads_like_torch(momentum):
    """torch.optim.SGD before 2.3 saved ``momentum_buffer: None`` (no buffer yet); torch loads it as a
    fresh buffer, and the next step is a first step: ours too, bit for bit."""
    sd = {"state": {0: {"momentum_buffer": None}},
          "param_groups": [{"lr": 0.1, "momentum": momentum, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                            "maximize": False, "foreach": None, "differentiable": False, "fused": None, "params": [0]}]}
    results = []
    for make in (lambda ps: dml_optim.SGD(ps, lr=0.1, momentum=momentum),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum, foreach=False)):
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = make([p])
        opt.load_state_dict(copy.deepcopy(sd))
        for k in range(3):
            p.grad = torch.full_like(p, k + 1.0)
            opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("build, words", [
    (lambda p: dml_optim.Adagrad(p, weight_decay=-1), ("weight_decay=-1", "norm_coefficient")),
    (lambda p: dml_optim.Adagrad(p, lr_decay=-1), ("lr_decay=-1", "decay_factor")),
    (lambda p: dml_optim.Adagrad(p, eps=-1e-3), ("eps=-0.001", "epsilon")),
    (lambda p: dml_optim.Momentum(p, lr=0.1, momentum=-0.5), ("momentum=-0.5", "alpha")),
    (lambda p: dml_optim.AdamW(p, betas=(1.5, 0.9)), ("betas=(1.5, 0.9)", "beta1")),
])
def test_a_bad_value_given_by_torchs_name_is_named_by_it(build, words):
    """torch's error type, and the keyword the caller wrote in the message (then ours, for the rule)."""
    with pytest.raises(ValueError) as info:
        build([torch.nn.Parameter(torch.zeros(2))])
    assert all(w in str(info.value) for w in words), info.value


_PARAM_LIST_CHANGES = {
    "append": lambda ps, new: ps.append(new),
    "extend": lambda ps, new: ps.extend([new]),
    "insert": lambda ps, new: ps.insert(0, new),
    "pop": lambda ps, new: ps.pop(),
    "replace": lambda ps, new: ps.__setitem__(0, torch.nn.Parameter(ps[0].detach().clone())),
    "del": lambda ps, new: ps.__delitem__(-1),
    "+=": lambda ps, new: ps.__iadd__([new]),
}


@pytest.mark.parametrize("how", sorted(_PARAM_LIST_CHANGES))
@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_a_params_list_changed_in_place_is_refused_not_ignored(how, backend):
    """torch.optim reads ``param_groups[i]['params']`` at every step; ours packed it once, so a parameter appended
    to it was never trained and a removed one kept stepping (found by a review).  Now the next step, ``zero_grad``
    and ``state_dict`` refuse, naming what changed, and nothing is written."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = dml_optim.AdamW(model.parameters(), lr=1e-2, backend=backend)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    extra = torch.nn.Parameter(torch.randn(4))
    extra.grad = torch.ones(4)
    before = [p.detach().clone() for p in model.parameters()]
    saved = opt.state_dict()
    _PARAM_LIST_CHANGES[how](opt.param_groups[0]["params"], extra)
    for call in (opt.step, opt.zero_grad, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] was changed after it was packed"):
            call()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(extra, extra.detach())  # (untouched)


def test_params_lists_that_did_not_really_change_are_taken_and_copies_start_unchanged():
    model = torch.nn.Linear(4, 2)
    opt = dml_optim.AdamW(model.parameters(), lr=1e-2)
    group = opt.param_groups[0]
    group["params"][0] = group["params"][0]  # the same parameter at the same place
    group["params"] = list(group["params"])  # an equal plain list
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert type(group["params"]).__name__ == "ParamList" and not group["params"].changed
    twin = copy.deepcopy(opt)  # (a copy is built whole, not appended to)
    assert not twin.param_groups[0]["params"].changed
    twin.step()
    opt.param_groups.append({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1.0})
    with pytest.raises(RuntimeError, match="add groups with add_param_group"):
        opt.step()


# torch.optim keeps a setting given as a tensor in the group (``lr=torch.tensor(1e-2)``, ``betas`` of two
# tensors), so that writing into that tensor (``lr.fill_(x)``: the caller's schedule, or a scheduler's on a
# tensor lr) takes effect at the next step.  Ours validates settings into numbers; it once did not see such a
# write and kept stepping with the first value (off by 9e-2 after two steps).

_TENSOR_SETTINGS = {
    "lr_in_constructor": (lambda ps, t: dict(params=ps, lr=t[0]), lambda t, i: t[0].fill_(0.05 * (i + 1))),
    "lr_in_a_group": (lambda ps, t: dict(params=[{"params": ps, "lr": t[0]}], lr=1e-3),
                      lambda t, i: t[0].fill_(0.05 * (i + 1))),
    "lr_and_betas": (lambda ps, t: dict(params=ps, lr=t[0], betas=(t[1], t[2])),
                     lambda t, i: (t[0].mul_(0.5), t[1].fill_(0.8 - 0.1 * i))),
}


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("how", sorted(_TENSOR_SETTINGS))
def test_a_setting_given_as_a_tensor_and_written_in_place_is_followed_like_torch(how, backend):
    build, write = _TENSOR_SETTINGS[how]
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    tensors = [[torch.tensor(0.1), torch.tensor(0.9), torch.tensor(0.999)] for _ in range(2)]
    ours = dml_optim.AdamW(**build(ours_p, tensors[0]), weight_decay=0.1, backend=backend)
    ref = torch.optim.AdamW(**build(ref_p, tensors[1]), weight_decay=0.1, foreach=False)
    for i in range(4):
        for ps, opt in ((ours_p, ours), (ref_p, ref)):
            for k, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (k + 1)).sin_()
            opt.step()
        for p, q in zip(ours_p, ref_p):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        # (the group reads back the number the step validated from the tensor, torch's the tensor itself)
        assert float(ours.param_groups[-1]["lr"]) == pytest.approx(float(tensors[0][0]))
        write(tensors[0], i)
        write(tensors[1], i)


def test_a_tensor_lr_replaced_by_a_number_is_no_longer_followed():
    """Assigning ``group["lr"]`` (a scheduler with a number) ends the watch: a later write into the old tensor
    changes nothing, as in torch.optim, whose group no longer holds it."""
    p = torch.nn.Parameter(torch.ones(4))
    lr = torch.tensor(0.1)
    opt = dml_optim.SGD([p], lr=lr)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    lr.fill_(100.0)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((4,), 1.0 - 0.1 - 0.5))
