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
import importlib.util
import os
import shutil
import sys
import types
import warnings
import weakref
from typing import Any

import torch
from torch.utils import _python_dispatch

from dml_optim.core.quant import QuantizedState, warm_tables
from dml_optim.core.update import coefficient_dtype, fused_step, masked_step

__all__ = [
    "CompileFallbackWarning",
    "KernelRunner",
    "compile_available",
    "kernel",
    "fall_back",
    "fell_back",
    "clear_cache",
    "cache_info",
]


class CompileFallbackWarning(RuntimeWarning):
    """``backend="compiled"`` (or ``"auto"``) could not compile; the eager rule runs instead."""


#: ``torch.compile``, looked up through this name so tests can inject a failure.
_torch_compile = torch.compile

_KERNELS: dict[tuple, Any] = {}
#: Kernel keys that cannot run compiled, with the reason.
_BROKEN: dict[tuple, str] = {}


_IS_COMPILING = getattr(torch.compiler, "is_compiling", None) or getattr(torch._dynamo, "is_compiling", None)


def _is_compiling() -> bool:
    """True while dynamo traces the caller (e.g. a user's compiled training step)."""
    return bool(_IS_COMPILING and _IS_COMPILING())


def _dispatch_mode_active() -> bool:
    """A ``TorchDispatchMode`` (op recorder, FLOP counter, FakeTensorMode, ...) is active.

    Then the eager rule runs, so the mode sees real ops; a compiled call under
    a mode would make dynamo skip the frame for good.  (``_get_current_dispatch_mode()`` is not None exactly
    when the mode stack, infrastructure modes included, is not empty: asked directly, one C call.)
    """
    return _python_dispatch._len_torch_dispatch_stack() > 0


def _counting_kernels():
    """The active op recorder that counts compiled kernels (``OpRecorder(compiled=True)``), or None."""
    if _python_dispatch._get_current_dispatch_mode() is None:
        return None
    from dml_optim.core.opcount import active_recorder

    recorder = active_recorder()
    return recorder if recorder is not None and recorder.compiled else None


def _dynamo_supported() -> tuple[bool, str]:
    try:
        import torch._dynamo.eval_frame as eval_frame
    except Exception as exc:  # pragma: no cover - broken installs
        return False, f"torch._dynamo cannot be imported ({type(exc).__name__}: {exc})"
    check = getattr(eval_frame, "check_if_dynamo_supported", None)
    if check is None:  # pragma: no cover - future torch
        return True, ""
    try:
        check()
    except Exception as exc:
        return False, f"torch.compile is not supported here ({exc})"
    return True, ""


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU, or None."""
    candidates = [os.environ.get("CXX")] if os.environ.get("CXX") else []
    candidates += ["cl"] if sys.platform == "win32" else ["g++", "clang++", "c++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


@functools.lru_cache(maxsize=None)
def compile_available(device_type: str) -> tuple[bool, str]:
    """``(available, reason)``: whether the compiled backend can run on ``device_type``.

    Cheap static checks only (the device type, dynamo's support for this
    Python, a C++ compiler for the CPU, triton for CUDA); a failure that only
    shows when inductor runs is caught at the first call instead.
    """
    if device_type not in ("cpu", "cuda"):
        return False, f"torch.compile is not used on '{device_type}' devices (the eager op chain is native there)"
    ok, reason = _dynamo_supported()
    if not ok:
        return False, reason
    if device_type == "cpu":
        if sys.platform == "win32" and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
            return False, f"inductor does not support Windows CPUs in torch {torch.__version__}"
        if _cxx_compiler() is None:
            return False, "no C++ compiler found for inductor (set CXX or install g++/clang++; cl on Windows)"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (inductor needs it for CUDA kernels)"
    return True, ""


def _key_name(key: tuple) -> str:
    if key[0] == "masked":
        _, cls, fixed, names, cdtype, storage, device = key
        parts = [cls.__name__, "masked", str(cdtype).replace("torch.", ""), device.replace(":", "")]
        parts += [f"{k}_{v}" for k, v in fixed] + [str(d).replace("torch.", "") for d in storage]
        return "_".join(p.replace(".", "_").replace("-", "_") for p in parts)
    cls, structure, names, cdtype, gated, has_out, has_comp, n_states, storage, device = key
    parts = [cls.__name__, str(cdtype).replace("torch.", ""), device.replace(":", "")]
    parts += [f"{k}_{v}" for k, v in structure]
    parts += ["gated"] * gated + ["master"] * has_out + ["kahan"] * has_comp
    parts += [s for s in storage if isinstance(s, str)]
    return "_".join(p.replace(".", "_").replace("-", "_") for p in parts)


def _fresh(fn, name: str):
    """``fn`` with a code object of its own (dynamo keeps its cache and limit per code object)."""
    code = fn.__code__
    replace = {"co_name": name}
    if sys.version_info >= (3, 11):
        replace["co_qualname"] = name
    return types.FunctionType(code.replace(**replace), fn.__globals__, name, None, fn.__closure__)


def kernel(key: tuple):
    """The compiled callable of one kernel key (see :class:`KernelRunner` for the key's fields)."""
    fn = _KERNELS.get(key)
    if fn is None:
        if key[0] == "masked":
            _, cls, fixed, names, _, _, _ = key
            fixed_dict = dict(fixed)

            def step(*tensors):
                masked_step(cls, fixed_dict, names, *tensors)
        else:
            cls, structure, names, cdtype, gated, has_out, has_comp, n_states, storage, _ = key
            structure_dict = dict(structure)
            formats = tuple(s if isinstance(s, str) else None for s in storage[2 : 2 + n_states])
            has_valid = storage[-1] is True

            def step(*tensors):
                fused_step(cls, structure_dict, names, cdtype, gated, has_out, has_comp, formats, has_valid, *tensors)

        raw = _fresh(step, f"dml_optim_kernel_{_key_name(key)}")
        options = _options(key[-1])
        if key[0] == "masked" and _has_option("assert_indirect_indexing"):
            # the owner index is ours (built from the layout, in range by construction): no bounds check per element
            options = {**(options or {}), "assert_indirect_indexing": False}
        if _direct_eligible(key):  # (fn._dml_direct: how to call it without dynamo, after its first call)
            capture = _Capture(options)
            fn = _torch_compile(raw, dynamic=True, backend=capture)
            fn._dml_capture = capture
        else:
            fn = _torch_compile(raw, dynamic=True, options=options) if options else _torch_compile(raw, dynamic=True)
        fn._dml_code = raw.__code__
        _KERNELS[key] = fn
    return fn


# --------------------------------------------------------------------------
# calling a kernel without its dynamo frame
# --------------------------------------------------------------------------

#: Call plain kernels without their dynamo frame once verified (:class:`_Direct`); False: always dynamo's call.
DIRECT_CALLS = True


def _direct_eligible(key: tuple) -> bool:
    """Plain step kernels (1-d operands of one length, 0-d counters and hyperparameters) may be called
    directly; masked and quantized ones (2-d operands, index tensors) always go through dynamo."""
    if key[0] == "masked":
        return False
    storage = key[8]
    return not any(isinstance(s, str) for s in storage) and storage[-1] is False


class _Capture:
    """A ``torch.compile`` backend that is inductor with ``options`` (what ``torch.compile(options=...)``
    runs) and keeps each graph it compiled: the FX graph, its example inputs and inductor's callable."""

    def __init__(self, options: dict | None):
        self.options = dict(options or {})
        self.graphs: list[tuple] = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=self.options)
        self.graphs.append((gm, list(example_inputs), compiled))
        return compiled


class _Direct:
    """Inductor's callable for one kernel key, called with the graph's inputs taken from the kernel's
    arguments: no dynamo frame, no guard evaluation, no config patching (about 20 to 50 us a call on
    a 2-core CPU, most of a small buffer's step).

    Skipping the guards is sound only because the kernel key already fixes what they check: dtypes,
    device, structure and the number of operands; every operand is a contiguous 1-d range of one
    length (>= 2: dynamo specializes lengths 0 and 1) or a 0-d tensor, none aliasing another, and
    steps run under ``no_grad``.  Inductor's own size and stride asserts stay on.  A plan is made only
    from a kernel that compiled as one graph, and it is trusted only after a probe call gave
    bit-identical results to dynamo's call (:func:`_make_direct`).
    """

    __slots__ = ("compiled", "plan")

    def __init__(self, compiled, plan: tuple):
        self.compiled = compiled
        self.plan = plan

    def __call__(self, args) -> None:
        self.compiled(*[value if i is None else (args[i] if d is None else args[i].shape[d])
                        for i, d, value in self.plan])


def _plan(gm, example_inputs: list, args: list) -> tuple | None:
    """For each graph input: ``(argument index, None, None)`` for a tensor, ``(index, dim, None)`` for a
    length, ``(None, None, value)`` for an integer the kernel reads (a class constant, fixed per key);
    None when an input cannot be placed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    where = {id(a): i for i, a in enumerate(args)}
    sizes = {}
    for node, example in zip(placeholders, example_inputs):
        fake = node.meta.get("example_value")
        if isinstance(example, torch.Tensor) and id(example) in where and fake is not None:
            for d, size in enumerate(fake.shape):
                sizes.setdefault(str(size), (where[id(example)], d))
    plan = []
    for node, example in zip(placeholders, example_inputs):
        if isinstance(example, torch.Tensor):
            if id(example) not in where:
                return None
            plan.append((where[id(example)], None, None))
        elif isinstance(example, (int, torch.SymInt)):
            symbol = str(node.meta.get("example_value", example))
            plan.append((*sizes[symbol], None) if symbol in sizes else (None, None, int(example)))
        else:
            return None
    return tuple(plan)


def _probe(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for one kernel operand: 0-d ones copied, 1-d ones 37 positive values (no NaN can
    make a comparison fail, and the length is not a multiple of any vector width)."""
    if t.dim() == 0:
        return t.clone()
    if t.dtype.is_floating_point:
        return torch.rand(37, dtype=torch.float32, device=t.device).add_(0.5).to(t.dtype)
    return torch.ones(37, dtype=t.dtype, device=t.device)


def _make_direct(fn, args: list) -> "_Direct | None":
    """After a kernel's first (compiling) call: a :class:`_Direct` for it, or None.  The direct call is
    checked once against dynamo's on probe operands (:func:`_probe`): any difference, a second graph
    or a recompile, and the key keeps dynamo's guarded call."""
    capture = getattr(fn, "_dml_capture", None)
    if (not DIRECT_CALLS or capture is None or len(capture.graphs) != 1 or any(a.dim() > 1 for a in args)
            or args[0].shape[0] < 2):
        return None
    gm, example_inputs, compiled = capture.graphs[0]
    plan = _plan(gm, example_inputs, args)
    if plan is None:
        return None
    direct = _Direct(compiled, plan)
    probe = [_probe(a) for a in args]
    through_dynamo, called_directly = [p.clone() for p in probe], [p.clone() for p in probe]
    fn(*through_dynamo)
    direct(called_directly)
    if len(capture.graphs) != 1 or not all(torch.equal(a, b) for a, b in zip(through_dynamo, called_directly)):
        return None
    return direct


def _options(device: str) -> dict[str, bool] | None:
    """Inductor options of a kernel for ``device`` (None: the defaults)."""
    options = {}
    # inductor keeps a fused kernel's intermediates in float32 and skips casts to float16/bfloat16
    # unless told to emulate them; Kahan summation reads back the rounded parameters, and every
    # low-precision store should round as the eager rule does
    if _emulates_casts():
        options["emulate_precision_casts"] = True
    # A CPU kernel decides at compile time whether to run its loop on OpenMP threads, from the
    # first call's length and torch.get_num_threads(); lengths are dynamic, so a kernel first
    # compiled for a small buffer (or one thread, or found so in inductor's disk cache) would run
    # every later buffer on one thread: resnet50's Momentum step took 27 ms instead of 18 on two
    # cores.  With dynamic threads the loop is always parallel and OpenMP sizes it at run time.
    if device.startswith("cpu") and _has_cpp_option("dynamic_threads"):
        options["cpp.dynamic_threads"] = True
    return options or None


def _has_option(name: str) -> bool:
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(config, name)


def _has_cpp_option(name: str) -> bool:
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(getattr(config, "cpp", None), name)


def _emulates_casts() -> bool:
    """Inductor can round intermediate low-precision casts (``emulate_precision_casts``, torch >= 2.5)."""
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - builds without inductor
        return False
    return hasattr(config, "emulate_precision_casts")


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

#: Optimizers that fell back to eager, with the reason (warned once each).
_FALLEN_BACK: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def fall_back(opt, device, reason: str) -> None:
    """Record that ``opt`` runs eager from now on; warn the first time."""
    if opt in _FALLEN_BACK:
        return
    _FALLEN_BACK[opt] = reason
    warnings.warn(
        f"dml_optim: {type(opt).__name__} cannot use the compiled backend on {device}: {reason}; "
        "running the eager backend instead (same results, more memory traffic)",
        CompileFallbackWarning,
        stacklevel=5,
    )


def fell_back(opt) -> str | None:
    """The reason ``opt`` fell back to eager, or None."""
    return _FALLEN_BACK.get(opt)


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def _cache_entries(fn) -> int:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - future torch
        return 0
    return len(_debug_get_cache_entry_list(fn._dml_code))


@functools.lru_cache(maxsize=None)
def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return counters  # (one object for the process; a reset clears it, it is not replaced)


def _frames_compiled() -> int:
    """Frames dynamo has compiled so far in this process (a new one: a compile or a recompile)."""
    return _dynamo_counters()["frames"]["total"]


def _denormals_flushed() -> bool:
    """True when this thread flushes subnormal floats to zero (x86 FTZ/DAZ)."""
    return sys.float_info.min * 0.5 == 0.0


class KernelRunner:
    """Runs one class of a buffer through its compiled kernel; ``runner(group, flat, c, finite) -> bool``.

    Returns False when the call must run eagerly instead (the caller does).
    Float hyperparameters live in 0-d tensors owned by the runner, one set
    per buffer, refilled only when a value changes (a scheduler's new ``lr``
    costs one fill; constants cost nothing).
    """

    def __init__(self, opt):
        self.opt_ref = weakref.ref(opt)
        self._slots: "weakref.WeakKeyDictionary[Any, dict[str, list]]" = weakref.WeakKeyDictionary()
        self._keys: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()

    def key(self, group, flat) -> tuple:
        """The kernel key of ``flat`` under ``group``'s current hyperparameters and options.

        Kept per buffer while the group's validated settings (``flat.settings``, a new object at every
        change) and the buffer's states are the same: a steady step does not rebuild it.
        """
        return self._cached(group, flat)[0]

    def resolved(self, group, flat) -> str:
        """``backends.resolve`` for ``flat`` under ``group``'s backend option, kept like :meth:`key`."""
        return self._cached(group, flat)[1]

    def _cached(self, group, flat) -> tuple[tuple, str]:
        cached = self._keys.get(flat)
        from dml_optim.backends.choose import resolve, tier_due

        due = tier_due(flat.device.type, flat.numel, flat.bits is not None, flat.eager_s)
        allocated = (len(flat.states), flat.master is None, flat.kahan is None, flat.numel, due)
        if cached is not None and cached[0] is flat.settings and flat.settings is not None and cached[1] == allocated:
            return cached[2]
        value = (self._key(group, flat),
                 resolve(group["backend"], flat.device, flat.numel, flat.bits is not None, flat.eager_s))
        self._keys[flat] = (flat.settings, allocated, value)
        return value

    def _key(self, group, flat) -> tuple:
        opt = self.opt_ref()
        cls = type(opt)
        structure, names = [], []
        for h in cls.spec.hyperparameters:
            value = group[h.name]
            if h.kind != "float" or (h.name in cls.zero_skips and value == 0):
                structure.append((h.name, value))
            else:
                names.append(h.name)
        cdtype = opt._compute_dtype(group, flat.dtype, flat.bits)
        x = flat.master if flat.master is not None else flat.data
        states = [flat.states.get(n) for n in cls.group_state_names(group)]
        # how each operand is stored: a dtype, or a quantized format's name; then whether padding is masked
        storage = (x.dtype, flat.dtype) + tuple(s.format.name if isinstance(s, QuantizedState) else
                                                (s.dtype if s is not None else None) for s in states)
        storage += (flat.valid is not None,)
        return (cls, tuple(structure), tuple(names), cdtype, False, flat.master is not None, flat.kahan is not None,
                len(states), storage, str(flat.device))

    def _hyper(self, flat, names, group, dtype) -> list[torch.Tensor]:
        slots = self._slots.get(flat)
        if slots is None:
            slots = self._slots[flat] = {}
        out = []
        for name in names:
            value = float(group[name])
            slot = slots.get(name)
            if slot is None or slot[1].dtype != dtype or slot[1].device != flat.device:
                slot = slots[name] = [value, torch.full((), value, dtype=dtype, device=flat.device)]
            elif slot[0] != value:
                slot[1].fill_(value)
                slot[0] = value
            out.append(slot[1])
        return out

    def __call__(self, group, flat, c, finite, key: tuple | None = None) -> bool:
        """Run class ``c`` of ``flat``; ``key``: this step's :meth:`key` when the caller has it."""
        opt = self.opt_ref()
        counting = _counting_kernels()
        if opt is None or opt in _FALLEN_BACK or _is_compiling() or (_dispatch_mode_active() and counting is None):
            return False
        key = key if key is not None else self.key(group, flat)
        if finite is not None:
            key = key[:4] + (True,) + key[5:]
        if key[6] and not _emulates_casts():
            _BROKEN[key] = (f"Kahan summation needs inductor to round its float16/bfloat16 casts "
                            f"(emulate_precision_casts, torch >= 2.5; this is torch {torch.__version__})")
        if key in _BROKEN:
            fall_back(opt, flat.device, _BROKEN[key])
            return False
        cls = key[0]
        names = key[2]
        if c.tensor is None:
            flat.counter.ensure_tensors(flat.device)
        start, end = flat.segment(c.first, c.stop)
        whole = start == 0 and end == flat.numel
        if flat.bits:  # every operand as (blocks, block): one row count for the whole kernel (and no modulo)
            cut = lambda t: t[start:end].view(-1, flat.align) if isinstance(t, torch.Tensor) else t[start:end]  # noqa: E731
        else:
            cut = (lambda t: t) if whole else (lambda t: t[start:end])
        x = flat.master if flat.master is not None else flat.data
        args = [cut(x), cut(flat.grad)]
        for n in cls.group_state_names(group):
            state = cut(flat.states[n])
            if isinstance(state, QuantizedState):
                warm_tables(state.format, key[3], flat.device)
                per_byte = 2 if state.format.bits == 4 else 1
                args += [state.codes.view(-1, flat.align // per_byte), state.scales]
            else:
                args.append(state)
        if flat.master is not None:
            args.append(cut(flat.data))
        if flat.kahan is not None:
            args.append(cut(flat.kahan))
        if flat.valid is not None:
            args.append(flat.block_valid(start, end))
        args.append(c.tensor)
        if finite is not None:
            args.append(finite)
        args += self._hyper(flat, names, group, coefficient_dtype(flat.device, key[3]))
        return self._launch(opt, key, args, flat.device, counting)

    def masked(self, group, flat, plan: tuple) -> bool:
        """Run one masked update of ``flat`` (``plan``: the engine's ``(fixed, names, table)``) as one
        compiled kernel; False when it must run eagerly instead (the caller does)."""
        opt = self.opt_ref()
        counting = _counting_kernels()
        if opt is None or opt in _FALLEN_BACK or _is_compiling() or (_dispatch_mode_active() and counting is None):
            return False
        fixed, names, table = plan
        if any(isinstance(v, torch.Tensor) for v in fixed.values()):
            return False  # (a tensor hyperparameter: not a kernel key; the eager update takes it)
        cls = type(opt)
        states = [flat.states[n] for n in cls.group_state_names(group)]
        key = ("masked", cls, tuple(sorted(fixed.items())), tuple(names), table.dtype,
               (flat.dtype,) + tuple(s.dtype for s in states), str(flat.device))
        if key in _BROKEN:
            fall_back(opt, flat.device, _BROKEN[key])
            return False
        return self._launch(opt, key, [flat.data, flat.grad, *states, table, flat.owner()], flat.device, counting)

    @staticmethod
    def _launch(opt, key: tuple, args: list, device, counting) -> bool:
        """Call ``key``'s kernel on ``args``: a compile failure or dynamo's recompile limit makes ``opt``
        fall back, loudly and once (False: the caller runs eagerly); the caller's subnormal mode is kept."""
        fn = kernel(key)
        direct = getattr(fn, "_dml_direct", None)
        if direct is not None and args[0].shape[0] >= 2:
            call = functools.partial(direct, args)
        else:
            call = functools.partial(fn, *args)
        flushed = _denormals_flushed()
        frames = _frames_compiled()
        try:
            if counting is not None:
                counting.run_compiled(call)  # one op, run outside the recorder
            else:
                call()
        except Exception as exc:  # compile errors surface at the first call
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _BROKEN[key] = f"compilation failed ({type(exc).__name__}: {first})"
            fall_back(opt, device, _BROKEN[key])
            return False
        if not flushed and _denormals_flushed():
            # torch 2.4's inductor builds CPU kernels with -ffast-math; with gcc < 13 that links
            # crtfastmath.o, whose constructor turns on flush-to-zero for the loading thread: the
            # caller's floating-point semantics must not change behind its back
            torch.set_flush_denormal(False)
        if _frames_compiled() != frames and _cache_entries(fn) >= _recompile_limit():
            _BROKEN[key] = (f"dynamo's recompile limit ({_recompile_limit()}) was reached for kernel "
                            f"{_key_name(key)}; dynamo would run it uncompiled from now on")
            fall_back(opt, device, _BROKEN[key])
        elif not hasattr(fn, "_dml_direct") and hasattr(fn, "_dml_capture") and counting is None \
                and not _dispatch_mode_active():  # (after the step: whatever happens here, it happened once)
            try:
                fn._dml_direct = _make_direct(fn, args)
            except Exception:  # pragma: no cover - an unforeseen graph: dynamo's call stays
                fn._dml_direct = None
        return True
