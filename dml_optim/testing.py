"""Seams for tests: what a test of dml_optim (or of code built on it) may change or watch, without private names.

The library's own tests use nothing else of its insides; these functions are kept working across releases the
way the rest of the public API is.  None of them is needed to train.

* **planning**: the optimizer option ``repeat=False`` (:mod:`dml_optim.core.options`) plans every step from
  scratch; ``opt.flat_buffers()`` (:class:`~dml_optim.optimizers.introspect.BufferInfo`) says whether a step
  repeated and which tensors its repeated call is bound to; ``opt.step_requests()`` with
  :func:`dml_optim.backends.choose.plan_step` and :func:`~dml_optim.backends.choose.run_plan` steps a buffer
  by hand.
* **the compiled backend**: :func:`isolated_kernel_cache` (an empty kernel cache for a block),
  :func:`kernels` (what the cache holds), :func:`compiler` (another compiler than ``torch.compile``: the
  identity runs the kernels' Python eagerly, a raising one is the compile failure), :func:`recompile_limit`,
  :func:`direct_calls` and :func:`direct_call_override` (the call without dynamo's frame),
  :func:`kernel_calls` (each kernel call's operands and what it returned), :func:`one_call_devices` and
  :func:`large_quantized_buffers_in_one_call`, :func:`inductor_rounds_casts`.
* **counting host work**: :func:`binding_reads` (the pointer and gradient reads of the binding checks) and
  :func:`step_limit_checks` (the fused backend's checks of a range of step counts).

Each context manager restores what it changed when the block ends, also when it raises.

May import: any layer (a loose module at the package's top).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["KernelInfo", "KernelCallRecord", "isolated_kernel_cache", "kernels", "compiler", "recompile_limit",
           "direct_calls", "direct_call_override", "kernel_calls", "one_call_devices",
           "large_quantized_buffers_in_one_call", "inductor_rounds_casts", "binding_reads", "step_limit_checks"]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


# -- the compiled backend -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelInfo:
    """One compiled kernel of the cache: its name (the optimizer, dtype, device and structure it was made for)
    and its direct call (``None``: not tried yet; ``False``: dynamo's guarded call is kept; ``True``: after its
    first call it runs without dynamo's frame)."""

    name: str
    direct: bool | None


@contextlib.contextmanager
def isolated_kernel_cache() -> Iterator[None]:
    """The compiled backend with an empty kernel cache and no remembered compile failures inside the block; the
    process's cache comes back after it (a failure injected inside cannot leak into later optimizers)."""
    from dml_optim.backends import compiled

    with _patched(compiled, "_KERNELS", {}), _patched(compiled, "_BROKEN", {}):
        yield


def kernels() -> list[KernelInfo]:
    """The compiled kernels made so far (in this cache: see :func:`isolated_kernel_cache`), oldest first."""
    from dml_optim.backends import compiled

    out = []
    for key, fn in compiled._KERNELS.items():
        direct = None if not hasattr(fn, "_dml_direct") else fn._dml_direct is not None
        out.append(KernelInfo(compiled._key_name(key), direct))
    return out


@contextlib.contextmanager
def compiler(compile_fn: Callable[..., Callable]) -> Iterator[None]:
    """Compile the compiled backend's kernels with ``compile_fn`` (``torch.compile``'s signature: the function,
    then keywords) inside the block, in a kernel cache of its own, with the compiler taken as available on every
    device.  ``compiler(lambda fn, **kw: fn)`` runs the kernels' Python code eagerly (what torch.compile would
    trace, in seconds); a ``compile_fn`` whose result raises is a compile failure."""
    from dml_optim.backends import compiled

    with isolated_kernel_cache(), _patched(compiled, "_torch_compile", compile_fn), \
            _patched(compiled, "compile_available", lambda device_type: (True, "")):
        yield


@contextlib.contextmanager
def recompile_limit(limit: int) -> Iterator[None]:
    """dynamo's recompile limit as the compiled backend sees it, ``limit`` inside the block."""
    from dml_optim.backends import compiled

    with _patched(compiled, "_recompile_limit", lambda: limit):
        yield


@contextlib.contextmanager
def direct_calls(enabled: bool) -> Iterator[None]:
    """Whether a verified kernel is called without dynamo's frame after its first call (the default, True)."""
    from dml_optim.backends import direct

    with _patched(direct, "DIRECT_CALLS", enabled):
        yield


@contextlib.contextmanager
def direct_call_override(call: Callable[[list], Any]) -> Iterator[None]:
    """Replace what the direct call of a kernel does with ``call(args)`` inside the block (a direct call that
    disagrees with dynamo's, to see it refused by the probe that compares the two)."""
    from dml_optim.backends import direct

    with _patched(direct._Direct, "__call__", lambda self, args: call(args)):
        yield


@dataclass(frozen=True)
class KernelCallRecord:
    """One compiled kernel call: its operands (the first one's length is the call's elements, or blocks for a
    quantized buffer) and what the kernel returned."""

    args: tuple
    out: Any


@contextlib.contextmanager
def kernel_calls() -> Iterator[list[KernelCallRecord]]:
    """Record every compiled kernel call inside the block (calls go through dynamo's frame meanwhile: no direct
    call is made for a kernel first called here)."""
    from dml_optim.backends import compiled

    records: list[KernelCallRecord] = []
    real = compiled.kernel

    def recording(key):
        fn = real(key)

        def call(*args):
            out = fn(*args)
            records.append(KernelCallRecord(args, out))
            return out

        call._dml_code = fn._dml_code  # (dynamo's cache entries are counted on the compiled code)
        return call

    with _patched(compiled, "kernel", recording):
        yield records


def one_call_devices() -> tuple[str, ...]:
    """The device types whose compiled kernel takes a quantized buffer of any size in one call (the CPU from
    torch 2.13); elsewhere the kernel runs in chunks within the scratch bound."""
    from dml_optim.backends import compiled

    return tuple(compiled._ONE_CALL_DEVICES)


@contextlib.contextmanager
def large_quantized_buffers_in_one_call(devices: tuple[str, ...]) -> Iterator[None]:
    """:func:`one_call_devices` as ``devices`` inside the block (``()``: every device runs in chunks)."""
    from dml_optim.backends import compiled

    with _patched(compiled, "_ONE_CALL_DEVICES", tuple(devices)):
        yield


def inductor_rounds_casts() -> bool:
    """Inductor can round intermediate low-precision casts (``emulate_precision_casts``, torch >= 2.5): where it
    cannot, a Kahan-compensated buffer runs eager, announced."""
    from dml_optim.backends.inductor import _emulates_casts

    return _emulates_casts()


# -- host work ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def binding_reads() -> Iterator[Counter]:
    """Count the reads the binding checks make inside the block: ``"data_ptr"`` (a parameter's address) and
    ``"grad"`` (a parameter's gradient attribute).  ``checks="refs"`` makes none on a repeated step."""
    from dml_optim.core import bindings

    reads: Counter = Counter()

    def counting(name, real):
        def read(t):
            reads[name] += 1
            return real(t)
        return read

    with _patched(bindings, "_DATA_PTR", counting("data_ptr", bindings._DATA_PTR)), \
            _patched(bindings, "_GRAD", counting("grad", bindings._GRAD)):
        yield reads


@contextlib.contextmanager
def step_limit_checks() -> Iterator[list[int]]:
    """Record the first count of every range of step counts the fused backend checks inside the block (that the
    counts stay under the step limit and give scalars the compute dtype holds)."""
    from dml_optim.backends import fused

    firsts: list[int] = []
    real = fused._counts_in_range

    def counting(rule, group, flat, first, n):
        firsts.append(first)
        return real(rule, group, flat, first, n)

    with _patched(fused, "_counts_in_range", counting):
        yield firsts
