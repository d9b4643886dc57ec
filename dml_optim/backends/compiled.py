"""The ``compiled`` backend: one optimizer step of one range fused into one kernel by ``torch.compile``.

The eager backend runs a rule as a chain of about ten element-wise ops over a
flat buffer.  Here the *same* code (:func:`dml_optim.core.update.fused_step`: the
class's coefficients, its rule from :mod:`dml_optim.core.functional`, the
precision modes and the step counter's increment) is traced by
``torch.compile``; inductor fuses it into one loop that reads the parameters,
gradients and states once and writes them once.

What makes one graph serve every optimizer instance:

* **The kernel is a pure function of tensors.**  It takes positional tensors
  only: the ranges of the flat buffers, the step counter (a 0-d int64 on the
  device), the skip flag when gated, and every float hyperparameter as a 0-d
  tensor (``lr``, ``alpha``, ``epsilon``...).  The bias corrections are
  computed inside from the counter.  No optimizer, dict, list or function is
  an argument, so dynamo never guards on an object's identity and a new
  optimizer, a new epsilon or a scheduler's new ``lr`` reuse the graph.
* **Only structure selects a graph**: the optimizer class, the structural
  hyperparameters (``mode``, ``amsgrad``, ``maximize``, and a float listed in
  the class's ``zero_skips`` being exactly 0, which removes ops), the
  precision mode and the dtypes, gated or not, the device.  Each such key
  gets a code object of its own (:func:`_fresh`), so dynamo's cache and
  recompile limit are per key and one key never evicts another.
* **Buffer lengths are dynamic** (``dynamic=True``): a second param group, a
  class of parameters, a chunk all reuse the graph.

Falling back is never silent: if compilation is unavailable or fails, or
dynamo's recompile limit is reached for a key (after which dynamo would run
the Python eagerly without a word), the optimizer warns once
(:class:`CompileFallbackWarning`) and runs the eager backend, and
:func:`dml_optim.backends.choose.resolved_backends` reports ``"eager"``.  Two cases run
the eager rule for a single call without a warning, because they are meant
to: a ``TorchDispatchMode`` is active (the step audit, FLOP counters), or
the caller is itself being traced by dynamo.

Cost: inductor's first CPU compile probes the compiler's vector ISA support
(10-40 s on a 2-core VM; cached on disk afterwards); each kernel then takes
0.2 to 5 s to compile, once per process (seconds less from inductor's disk
cache).
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from typing import Any

import torch

from dml_optim.backends import eager as _eager
from dml_optim.backends.base import CompiledCache, CompiledPlan, HyperSlot, MaskedUpdate, Owner, Route, StepRequest, grad_range, runtime
from dml_optim.backends.direct import _Capture, _Direct, _direct_eligible, _make_direct
from dml_optim.backends.inductor import (_dynamo_counters, _denormals_flushed, _emulates_casts, _frames_compiled,
                                         _has_option, _options, compile_available, start_thread_pool)
from dml_optim.backends.modes import counting_kernels, dispatch_mode_active, is_compiling
from dml_optim.core.dtypes import compute_dtype
from dml_optim.core.quant import QuantizedState, warm_tables
from dml_optim.core.rule import Rule
from dml_optim.core.update import (KernelKey, MaskedKey, coefficient_dtype, fused_step, kernel_operands,
                                   masked_step)

__all__ = [
    "CompileFallbackWarning",
    "CompiledBackend",
    "BACKEND",
    "compile_available",
    "kernel",
    "kernel_key",
    "fall_back",
    "clear_cache",
    "cache_info",
]

# (the names tests read here too: the modes, the direct call's class (_Direct), inductor's casts (_emulates_casts))
_is_compiling, _dispatch_mode_active, _counting_kernels = is_compiling, dispatch_mode_active, counting_kernels


class CompileFallbackWarning(RuntimeWarning):
    """``backend="compiled"`` (or ``"auto"``) could not compile; the eager rule runs instead."""


#: ``torch.compile``, looked up through this name so tests can inject a failure.
_torch_compile = torch.compile

_KERNELS: dict[tuple, Any] = {}
#: Kernel keys that cannot run compiled, with the reason.
_BROKEN: dict[tuple, str] = {}


def _key_name(key: KernelKey | MaskedKey) -> str:
    if isinstance(key, MaskedKey):
        parts = [key.rule.name, "masked", str(key.table_dtype).replace("torch.", ""), key.device.replace(":", "")]
        parts += [f"{k}_{v}" for k, v in key.fixed] + [str(d).replace("torch.", "") for d in key.storage]
        return "_".join(p.replace(".", "_").replace("-", "_") for p in parts)
    parts = [key.rule.name, str(key.compute_dtype).replace("torch.", ""), key.device.replace(":", "")]
    parts += [f"{k}_{v}" for k, v in key.structure]
    parts += ["gated"] * key.gated + ["master"] * key.has_out + ["kahan"] * key.has_comp
    parts += [s for s in key.storage if isinstance(s, str)]
    return "_".join(p.replace(".", "_").replace("-", "_") for p in parts)


def _fresh(fn, name: str):
    """``fn`` with a code object of its own (dynamo keeps its cache and limit per code object)."""
    code = fn.__code__
    replace = {"co_name": name}
    if sys.version_info >= (3, 11):
        replace["co_qualname"] = name
    return types.FunctionType(code.replace(**replace), fn.__globals__, name, None, fn.__closure__)


def kernel(key: KernelKey | MaskedKey):
    """The compiled callable of one kernel key."""
    fn = _KERNELS.get(key)
    if fn is None:
        if isinstance(key, MaskedKey):
            rule, names, fixed_dict = key.rule, key.names, dict(key.fixed)

            def step(*tensors):
                masked_step(rule, fixed_dict, names, *tensors)
        else:  # (plain values in the closure: dynamo reads no NamedTuple property while it traces)
            rule, structure_dict, names, cdtype = key.rule, dict(key.structure), key.names, key.compute_dtype
            gated, has_out, has_comp, formats, has_valid = key.gated, key.has_out, key.has_comp, key.formats, key.has_valid

            def step(*tensors):  # (what it returns is computed once per block: quant.encode_)
                return fused_step(rule, structure_dict, names, cdtype, gated, has_out, has_comp, formats, has_valid,
                                  *tensors)

        raw = _fresh(step, f"dml_optim_kernel_{_key_name(key)}")
        options = _options(key.device)
        if (isinstance(key, MaskedKey) or any(key.formats)) and _has_option("assert_indirect_indexing"):
            # the owner index is ours (built from the layout, in range by construction), and so are a quantized
            # state's table indices (a code byte into a 256-entry table, a masked bucket number): no bounds
            # check per element
            options = {**(options or {}), "assert_indirect_indexing": False}
        if not isinstance(key, MaskedKey) and any(key.formats):
            options = {**(options or {}), **_RECOMPUTE}
        if _direct_eligible(key):  # (fn._dml_direct: how to call it without dynamo, after its first call)
            capture = _Capture(options)
            fn = _torch_compile(raw, dynamic=True, backend=capture)
            fn._dml_capture = capture
        else:
            fn = _torch_compile(raw, dynamic=True, options=options) if options else _torch_compile(raw, dynamic=True)
        fn._dml_code = raw.__code__
        _KERNELS[key] = fn
    return fn


#: Inductor options of a kernel with quantized states: inline every pointwise value into its readers (never
#: realize one for having many reads or ops), so the decoded states and the rule's results are recomputed
#: from the codes and the gradient in the second loop instead of stored as float buffers between loops:
#: the kernel makes two passes (one to find the new block maxima, one to write the parameters and the codes),
#: reading codes and gradients twice and writing nothing else (16M elements, 8-bit AdamW: six loops and two 64 MB
#: float buffers written and read again before; in one call now the step's peak is 0.5 MB above the resident set,
#: VmHWM, torch 2.13).
_REALIZE_OPTIONS = ("realize_opcount_threshold", "realize_reads_threshold", "realize_acc_reads_threshold")
_RECOMPUTE = {name: 1 << 20 for name in _REALIZE_OPTIONS if _has_option(name)}
#: The devices where such a kernel was measured to allocate nothing per element, so that a quantized buffer of
#: any size takes one call a step: the CPU from torch 2.13 (2.13 and 2.14: the step's resident peak at most
#: 0.04 B/param above the resident set for every optimizer with ``state_bits``, 4M elements).  torch 2.4's
#: inductor writes the new codes (and an FP32 master copy) to temporaries and copies them into the states
#: (2 B/param measured for 8-bit AdamW, 6 with FP16 master weights), and CUDA's kernels were not measured:
#: there the kernel runs in chunks within the scratch bound (:meth:`CompiledBackend._chunk`).
_ONE_CALL_DEVICES = ("cpu",) if torch.__version__ >= "2.13" else ()


def clear_cache() -> None:
    """Forget compiled callables and remembered failures (dynamo's own caches stay)."""
    _KERNELS.clear()
    _BROKEN.clear()
    compile_available.cache_clear()


def cache_info() -> dict[str, Any]:
    """``{"compiled": [key names], "failed": {key name: reason}}`` for diagnostics."""
    return {"compiled": [_key_name(k) for k in _KERNELS], "failed": {_key_name(k): why for k, why in _BROKEN.items()}}


# --------------------------------------------------------------------------
# falling back, loudly and once
# --------------------------------------------------------------------------

def fall_back(owner: Owner, device, reason: str) -> None:
    """Record that ``owner``'s optimizer runs eager from now on (:attr:`Owner.compile_fallback`); warn the first
    time."""
    if owner.compile_fallback is not None:
        return
    owner.compile_fallback = reason
    warnings.warn(
        f"dml_optim: {owner.name} cannot use the compiled backend on {device}: {reason}; "
        "running the eager backend instead (same results, more memory traffic)",
        CompileFallbackWarning,
        stacklevel=5,
    )


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def _cache_entries(fn) -> int:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - future torch
        return 0
    return len(_debug_get_cache_entry_list(fn._dml_code))



def kernel_key(rule: Rule, group, flat, gated: bool = False) -> KernelKey:
    """The kernel key of ``flat`` under ``group``'s current hyperparameters and options (its states allocated)."""
    structure = [(name, group[name]) for name in rule.switches]
    names = []
    for name in rule.floats:
        value = group[name]
        if name in rule.zero_skips and value == 0:
            structure.append((name, value))
        else:
            names.append(name)
    x = flat.master if flat.master is not None else flat.data
    states = [flat.states.get(n) for n in rule.group_state_names(group)]
    # how each operand is stored: a dtype, or a quantized format's name; then whether padding is masked
    storage = (x.dtype, flat.dtype) + tuple(s.format.name if isinstance(s, QuantizedState) else
                                            (s.dtype if s is not None else None) for s in states)
    storage += (flat.valid is not None,)
    return KernelKey(rule, tuple(structure), tuple(names), compute_dtype(group, flat.dtype, flat.bits), gated,
                     flat.master is not None, flat.kahan is not None, len(states), storage, str(flat.device))


class CompiledBackend:
    """One ``torch.compile``'d kernel per class of parameters (or one masked kernel per buffer).

    Its plans are :class:`~dml_optim.backends.base.CompiledPlan` s: the eager backend's class updates
    (host scalars and range checks, for the calls that fall back) and the kernel key.  A call returns to
    the eager rule when the kernel cannot run (the optimizer fell back, a dispatch mode, a dynamo trace).
    Float hyperparameters live in 0-d tensors kept per buffer, refilled only when a value changes (a
    scheduler's new ``lr`` costs one fill; constants cost nothing)."""

    name = "compiled"

    def supports(self, rule: Rule, group, flat) -> str | None:
        available, why = compile_available(flat.device.type)
        return None if available else why

    @staticmethod
    def broken(key) -> str | None:
        """Why the kernel of ``key`` cannot run (it failed to compile, or dynamo gave up on it), or None."""
        return _BROKEN.get(key) if key is not None else None

    def plan(self, request: StepRequest, route: Route, last=None) -> CompiledPlan:
        """The eager plan of ``request`` (:func:`dml_optim.backends.eager.plan_updates`) with the kernel key
        (``route.key``; None: a masked update's kernel alone, ``route.masked``)."""
        key, masked = route.key, route.masked
        eager = _eager.BACKEND.plan(request, Route(compiled=key is not None, masked=masked), last)
        return CompiledPlan(request, updates=eager.updates, masked=eager.masked, chunk=eager.chunk,
                            scratch=eager.scratch, timed=False, converts=eager.converts, key=key,
                            masked_kernel=masked)

    def run(self, plan: CompiledPlan) -> None:
        request = plan.request
        owner, group, flat = request.owner, request.group, request.flat
        if plan.masked is not None:
            if not (plan.masked_kernel and self.masked(owner, group, flat, plan.masked)):
                _eager.apply_masked(request, plan.masked, plan.scratch)
            _eager.forget_device_counts(flat)
            return
        for update in plan.updates:
            if plan.key is None or not self.call(owner, group, flat, update.step_class, request.finite, plan.key,
                                                         request.window):
                _eager.apply_class(request, update, plan)

    @staticmethod
    def _hyper(flat, names, group, dtype) -> list[torch.Tensor]:
        rt = runtime(flat)
        cache = rt.compiled
        if cache is None:
            cache = rt.compiled = CompiledCache()
        slots = cache.hyper
        out = []
        for name in names:
            value = float(group[name])
            slot = slots.get(name)
            if slot is None or slot.tensor.dtype != dtype or slot.tensor.device != flat.device:
                slot = slots[name] = HyperSlot(value, torch.full((), value, dtype=dtype, device=flat.device))
            elif slot.value != value:
                slot.tensor.fill_(value)
                slot.value = value
            out.append(slot.tensor)
        return out

    def call(self, owner: Owner, group, flat, c, finite, key: KernelKey | None = None, window=None) -> bool:
        """Run class ``c`` of ``flat`` through its kernel (``key``: this step's, when the caller has it;
        ``window``: the range's gradients, :attr:`StepRequest.window`); False when it must run eagerly instead
        (the caller does)."""
        counting = counting_kernels()
        if owner.compile_fallback is not None or is_compiling() or (dispatch_mode_active() and counting is None):
            return False
        key = key if key is not None else kernel_key(owner.rule, group, flat)
        if finite is not None and not key.gated:
            key = key._replace(gated=True)
        if key.has_comp and not _emulates_casts():
            _BROKEN[key] = (f"Kahan summation needs inductor to round its float16/bfloat16 casts "
                            f"(emulate_precision_casts, torch >= 2.5; this is torch {torch.__version__})")
        if key in _BROKEN:
            fall_back(owner, flat.device, _BROKEN[key])
            return False
        if c.tensor is None:
            flat.counter.ensure_tensors(flat.device)
        start, end = flat.segment(c.first, c.stop)
        chunk = self._chunk(key, flat, end - start)
        if chunk >= end - start:
            return self._launch(owner, key, self._operands(key, group, flat, start, end, c.tensor, finite, window),
                                flat.device, counting)
        # a quantized buffer in chunks (the kernel's temporaries, its decoded states, stay within the eager
        # scratch bound); the kernel advances the count it is given: every chunk but the last gets a copy
        spare = torch.empty_like(c.tensor)
        for a in range(start, end, chunk):
            b = min(a + chunk, end)
            count = c.tensor if b == end else spare.copy_(c.tensor)
            if not self._launch(owner, key, self._operands(key, group, flat, a, b, count, finite, window), flat.device,
                                counting):
                if a != start:  # pragma: no cover - a compile failure surfaces at the first chunk
                    raise RuntimeError("dml_optim: the compiled kernel failed after its first chunk")
                return False
        return True

    @staticmethod
    def _chunk(key: KernelKey, flat, numel: int) -> int:
        """Elements per kernel call over ``numel`` elements of ``flat``: all of them where the kernel realizes
        nothing per element (:data:`_ONE_CALL_DEVICES`, with :data:`_RECOMPUTE` in full: it allocates a few
        floats per block), else for quantized states chunks whose temporaries (at most their decoded states,
        4 bytes per element each) stay within :func:`~dml_optim.backends.eager.scratch_budget` (a new 64 MB
        temporary costs a CPU its page faults: at 16M elements 8-bit AdamW took 0.57 s a step in one call when
        the kernel realized its states)."""
        n = sum(f is not None for f in key.formats)
        nothing_per_element = flat.device.type in _ONE_CALL_DEVICES and len(_RECOMPUTE) == len(_REALIZE_OPTIONS)
        if not flat.bits or not n or nothing_per_element:
            return numel
        return _eager.chunk_elements(numel, 4 * n, ops_per_chunk=0, align=flat.align,
                              max_scratch=_eager.scratch_budget(flat.numel))

    def _operands(self, key: KernelKey, group, flat, start: int, end: int, count, finite, window=None) -> list:
        """The kernel's operands over elements ``[start, end)`` of ``flat``, ``count`` its step count tensor
        (the gradients from ``window`` when given: :func:`~dml_optim.backends.base.grad_range`)."""
        whole = start == 0 and end == flat.numel
        if flat.bits:  # every operand as (blocks, block): one row count for the whole kernel (and no modulo)
            cut = lambda t: t[start:end].view(-1, flat.align) if isinstance(t, torch.Tensor) else t[start:end]  # noqa: E731
        else:
            cut = (lambda t: t) if whole else (lambda t: t[start:end])
        states = []
        for n in key.rule.group_state_names(group):
            state = cut(flat.states[n])
            if isinstance(state, QuantizedState):
                warm_tables(state.format, key.compute_dtype, flat.device)
                per_byte = 2 if state.format.bits == 4 else 1
                state = (state.codes.view(-1, flat.align // per_byte), state.scales)
            states.append(state)
        hyper = self._hyper(flat, key.names, group, coefficient_dtype(flat.device, key.compute_dtype))
        x = flat.master if flat.master is not None else flat.data
        grad = cut(flat.grad) if window is None else grad_range(flat, window, start, end)
        if window is not None and flat.bits:
            grad = grad.view(-1, flat.align)
        values = {"x": cut(x), "g": grad, "T": count, "finite": finite,
                  "params_out": cut(flat.data) if flat.master is not None else None,
                  "comp": cut(flat.kahan) if flat.kahan is not None else None,
                  "valid": flat.block_valid(start, end)}
        for i, state in enumerate(states):
            if isinstance(state, tuple):
                values[f"state{i}.codes"], values[f"state{i}.scales"] = state
            else:
                values[f"state{i}"] = state
        values.update((f"hyper.{n}", t) for n, t in zip(key.names, hyper))
        return kernel_operands(key, values)

    def masked(self, owner: Owner, group, flat, plan: MaskedUpdate) -> bool:
        """Run one masked update of ``flat`` as one compiled kernel; False when it must run eagerly instead
        (the caller does)."""
        counting = counting_kernels()
        if owner.compile_fallback is not None or is_compiling() or (dispatch_mode_active() and counting is None):
            return False
        fixed, names, table = plan
        if any(isinstance(v, torch.Tensor) for v in fixed.values()):
            return False  # (a tensor hyperparameter: not a kernel key; the eager update takes it)
        rule = owner.rule
        states = [flat.states[n] for n in rule.group_state_names(group)]
        key = MaskedKey(rule, tuple(sorted(fixed.items())), tuple(names), table.dtype,
                        (flat.dtype,) + tuple(s.dtype for s in states), str(flat.device))
        if key in _BROKEN:
            fall_back(owner, flat.device, _BROKEN[key])
            return False
        return self._launch(owner, key, [flat.data, flat.grad, *states, table, flat.owner()], flat.device, counting)

    @staticmethod
    def _launch(owner: Owner, key, args: list, device, counting) -> bool:
        """Call ``key``'s kernel on ``args``: a compile failure or dynamo's recompile limit makes ``owner``'s
        optimizer fall back, loudly and once (False: the caller runs eagerly); the caller's subnormal mode is kept."""
        if torch.device(device).type == "cpu":
            start_thread_pool()
        flushed = _denormals_flushed()
        try:
            return CompiledBackend._call(owner, key, args, device, counting)
        finally:
            if not flushed and _denormals_flushed():
                # torch 2.4's inductor builds CPU kernels with -ffast-math; with gcc < 13 that links
                # crtfastmath.o, whose constructor turns on flush-to-zero for the loading thread whenever a kernel's
                # module is loaded (its first call, or the direct call made after it): the caller's
                # floating-point semantics must not change behind its back
                torch.set_flush_denormal(False)

    @staticmethod
    def _call(owner: Owner, key, args: list, device, counting) -> bool:
        fn = kernel(key)
        direct = getattr(fn, "_dml_direct", None)
        if direct is not None and args[0].shape[0] >= 2:
            call = functools.partial(direct, args)
        else:
            call = functools.partial(fn, *args)
        frames = _frames_compiled()
        try:
            if counting is not None:
                counting.run_compiled(call)  # one op, run outside the recorder
            else:
                call()
        except Exception as exc:  # compile errors surface at the first call
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _BROKEN[key] = f"compilation failed ({type(exc).__name__}: {first})"
            fall_back(owner, device, _BROKEN[key])
            return False
        if _frames_compiled() != frames and _cache_entries(fn) >= _recompile_limit():
            _BROKEN[key] = (f"dynamo's recompile limit ({_recompile_limit()}) was reached for kernel "
                            f"{_key_name(key)}; dynamo would run it uncompiled from now on")
            fall_back(owner, device, _BROKEN[key])
        elif not hasattr(fn, "_dml_direct") and hasattr(fn, "_dml_capture") and counting is None \
                and not dispatch_mode_active():  # (after the step: whatever happens here, it happened once)
            try:
                fn._dml_direct = _make_direct(fn, args)
            except Exception:  # pragma: no cover - an unforeseen graph: dynamo's call stays
                fn._dml_direct = None
        return True


#: The compiled backend.
BACKEND = CompiledBackend()
