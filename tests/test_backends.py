"""The eager, compiled and fused backends (dml_optim/backends/choose.py, dml_optim/backends/compiled.py, dml_optim/backends/fused.py).

Every optimizer's agreement with the float64 reference, eager and compiled,
with a learning rate that changes every step, is the test matrix's
(``tests/test_optimizers.py``); the cases here come from the matrix too
(``tests/matrix.py``).  This file holds what is particular to a backend:
fallbacks and their warnings, ``auto`` (fused on the CPU where torch's kernel
runs the buffer; otherwise eager, compiled by size, or compiled once the eager
steps took a compile's time), graph reuse (no recompilation for a scheduler,
instances, epsilons or lengths), dispatch modes, the caller's denormal mode,
``capturable``, and the compiled kernel's float64 coefficients.
Compilation is real (inductor on this machine's C++ compiler); the first
compile on a fresh machine costs 10-40 s once (inductor's ISA probe), then a
few seconds per kernel.
"""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

import dml_optim
from dml_optim import testing
from dml_optim.backends import choose as backends, compiled
from dml_optim.backends import eager as eager_backend
from dml_optim.backends.compiled import CompileFallbackWarning
from dml_optim.core.opcount import OpRecorder
from introspect import buffers
from matrix import ENTRIES, case_of, classes
from tolerances import TOL, assert_close

COMPILE_OK, COMPILE_WHY = compiled.compile_available("cpu")
needs_compiler = pytest.mark.skipif(not COMPILE_OK, reason=f"torch.compile unavailable on this CPU: {COMPILE_WHY}")

SHAPES = [(17, 5), (33,), (4, 3, 2)]

#: the matrix's default Adam and Momentum in float32: the compiled graph of their first group is the one
#: the matrix's compiled cases build (one compile serves both files)
ADAM = case_of("adam", dtype=torch.float32)
MOMENTUM = case_of("momentum", dtype=torch.float32)


def _params(seed: int = 1) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


@pytest.fixture
def no_fallback_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        yield


@pytest.mark.slow
@needs_compiler
def test_no_recompilation_with_a_scheduler(no_fallback_warnings):
    params, ref_params = _params(), _params()
    opt = ADAM.build(params, backend="compiled")  # the matrix's hyperparameters: its graph is reused
    ref = ADAM.build(ref_params, backend="eager")
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.97**s) for o in (opt, ref)]
    gen = torch.Generator().manual_seed(3)

    def step():
        G = [torch.randn(s, generator=gen) for s in SHAPES]
        for ps in (params, ref_params):
            for p, g in zip(ps, G):
                p.grad = g.clone()
        for o, s in zip((opt, ref), scheds):
            o.step()
            s.step()

    for _ in range(2):  # warm-up: compiles (or loads) the graph
        step()
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    lrs = set()
    for _ in range(12):
        lrs.add(opt.param_groups[0]["lr"])
        step()
    assert len(lrs) == 12  # the scheduler really changed lr every step
    assert counters["frames"]["total"] == frames, "dynamo compiled a new frame after warm-up"
    assert counters["stats"]["unique_graphs"] == graphs, "a new graph was compiled after warm-up"
    for p, r in zip(params, ref_params):  # ... and the new lr values were used
        assert_close(p.detach(), r.detach())


@pytest.mark.slow
@needs_compiler
def test_compiled_skip_on_overflow_matches_eager(no_fallback_warnings):
    """The gated path (0-d tensor constants) compiles too, and an overflow changes nothing."""
    runs = {}
    for backend in ("eager", "compiled"):
        params = _params()
        opt = dml_optim.Adam(params, lr=1e-2, backend=backend, nonfinite="skip")
        gen = torch.Generator().manual_seed(4)
        for k in range(6):
            G = [torch.randn(s, generator=gen) for s in SHAPES]
            if k == 3:
                G[1][5] = float("inf")
                before = [p.detach().clone() for p in params]
            for p, g in zip(params, G):
                p.grad = g.clone()
            opt.step()
            if k == 3:
                for p, b in zip(params, before):
                    assert torch.equal(p.detach(), b)
        runs[backend] = [p.detach().clone() for p in params]
        if backend == "compiled":
            assert opt.resolved_backends() == [["compiled"]]
    for c, e in zip(runs["compiled"], runs["eager"]):
        assert_close(c, e)


@pytest.fixture
def isolated_cache():
    """A private compile cache, so an injected failure cannot leak into other tests."""
    with testing.isolated_kernel_cache():
        yield


@pytest.fixture
def use_compiler():
    """``use_compiler(fn)``: the compiled backend compiles with ``fn`` (torch.compile's signature) for the rest of
    the test, in a kernel cache of its own (:func:`dml_optim.testing.compiler`)."""
    with contextlib.ExitStack() as stack:
        yield lambda fn: stack.enter_context(testing.compiler(fn))


def _steps(opt, params, n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.fixture
def kernels_run_eagerly():
    """torch.compile replaced by the identity: the compiled backend runs its kernels' Python code
    (``update.fused_step``) eagerly, in seconds and without a compiler."""
    with testing.compiler(lambda fn, **kwargs: fn):
        yield


#: the kernel's variants: (parameter dtype, options, a step with an inf gradient)
KERNEL_MODES = {
    "plain": (torch.float32, {}, None),
    "float64": (torch.float64, {}, None),  # float64 coefficients: float32 ones would be ~1e-8 off
    "gated-skip": (torch.float32, dict(nonfinite="skip"), 2),
    "capturable": (torch.float32, dict(capturable=True), None),
    "fp16-fp32-compute": (torch.float16, dict(compute_dtype=torch.float32), None),
    "master-weights": (torch.float16, dict(master_weights=True), None),
    "kahan-gated": (torch.bfloat16, dict(kahan=True, nonfinite="skip"), 1),
}


@pytest.mark.parametrize("mode", sorted(KERNEL_MODES))
@pytest.mark.parametrize("case", [p.values[0] for p in classes(devices=("cpu",))], ids=lambda c: c.name)
def test_the_kernels_python_code_run_eagerly_matches_the_eager_backend(case, mode, kernels_run_eagerly):
    """What torch.compile traces (the kernel's inputs, the gating, the conversions, the master and Kahan
    outputs, the step counter advanced inside the kernel) equals the eager backend, step by step."""
    dtype, options, bad_step = KERNEL_MODES[mode]
    if dtype not in case.cls.dtypes and not options.get("master_weights"):
        pytest.skip(f"{case.cls.__name__} has no {dtype} parameters")
    if options.get("kahan") and not testing.inductor_rounds_casts():
        pytest.skip(f"torch {torch.__version__}'s inductor cannot round intermediate casts (emulate_precision_casts, "
                    "torch >= 2.5): Kahan runs eager there, announced (test_kahan covers that fallback)")
    runs = {}
    for backend in ("compiled", "eager"):
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
        opt = case.build(params, backend=backend, **case.epsilon_kwargs(1e-3), **options)
        for k in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            if k == bad_step:
                params[1].grad[3] = float("inf")
            opt.step()
        runs[backend] = (params, opt)
    (ours, opt), (ref, ref_opt) = runs["compiled"], runs["eager"]
    assert opt.resolved_backends() == [["compiled"]] and opt.compile_fallback is None
    for p, q in zip(ours, ref):
        assert_close(p.detach(), q.detach())
        for name, value in ref_opt.state[q].items():
            assert_close(torch.as_tensor(opt.state[p][name]).double(), torch.as_tensor(value).double(),
                         **TOL[dtype if dtype in (torch.float64, torch.float32) else torch.float16])


def test_compile_failure_falls_back_with_one_warning(use_compiler):
    calls = []

    def broken_compile(fn, **kwargs):
        def raising(*args, **kw):
            calls.append(1)
            raise RuntimeError("injected inductor failure")
        return raising

    use_compiler(broken_compile)
    params, ref_params = _params(), _params()
    opt = dml_optim.Adam(params, lr=1e-2, backend="compiled")
    ref = dml_optim.Adam(ref_params, lr=1e-2, backend="eager")
    with pytest.warns(CompileFallbackWarning, match="injected inductor failure") as record:
        _steps(opt, params, 5)
    assert len([w for w in record if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert calls == [1]  # tried once, then eager for good
    assert "injected inductor failure" in opt.compile_fallback
    assert opt.resolved_backends() == [["eager"]]
    _steps(ref, ref_params, 5)
    for p, r in zip(params, ref_params):
        assert torch.equal(p.detach(), r.detach())  # the fallback is exactly the eager rule

    # a second optimizer does not retry the broken key, but is told once too
    params2 = _params()
    opt2 = dml_optim.Adam(params2, lr=1e-2, backend="compiled")
    with pytest.warns(CompileFallbackWarning, match="injected inductor failure"):
        _steps(opt2, params2, 2)
    assert calls == [1]


def test_compile_unavailable_falls_back_with_one_warning(monkeypatch, isolated_cache):
    monkeypatch.setattr(compiled, "compile_available", lambda device_type: (False, "no C++ compiler found (test)"))
    params = _params()
    opt = dml_optim.Momentum(params, lr=1e-2, backend="compiled")
    with pytest.warns(CompileFallbackWarning, match="no C.. compiler found") as record:
        _steps(opt, params, 3)
    assert len([w for w in record if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert backends.resolve("compiled", "cpu", 1 << 30) == "eager"
    assert backends.resolve("auto", "cpu", 1 << 30) == "eager"


def test_auto_is_eager_for_small_buffers_and_directml():
    small = backends.AUTO_COMPILE_MIN_ELEMENTS["cpu"] - 1
    assert backends.resolve("auto", "cpu", small) == "eager"
    assert backends.resolve("auto", torch.device("cpu"), 4522) == "eager"  # tiny-mlp
    assert backends.resolve("auto", "privateuseone:0", 1 << 30) == "eager"
    assert backends.resolve("auto", torch.device("privateuseone", 0), 1 << 30) == "eager"
    assert backends.resolve("compiled", "privateuseone:0", 1 << 30) == "eager"
    assert backends.resolve("eager", "cpu", 1 << 30) == "eager"
    big = backends.AUTO_COMPILE_MIN_ELEMENTS["cpu"]
    assert backends.resolve("auto", "cpu", big) == ("compiled" if COMPILE_OK else "eager")
    assert backends.resolve("compiled", "cpu", 10) == ("compiled" if COMPILE_OK else "eager")
    with pytest.raises(ValueError, match="backend must be one of .*'fast'"):
        backends.resolve("fast", "cpu", 10)


#: Settings under which torch's fused kernel cannot run a CPU buffer (``dml_optim.backends.fused.unsupported``):
#: ``auto`` chooses between eager and compiled for them as before the fused backend.
#: (optimizer, parameter dtype, options)
NOT_FUSED = {
    "float16-params": ("adam", torch.float16, dict(epsilon=1e-4)),
    "state-dtype": ("adamw", torch.float32, dict(state_dtype=torch.bfloat16)),
    "compute-dtype": ("adamw", torch.float32, dict(compute_dtype=torch.float64)),
    "master-weights": ("adam", torch.float16, dict(master_weights=True)),
    "kahan": ("momentum", torch.bfloat16, dict(kahan=True)),
    "quantized": ("adamw", torch.float32, dict(state_bits=8)),
    "capturable": ("adam", torch.float32, dict(capturable=True)),
    "nonfinite-skip": ("adagrad", torch.float32, dict(nonfinite="skip")),
    "norm-coefficient-post": ("adam", torch.float32, dict(norm_coefficient_post=0.01)),
    "momentum-alpha-0": ("momentum", torch.float32, dict(alpha=0.0)),
}


def _not_fused(which: str, **extra):
    """An optimizer of ``NOT_FUSED[which]`` (backend="auto") over three parameters, with gradients (quantized:
    large enough to get quantized states)."""
    from dml_optim.core.quant import MIN_ELEMENTS

    name, dtype, options = NOT_FUSED[which]
    numel_each = MIN_ELEMENTS if "state_bits" in options else 33
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(numel_each, generator=gen).to(dtype)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(numel_each, generator=gen).to(dtype)
    return params, case_of(name).build(params, backend="auto", **{**options, **extra})


#: The optimizers whose rule names a torch fused CPU kernel (Lion's has none: torch has no Lion).
FUSED_NAMES = [name for name, e in ENTRIES.items() if e.cls.rule.fused is not None]


def test_only_an_optimizer_torch_has_no_kernel_for_lacks_one():
    assert sorted(set(ENTRIES) - set(FUSED_NAMES)) == ["lion"]


def test_auto_runs_an_optimizer_without_a_fused_kernel_eagerly_and_tiers_it():
    """Lion (no torch kernel): ``backend="auto"`` runs a small CPU buffer eagerly, bit for bit
    ``backend="eager"``, and tiers a buffer the eager chain would spend a compile's time on, as any CPU buffer
    torch's fused kernel cannot run."""
    params, ref = _params(), _params()
    opt, twin = dml_optim.Lion(params, lr=1e-3), dml_optim.Lion(ref, lr=1e-3, backend="eager")
    assert opt.resolved_backends() == [["eager"]]
    _steps(opt, params, 3)
    _steps(twin, ref, 3)
    assert all(torch.equal(p, q) for p, q in zip(params, ref))
    big = torch.nn.Parameter(torch.randn(backends.AUTO_TIER_MIN_ELEMENTS["cpu"]))
    tiered = dml_optim.Lion([big], lr=1e-3)
    assert tiered.resolved_backends() == [["eager"]] and tiered.tiering_pending() == COMPILE_OK


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_auto_runs_plain_cpu_buffers_with_torchs_fused_kernel(name):
    """``backend="auto"`` (the default) runs a plain float32 or float64 CPU buffer with torch's fused kernel,
    whatever its size: no eager time is counted (nothing to tier), nothing compiles."""
    for dtype in (torch.float32, torch.float64):
        if dtype not in ENTRIES[name].cls.dtypes:
            continue
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
        opt = ENTRIES[name].cls(params, lr=1e-3)  # backend="auto" is the default
        assert opt.resolved_backends() == [["fused"]]  # (decided before the first step too)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback of any kind
            _steps(opt, params, 2)
        assert opt.resolved_backends() == [["fused"]]
        assert buffers(opt)[0].eager_seconds == 0.0 and not opt.tiering_pending()
    big = torch.nn.Parameter(torch.randn(backends.AUTO_TIER_MIN_ELEMENTS["cpu"]))  # (a size the eager chain tiers)
    opt = ENTRIES[name].cls([big], lr=1e-3)
    assert opt.resolved_backends() == [["fused"]] and not opt.tiering_pending()


@pytest.mark.parametrize("which", [pytest.param(w)
                                   for w in sorted(NOT_FUSED)])
def test_auto_keeps_small_buffers_fused_kernel_cannot_run_eager(which):
    """A small CPU buffer that torch's fused kernel cannot run (another dtype, a precision mode, device-side
    counts, a gated step, a rule no kernel computes) runs the eager chain under ``auto``, without a warning
    (auto chose it), and says so."""
    params, opt = _not_fused(which)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(opt, params, 2)
        for p in params:
            p.grad = torch.randn_like(p)
        recorder = OpRecorder(compiled=True)
        with recorder:
            opt.step()
    assert recorder.ops > 2 and not any(name.startswith("aten::_fused_") for name in recorder.counts())
    assert opt.resolved_backends() == [["eager"]]


@pytest.mark.parametrize("which", ["float16-params", "state-dtype", "norm-coefficient-post", "quantized"])
def test_auto_compiles_large_buffers_fused_kernel_cannot_run(which, kernels_run_eagerly, monkeypatch):
    """From the size threshold on (here lowered: no compile, the kernel's Python runs), ``auto`` compiles a
    buffer torch's fused kernel cannot run, as it did before the fused backend; a plain buffer of the same
    size still runs fused."""
    monkeypatch.setitem(backends.AUTO_COMPILE_MIN_ELEMENTS, "cpu", 64)
    monkeypatch.setitem(backends.AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED, "cpu", 64)
    params, opt = _not_fused(which)
    assert opt.resolved_backends() == [["compiled"]]
    _steps(opt, params, 2)
    assert opt.resolved_backends() == [["compiled"]] and opt.compile_fallback is None
    plain = [torch.nn.Parameter(torch.randn(33)) for _ in range(3)]
    plain_opt = dml_optim.AdamW(plain)
    _steps(plain_opt, plain, 2)
    assert plain_opt.resolved_backends() == [["fused"]]


def test_compiled_on_directml_warns_once_and_runs_eager(isolated_cache, monkeypatch):
    """backend="compiled" on a device torch.compile does not serve: one warning, then eager."""
    params = _params()
    opt = dml_optim.Adam(params, lr=1e-3, backend="compiled")
    monkeypatch.setattr(compiled, "compile_available", lambda device_type: (False, "not on 'privateuseone' (test)"))
    with pytest.warns(CompileFallbackWarning, match="privateuseone") as record:
        _steps(opt, params, 3)
    assert len([w for w in record if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert opt.resolved_backends() == [["eager"]]


def _aten_compute_events(step) -> list[str]:
    """Names of the aten ops a step runs on the host, as the profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return [e.name for e in prof.events() if e.name in ("aten::sqrt", "aten::addcdiv_", "aten::addcmul_", "aten::div")]


@pytest.mark.slow
@needs_compiler
def test_a_dispatch_mode_sees_eager_ops_and_leaves_the_compiled_kernel_intact(no_fallback_warnings):
    """Under a TorchDispatchMode the rule runs eager (the mode sees its ops); afterwards
    the fused kernel runs again (dynamo would otherwise skip the frame for good)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    params = _params()
    opt = ADAM.build(params, backend="compiled")
    _steps(opt, params, 2)
    assert _aten_compute_events(opt.step) == []  # the compiled kernel: no aten compute ops

    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Recorder():
        opt.step()
    assert "aten.sqrt" in seen and "aten.addcmul_" in seen
    assert _aten_compute_events(opt.step) == []  # still compiled after the mode


def test_compiled_buffer_stepped_under_a_dispatch_mode_does_not_resize_its_scratch():
    """Under a TorchDispatchMode the compiled runner uses the eager rule; the compact
    scratch of a compiled buffer must not be resized (warning + allocation each step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.slow
def test_a_compiled_step_leaves_the_callers_denormal_mode_alone():
    """torch 2.4's inductor compiles CPU kernels with -ffast-math; with gcc < 13 loading one
    turned on flush-to-zero for the whole thread (found with torch 2.4.1 + gcc 12: every
    later float op flushed subnormals).  The compiled runner restores the caller's mode."""
    import sys

    def flushed() -> bool:
        return sys.float_info.min * 0.5 == 0.0

    assert not flushed()
    p = torch.nn.Parameter(torch.randn(1000))
    p.grad = torch.randn(1000)
    opt = dml_optim.Adam([p], backend="compiled")
    opt.step()
    opt.step()
    assert not flushed()


# -- the kernel is a pure function of tensors: instances, epsilons and lengths share graphs ----------


@pytest.mark.slow
@needs_compiler
def test_instances_epsilons_and_lengths_reuse_one_graph(no_fallback_warnings):
    """12 optimizers x 3 epsilons x 2 buffer lengths: the kernel compiles a bounded number of
    graphs (the optimizer is not an argument, epsilon is a tensor, lengths are dynamic)."""
    def run(n, eps, seed):
        p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
        opt = dml_optim.Adam([p], lr=1e-3, epsilon=eps, backend="compiled")
        for k in range(2):
            p.grad = torch.full_like(p, 0.1 * (k + 1))
            opt.step()
        return opt

    run(64, 1e-8, 0)  # warm-up: compiles (or loads) the graph of this structure
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    opts = [run(n, eps, i) for i in range(12) for eps in (1e-8, 1e-6, 1e-4) for n in (64, 1000)]
    assert all(o.resolved_backends() == [["compiled"]] for o in opts)
    assert counters["stats"]["unique_graphs"] - graphs <= 1, "graphs were compiled per instance, epsilon or length"
    assert counters["frames"]["total"] - frames <= 1


@pytest.mark.slow
@needs_compiler
def test_a_cpu_kernel_first_compiled_for_a_small_buffer_still_runs_its_loop_on_threads(isolated_cache,
                                                                                       no_fallback_warnings):
    """Inductor decides at compile time, from the first call's length, whether a CPU loop runs on
    OpenMP threads; lengths are dynamic, so without dynamic threads a kernel first compiled for 16
    elements ran every later buffer (resnet50's 25M) on one core.  The code generated for a
    16-element first call must hold a parallel loop."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    p = torch.nn.Parameter(torch.randn(16))
    opt = dml_optim.Momentum([p], lr=0.1, alpha=0.9, beta=1.0, backend="compiled")
    p.grad = torch.ones(16)
    with inductor_config.patch(force_disable_caches=True):  # generate the code, do not load it
        _, code = run_and_get_code(opt.step)
    assert opt.resolved_backends() == [["compiled"]]
    assert code and all("#pragma omp parallel" in c for c in code), code


@pytest.mark.slow
@needs_compiler
def test_compiled_float64_computes_its_coefficients_in_float64(no_fallback_warnings):
    """Each compiled float64 update equals the float64 reference's to float64 tolerance (rtol 1e-10):
    coefficients computed in float32 (``1 - beta**T`` cancels) are off by ~1e-8."""
    case = case_of("adam", dtype=torch.float64, backend="compiled")
    hyper = dict(lr=1e-2, alpha=0.9, beta=0.999, epsilon=1e-8, norm_coefficient=0.0, norm_coefficient_post=0.0)
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    opt = case.build(params, **hyper)
    for k in range(8):
        G = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        before = [p.detach().clone() for p in params]
        states = [[torch.zeros_like(p) if k == 0 else opt.state[p][n].clone() for n in case.states] for p in params]
        for p, g in zip(params, G):
            p.grad = g.clone()
        opt.step()
        for p, b, g, s in zip(params, before, G, states):
            x, _ = case.reference_step(hyper, k, b, g, s)
            assert_close(p.detach() - b, x - b)  # the update itself, to float64's tolerance
    assert opt.resolved_backends() == [["compiled"]]


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("amsgrad", [False, True])
def test_compiled_adamw_matches_torch(amsgrad, no_fallback_warnings):
    gen = torch.Generator().manual_seed(8)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ours_p, ref_p = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
    ours = dml_optim.AdamW(ours_p, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, backend="compiled")
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    for _ in range(10):
        G = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, q, g in zip(ours_p, ref_p, G):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        assert_close(p.detach(), q.detach())
    assert ours.resolved_backends() == [["compiled"]]


@needs_compiler
def test_reaching_the_recompile_limit_is_announced_and_runs_eager(isolated_cache):
    """Past dynamo's recompile limit dynamo would silently run Python: we say so and run eager."""
    with testing.recompile_limit(1):
        _recompile_limit_run()


def _recompile_limit_run():
    params, ref_params = _params(), _params()
    opt = dml_optim.Momentum(params, lr=1e-2, backend="compiled")
    ref = dml_optim.Momentum(ref_params, lr=1e-2, backend="eager")
    with pytest.warns(CompileFallbackWarning, match="recompile limit") as record:
        _steps(opt, params, 4)
    assert len([w for w in record if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert opt.resolved_backends() == [["eager"]]
    _steps(ref, ref_params, 4)
    for p, r in zip(params, ref_params):
        assert_close(p.detach(), r.detach())


# -- capturable -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", pytest.param("compiled", marks=[pytest.mark.slow, needs_compiler])])
@pytest.mark.parametrize("case", [case_of("adam", dtype=torch.float32, variant="adam-norm-coefficients"), MOMENTUM],
                         ids=lambda c: c.variant.id)
def test_capturable_path_matches_the_host_path(case, backend):
    """capturable=True keeps counts and coefficients on the device (what a CUDA graph replays);
    on the CPU the same code path runs, and must equal the host path.  The variant's second
    hyperparameter set: every coefficient nonzero (norm coefficients, epsilon)."""
    runs = []
    for capturable in (False, True):
        params = _params()
        opt = case.build(params, backend=backend, capturable=capturable, **case.second)
        _steps(opt, params, 6)
        runs.append((params, opt))
    (a, oa), (b, ob) = runs
    for p, q in zip(a, b):
        assert_close(q.detach(), p.detach())
    assert [float(s["step"]) for s in ob.state_dict()["state"].values()] == [6.0] * len(SHAPES)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


@needs_cuda
def test_capturing_a_step_that_is_not_capturable_raises():
    p = torch.nn.Parameter(torch.randn(8, device="cuda"))
    opt = dml_optim.Adam([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(graph):
            opt.step()


@needs_cuda
@pytest.mark.parametrize("name", ["adamw", "adam", "momentum"])
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_a_captured_training_step_replays_like_eager(name, backend):
    """A whole training step (forward, backward, step, zero_grad) captured once and replayed
    25 times matches the same steps run eagerly, to float32 tolerance."""
    from dml_optim.optimizers.registry import build

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build(name, m.parameters(), lr=1e-2, capturable=True, backend=backend) for m in models]
    x = torch.randn(64, 16, device="cuda")
    y = torch.randn(64, 4, device="cuda")

    def train_step(model, opt):
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up (and compilation) outside the graph, on both
            for m, o in zip(models, opts):
                train_step(m, o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(models[0], opts[0])
    for _ in range(25):
        graph.replay()
        train_step(models[1], opts[1])
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert_close(p.detach(), q.detach())
    steps = {float(s["step"]) for s in opts[0].state_dict()["state"].values()}
    assert steps == {float(3 + 25)}  # warm-up + replays, counted on the device (capturing runs no kernel)


@pytest.mark.slow
@pytest.mark.parametrize("name,variant,gated", [(n, e.default.id, g) for n, e in ENTRIES.items() for g in (False, True)])
def test_every_compiled_kernel_is_one_graph_without_breaks(name, variant, gated):
    """A graph break splits the "one fused kernel" into several, with Python between them every step (SGD's
    ``momentum != 0`` on a 0-d tensor did: 0.47 ms per step at 16k elements where eager took 0.14).  Each
    optimizer's default variant (the one of every other matrix test; SGD's has momentum), plain and gated,
    compiles to graphs with no break (every variant was checked once by hand: seconds each)."""
    if not compiled.compile_available("cpu")[0]:
        pytest.skip(f"compiled backend unavailable here: {compiled.compile_available('cpu')[1]}")
    compiled.clear_cache()  # fresh code objects: dynamo traces this key anew (inductor's caches stay)
    counters.clear()
    case = case_of(name, variant=variant, backend="compiled")
    ps = [torch.nn.Parameter(torch.randn(4096, dtype=case.dtype)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = case.build([{"params": ps[:2]}, {"params": ps[2:], **case.variant.second}],
                     **({"nonfinite": "skip"} if gated else {}))
    for _ in range(2):
        opt.step()
    assert opt.resolved_backends() == [["compiled"], ["compiled"]]
    assert dict(counters["graph_break"]) == {}


# -- calling a kernel without its dynamo frame ------------------------------------------------------


def _direct_run(direct: bool) -> tuple[list[torch.Tensor], list]:
    """Two groups (two buffer lengths), a scheduler-like lr change, a Kahan-free AdamW: parameters
    after 6 compiled steps, and whether each kernel is called directly (None: untried, False: dynamo's call)."""
    with testing.isolated_kernel_cache(), testing.direct_calls(direct):
        return _direct_steps()


def _direct_steps():
    gen = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 41, 7)]
    opt = dml_optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-2,
                          weight_decay=0.1, backend="compiled")
    for k in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if k == 3:
            opt.param_groups[0]["lr"] = 5e-3
        opt.step()
    return [p.detach().clone() for p in params], [k.direct for k in testing.kernels()]


@needs_compiler
def test_a_verified_direct_call_gives_the_guarded_calls_results_bit_for_bit():
    """A plain kernel is called without its dynamo frame after its first call (once a probe call agreed
    bit for bit with dynamo's): six steps over two buffer lengths and an lr change give exactly what
    dynamo's guarded call gives."""
    guarded, callers = _direct_run(direct=False)
    assert callers and not any(callers)
    direct, callers = _direct_run(direct=True)
    assert callers and all(c is True for c in callers)
    for a, b in zip(direct, guarded):
        assert torch.equal(a, b)


@needs_compiler
def test_a_direct_call_that_disagrees_with_dynamo_is_never_used():
    """If the probe call through the plan differs from dynamo's (a graph whose inputs were placed
    wrongly), the key keeps dynamo's guarded call, and the steps stay right."""
    with testing.direct_call_override(lambda args: args[0].add_(1.0)):
        wrong, callers = _direct_run(direct=True)
    assert callers and all(c is False for c in callers)
    right, _ = _direct_run(direct=False)
    for a, b in zip(wrong, right):
        assert torch.equal(a, b)


@needs_compiler
def test_a_one_element_range_goes_through_dynamo(isolated_cache):
    """dynamo specializes lengths 0 and 1: a one-element buffer never takes the direct call (its
    graph may be another), and a kernel first compiled for one element gets no direct caller."""
    p = torch.nn.Parameter(torch.tensor([0.5]))
    q = torch.nn.Parameter(p.detach().clone())
    opt = dml_optim.Adagrad([p], lr=0.1, backend="compiled")
    ref = dml_optim.Adagrad([q], lr=0.1, backend="eager")
    for k in range(3):
        p.grad, q.grad = torch.tensor([0.1 * (k + 1)]), torch.tensor([0.1 * (k + 1)])
        opt.step()
        ref.step()
    assert [k.direct for k in testing.kernels()] == [False]
    torch.testing.assert_close(p.detach(), q.detach())


# -- auto: compile a smaller buffer once its eager steps cost what a compile does ------------------------


#: A CPU buffer torch's fused kernel cannot run (the rule computed in float64 for float32 parameters): the
#: ``auto`` backend tiers it (eager, then compiled), as every CPU buffer before the fused backend.
TIERED = dict(compute_dtype=torch.float64)


@pytest.mark.slow
@needs_compiler
def test_auto_compiles_a_smaller_cpu_buffer_after_running_eagerly_for_a_compiles_time(monkeypatch):
    """Below the size threshold ``auto`` starts a buffer the fused kernel cannot run eager, counts the eager
    steps' time, and compiles the buffer once that reaches ``AUTO_COMPILE_AFTER_EAGER_S``: the steps before
    and after follow the eager twin.  The eager backend's clock is replaced by one where every eager step
    takes 2 ms (one tick between its two clock reads), so the switch comes after the tenth step whatever
    the machine's load."""
    monkeypatch.setitem(backends.AUTO_COMPILE_AFTER_EAGER_S, "cpu", 0.02)
    ticks = iter(range(1 << 20))
    monkeypatch.setattr(eager_backend, "time", SimpleNamespace(perf_counter=lambda: 0.002 * next(ticks)))
    n = backends.AUTO_TIER_MIN_ELEMENTS["cpu"]
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = dml_optim.AdamW([p], lr=1e-3, **TIERED), dml_optim.AdamW([q], lr=1e-3, backend="eager", **TIERED)
    seen = []
    for _ in range(400):
        g = torch.randn(n, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        seen.append(opt.resolved_backends()[0][0])
        if seen[-1] == "compiled" and seen.count("compiled") > 3:
            break
    # ten eager steps of 2 ms reach the 20 ms: the eleventh step runs compiled
    assert seen.index("compiled") == 10 and seen[-1] == "compiled", seen[:12]
    assert not opt.tiering_pending()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_small_and_quantized_buffers_never_tier():
    """A buffer under ``AUTO_TIER_MIN_ELEMENTS`` (or with quantized states, which compile from their own
    threshold) is not timed and stays eager however long it runs (buffers the fused kernel cannot run:
    a plain one runs fused)."""
    small = backends.AUTO_TIER_MIN_ELEMENTS["cpu"] - 1
    assert not backends.tiers("cpu", small, False) and not backends.tiers("cpu", 1 << 15, True)
    assert backends.resolve("auto", "cpu", small, eager_s=1e9) == "eager"
    for options in (TIERED, dict(state_bits=8)):
        p = torch.nn.Parameter(torch.randn(small if "state_bits" not in options else 1 << 15))
        p.grad = torch.randn_like(p)
        opt = dml_optim.Adam([p], **options)
        for _ in range(3):
            opt.step()
        assert opt.resolved_backends() == [["eager"]], options
        assert buffers(opt)[0].eager_seconds == 0.0 and not opt.tiering_pending(), options


def test_a_buffer_that_tiers_is_pending_until_it_compiles(monkeypatch):
    """``tiering_pending``: a buffer the fused kernel cannot run, from ``AUTO_TIER_MIN_ELEMENTS`` on, runs eager
    and counts its time until that reaches ``AUTO_COMPILE_AFTER_EAGER_S``; then it resolves compiled (not run
    here: resolving compiles nothing)."""
    monkeypatch.setattr(compiled, "compile_available", lambda device_type: (True, ""))
    n = backends.AUTO_TIER_MIN_ELEMENTS["cpu"]
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = dml_optim.AdamW([p], **TIERED)
    opt.step()
    spent = buffers(opt)[0].eager_seconds
    assert spent > 0 and opt.tiering_pending()
    assert opt.resolved_backends() == [["eager"]]
    monkeypatch.setitem(backends.AUTO_COMPILE_AFTER_EAGER_S, "cpu", spent)  # (its time reaches the threshold)
    assert opt.resolved_backends() == [["compiled"]] and not opt.tiering_pending()


def test_the_eager_time_survives_a_repack():
    """Unfreezing re-packs the group into new buffers; the time already spent eagerly (by a buffer the fused
    kernel cannot run, which tiers) carries over."""
    n = backends.AUTO_TIER_MIN_ELEMENTS["cpu"]
    a, b = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n), requires_grad=False)
    opt = dml_optim.Adam([a, b], **TIERED)
    a.grad = torch.randn(n)
    for _ in range(3):
        opt.step()
    assert opt.resolved_backends() == [["eager"]]
    spent = buffers(opt)[0].eager_seconds
    assert spent > 0
    b.requires_grad_(True)
    b.grad = torch.randn(n)
    opt.step()
    assert buffers(opt)[0].eager_seconds > spent


@needs_compiler
def test_a_compiled_step_leaves_no_thread_flushing_subnormals():
    """torch 2.4's inductor builds CPU kernels with -ffast-math; loading one turns flush-to-zero on in the loading
    thread (gcc < 13's crtfastmath.o), and worker threads started then inherit it.  In a fresh process with two
    threads, after compiled steps, every thread of a parallel op still sees subnormals: a negative subnormal
    compares below zero in all 2M elements (half of them did on torch 2.4.1 before the pool was started first)."""
    import subprocess
    import sys

    code = (
        "import torch, dml_optim\n"
        "torch.set_num_threads(2)\n"
        "p = [torch.nn.Parameter(torch.randn(4096))]\n"
        "opt = dml_optim.AdamW(p, backend='compiled')\n"
        "for _ in range(3):\n"
        "    p[0].grad = torch.randn(4096)\n"
        "    opt.step()\n"
        "assert opt.flat_buffers()[0].backend == 'compiled'\n"
        "y = torch.full((1 << 21,), -1.8e-40)\n"
        "print('flushed', int((y >= 0).sum()), torch.tensor([1e-40]).item() > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "flushed 0 True" in out.stdout, out.stdout
