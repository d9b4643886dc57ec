"""Record the aten ops of one optimizer step and classify them for DirectML.

:func:`audit_step` runs one ``optimizer.step()`` under a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` recorder (wherever the
parameters live: CPU, CUDA, DirectML) and resolves every recorded aten op with
the dispatch table of torch-directml 0.2.5 shipped in the package
(:mod:`dml_optim.dml.dispatch`): what the same step would dispatch on a
DirectML device, which ops would fall back to the CPU, how many host
synchronisations and new allocations it makes.

Long by design: one report, its recorder, its counting rules and their resolution against the dispatch table
belong together.

Counting rules (what :class:`AuditReport` reports):

* **ops**: :mod:`dml_optim.core.opcount`'s definition, shared with the
  benchmarks: every aten op that reaches the dispatcher below autograd and
  does work; view ops (``slice.Tensor``, ``view``, ``detach``: metadata only)
  are counted apart as ``views``; ops outside the ``aten`` namespace
  (``profiler::_record_function_*``, which ``torch.optim.Optimizer`` wraps
  around every ``step``) are not counted.
* **foreach ops** (``aten::_foreach_*``) count as *one op per tensor* of their
  first list: torch-directml has no foreach kernels, so
  ``_foreach_lerp_.Scalar`` over 161 tensors runs as 161 ``lerp_.Scalar``; they
  resolve as that per-tensor op (:func:`~dml_optim.dml.dispatch.foreach_element_op`).
* **resolution**: the table's entry; ``native`` and ``native via aten::X.out``
  are native; a ``composite`` op is resolved through what it decomposes into
  (:class:`dml_optim.dml.dispatch.Resolver`; e.g. ``mul_.Scalar`` →
  ``mul_.Tensor``: native).  If no decomposition can be run the op stays
  ``composite`` (neither native nor a fallback).
* **host syncs**: calls of ``aten::_local_scalar_dense`` (``.item()``,
  ``bool(t)``, ``float(t)``) and of ops whose output size depends on the data
  (``nonzero``, ``masked_select``, ``unique``...), *except* reads of
  torch.optim's CPU step counters (below).
* **CPU step-counter reads**: torch.optim keeps the non-capturable, non-fused
  ``state["step"]`` tensors on the CPU on every device, so reading them
  (``_get_value(step)`` → ``.item()``) does not wait for the device.  The audit
  collects those tensors (before and after the step, so a first step counts
  too) and reports their reads separately, as ``cpu_step_reads``; every other
  op whose first tensor operand is such a counter (``_foreach_add_`` of the
  step count) runs on the CPU, not on DirectML, and is listed in
  ``host_ops``, not in ``ops``.  This rule is a statement about where
  torch.optim puts those tensors, not something the recording can observe
  when everything runs on one CPU.
* **allocations**: the tensors the step's ops return new: the outputs the op's
  schema does not alias to an argument (an in-place op's ``self``, an ``out=``
  argument and a view are aliases; a functional op's result is new), excluding
  empty tensors, 0-d CPU tensors (Python scalars wrapped by torch) and a result
  that shares an argument's storage where the device has storages
  (``_unsafe_view``, whose schema names no alias).  Decided from the schema, not
  from storage addresses: the allocator may hand a new tensor the address of a
  storage the step freed (the caller's first gradients, once they are moved into
  the flat buffer), which an address comparison counted as old, by chance of
  the allocator's placement; and a device without storages (DirectML) has no
  address to compare.  ``peak_allocated_bytes``: the most of those alive at once
  (freed when the step drops its last reference to the tensor an op returned).
* **bytes moved** (memory traffic, what a bandwidth-bound device spends its
  time on): per op that does work, each *distinct* tensor it reads (an
  argument that is not an ``out=`` argument, counted once however often it
  appears, ``numel * element_size`` of the tensor as passed: a view counts
  its own elements) and each tensor it writes (a returned tensor, an
  ``out=`` argument, the ``self`` of an in-place op); an in-place op's
  ``self`` is counted both read and written, an ``out=`` argument written
  only.  Views and the ops on torch.optim's CPU step counters move nothing on
  the device.  ``least_bytes``: what any step must move, reading the
  parameters, gradients and states once and writing the parameters and states
  once (the optimizer's own tensors: codes and scales for a quantized state).
* **fallback bus bytes**: an op that falls back to the CPU on DirectML copies
  the tensors it reads to the host and the tensors it writes back: its bytes
  cross the bus as well as the device's memory, so they count twice in
  ``bytes_with_fallbacks`` (``bytes_moved + fallback_bus_bytes``).
* **scratch kept**: the bytes of the tensors a ``dml_optim`` optimizer keeps
  between steps beyond parameters, gradients and states (the eager rule's
  scratch, the masked update's owner index); torch.optim keeps none.

Limitations: the recording sees what the dispatcher sees.  A device-to-host
copy through ``.tolist()``/``.numpy()``/``.cpu()`` is only visible when the
parameters are on an accelerator; on the CPU it is no op at all.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from dml_optim.dml.dispatch import Resolver, foreach_element_op, overload_of, to_meta
from dml_optim.core.opcount import OpRecorder, is_view

__all__ = [
    "AuditReport",
    "audit_step",
    "audit_call",
    "audit_torch_equivalent",
    "HOST_SYNC_OPS",
    "CPU_STEP_READS_NOTE",
]

#: Ops that wait for the device: a scalar read, or an output whose size depends on the data.
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::equal",
    "aten::repeat_interleave.Tensor",
})

CPU_STEP_READS_NOTE = (
    "CPU step-counter reads (not a device sync on DirectML): torch.optim keeps "
    "non-capturable state['step'] tensors on the CPU on every device"
)

# --------------------------------------------------------------------------
# the recorder
# --------------------------------------------------------------------------


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, or None for a tensor without one (DirectML's, the stand-in's)."""
    if not torch._C._has_storage(t):
        return None
    return t.untyped_storage().data_ptr()


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _first_operand(args) -> list[torch.Tensor]:
    """The first tensor argument, or the tensors of the first tensor list."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return [a]
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            return list(a)
    return []


def _element_args(args, kwargs) -> tuple[list, dict]:
    """Arguments of the first per-tensor call a ``_foreach_*`` op makes."""
    def first(v):
        return v[0] if isinstance(v, (list, tuple)) and v else v

    return [first(a) for a in args], {k: first(v) for k, v in kwargs.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensor arguments the same operand: the same elements of the same memory."""
    ptr = t.data_ptr() if torch._C._has_storage(t) else id(t)  # (a tensor without storage: by identity)
    return (ptr, t.dtype, tuple(t.shape), tuple(t.stride()), t.device)


def op_bytes(func, args, kwargs, out) -> tuple[int, int]:
    """``(read, written)`` bytes of one op call (the audit's rule, see the module docstring).

    Arguments are bound to the op's schema: an argument the schema marks as written (``Tensor(a!)``) is
    written; it is read too unless it is an ``out=`` argument (keyword-only); every other tensor argument is
    read.  Without a written argument, the returned tensors are written.  Each distinct tensor counts once
    per side.
    """
    reads: dict[tuple, int] = {}
    writes: dict[tuple, int] = {}
    arguments = func._schema.arguments
    for i, arg in enumerate(arguments):
        if i < len(args) and not arg.kwarg_only:
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            continue
        written = arg.alias_info is not None and arg.alias_info.is_write
        is_out = written and (getattr(arg, "is_out", False) or arg.kwarg_only)
        for t in _tensors(value):
            key = _tensor_key(t)
            if written:
                writes[key] = _nbytes(t)
            if not is_out:
                reads[key] = _nbytes(t)
    if not any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
        for t in _tensors(out):
            writes[_tensor_key(t)] = _nbytes(t)
    return sum(reads.values()), sum(writes.values())


@dataclass
class _Event:
    name: str
    count: int
    first_ptrs: tuple[int, ...]
    element: str | None
    func: Any
    view: bool
    read: int = 0
    written: int = 0


class _Recorder(OpRecorder):
    """The shared op recorder (:mod:`dml_optim.core.opcount`), plus what the audit needs: the
    storages of each op's first operand, foreach ops per tensor, and allocations."""

    def __init__(self):
        super().__init__(compiled=False)
        self.records: list[_Event] = []
        self.allocations = 0
        self.allocated_bytes = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._meta_args: dict[str, tuple] = {}

    def on_op(self, func, args, kwargs, out) -> None:
        super().on_op(func, args, kwargs, out)
        name = func.name()
        first = _first_operand(args)
        element = foreach_element_op(name)
        count = max(1, len(first)) if element is not None else 1
        if name not in self._meta_args:  # one example call per op, as meta tensors, for decompositions
            call_args, call_kwargs = _element_args(args, kwargs) if element is not None else (args, kwargs)
            self._meta_args[name] = (to_meta(list(call_args)), to_meta(dict(call_kwargs)))
        view = is_view(func)
        read, written = (0, 0) if view else op_bytes(func, args, kwargs, out)
        self.records.append(_Event(name, count, tuple(_storage_ptr(t) for t in first), element, func, view,
                                   read, written))
        self._count_allocations(func, args, kwargs, out)

    def _count_allocations(self, func, args, kwargs, out) -> None:
        returns = func._schema.returns
        if len(returns) == 1:
            outs = (out,)
        elif isinstance(out, (tuple, list)) and len(out) == len(returns):
            outs = tuple(out)
        else:  # (not the schema's shape: nothing to attribute)
            return
        inputs = None
        for ret, value in zip(returns, outs):
            if ret.alias_info is not None:  # (a view, an in-place self or an out= argument returned)
                continue
            for t in _tensors(value):
                if t.numel() == 0 or (t.dim() == 0 and t.device.type == "cpu"):
                    continue
                ptr = _storage_ptr(t)
                if ptr is not None:
                    if inputs is None:
                        inputs = {_storage_ptr(a) for a in _tensors((args, kwargs))}
                    if ptr in inputs:  # (an unannotated alias: _unsafe_view)
                        continue
                self.allocations += 1
                size = t.untyped_storage().nbytes() if ptr is not None else _nbytes(t)
                self.allocated_bytes += size
                self.live_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(t, self._freed, size)

    def _freed(self, size: int) -> None:
        self.live_bytes -= size


# --------------------------------------------------------------------------
# what the optimizer holds
# --------------------------------------------------------------------------


def _walk(value, seen: set[int], out: list[torch.Tensor], depth: int = 0) -> None:
    if depth > 6 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        out.append(value)
        if value.grad is not None:
            out.append(value.grad)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(k, seen, out, depth + 1)
            _walk(v, seen, out, depth + 1)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            _walk(v, seen, out, depth + 1)
    elif hasattr(value, "tensors") and type(value).__module__.startswith("dml_optim"):  # a quantized state
        _walk(value.tensors(), seen, out, depth + 1)
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("dml_optim"):
        _walk(vars(value), seen, out, depth + 1)


def _held_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients, states, flat buffers and scratch the optimizer holds."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    _walk(optimizer.param_groups, seen, out)
    _walk(optimizer.state, seen, out)
    if hasattr(optimizer, "flat_buffers"):
        _walk(optimizer.flat_buffers(), seen, out)
    return out


def _cpu_step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    """Storages of torch.optim's ``state['step']`` tensors that live on the CPU on every device."""
    from dml_optim.optimizers.base import FlatOptimizer

    if isinstance(optimizer, FlatOptimizer):
        return set()
    ptrs = set()
    for group in optimizer.param_groups:
        if group.get("capturable", False) or group.get("fused", False):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step") if p in optimizer.state else None
            if isinstance(step, torch.Tensor) and step.device.type == "cpu" and step.dim() == 0:
                ptrs.add(_storage_ptr(step))
    return ptrs


def _flat_buffer_count(optimizer: torch.optim.Optimizer) -> int:
    if hasattr(optimizer, "flat_buffers"):
        return len(optimizer.flat_buffers())
    return sum(len(g["params"]) for g in optimizer.param_groups)


def _describe(optimizer: torch.optim.Optimizer) -> str:
    from dml_optim.optimizers.base import FlatOptimizer

    cls = type(optimizer)
    if isinstance(optimizer, FlatOptimizer):
        return f"dml_optim.{cls.__name__}"
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    mode = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return f"{cls.__module__.replace('torch.optim.' + cls.__name__.lower(), 'torch.optim')}.{cls.__name__} ({mode})"


# --------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------


@dataclass
class AuditReport:
    """What one step dispatches, resolved for torch-directml 0.2.5.

    Attributes:
        optimizer: what was audited, e.g. ``"dml_optim.Adam"``.
        ops: ``(op, count, resolution)`` for the ops run on the parameters'
            device, most frequent first (foreach ops as their per-tensor op).
        total_ops: sum of the counts in ``ops``: kernels dispatched per step on DirectML
            (:mod:`dml_optim.core.opcount`'s definition: views excluded).
        views: view ops (metadata only, no kernel), counted apart.
        fallbacks: ``(op, count)`` of the ops that fall back to the CPU on DirectML.
        host_syncs: ops that wait for the device (see :data:`HOST_SYNC_OPS`).
        cpu_step_reads: reads of torch.optim's CPU step counters (not syncs).
        host_ops: ``(op, count)`` of ops on those CPU step counters (not on DirectML).
        allocations: tensors allocated by the step (see the module docstring).
        allocated_bytes: their total size.
        flat_buffers: flat buffers of a dml_optim optimizer, else parameter tensors.
        num_tensors, numel: parameter tensors and elements.
        device: where the step was recorded.
        bytes_read, bytes_written: the memory traffic of the device ops (see the module docstring).
        fallback_bus_bytes: the bytes of the ops that fall back on DirectML, which also cross the bus.
        least_bytes: what any step must move (parameters, gradients, states read once; parameters and
            states written once).
        scratch_bytes: tensors kept between steps beyond parameters, gradients and states.
        peak_allocated_bytes: the most bytes of the step's own allocations alive at once.
    """

    optimizer: str
    ops: list[tuple[str, int, str]]
    total_ops: int
    fallbacks: list[tuple[str, int]]
    host_syncs: int
    cpu_step_reads: int
    allocations: int
    flat_buffers: int
    views: int = 0
    allocated_bytes: int = 0
    host_ops: list[tuple[str, int]] = field(default_factory=list)
    num_tensors: int = 0
    numel: int = 0
    device: str = "cpu"
    kinds: dict[str, str] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_written: int = 0
    fallback_bus_bytes: int = 0
    least_bytes: int = 0
    scratch_bytes: int = 0
    peak_allocated_bytes: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes read plus bytes written by the step's device ops."""
        return self.bytes_read + self.bytes_written

    @property
    def bytes_with_fallbacks(self) -> int:
        """:attr:`bytes_moved` with each fallback's bytes counted a second time, over the bus."""
        return self.bytes_moved + self.fallback_bus_bytes

    def per_param(self, n: int) -> float:
        """``n`` bytes per parameter element (0 without parameters)."""
        return n / self.numel if self.numel else 0.0

    @property
    def fallback_ops(self) -> int:
        """Number of op calls that fall back to the CPU on DirectML."""
        return sum(n for _, n in self.fallbacks)

    @property
    def all_native(self) -> bool:
        """Every recorded device op resolves to a native DirectML kernel."""
        return all(self.kinds.get(op) == "native" for op, _, _ in self.ops)

    def non_native(self) -> list[tuple[str, int, str]]:
        """The ``ops`` entries that are not native (fallback, composite, unknown)."""
        return [row for row in self.ops if self.kinds.get(row[0]) != "native"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "device": self.device,
            "num_tensors": self.num_tensors,
            "numel": self.numel,
            "flat_buffers": self.flat_buffers,
            "total_ops": self.total_ops,
            "views": self.views,
            "fallback_ops": self.fallback_ops,
            "fallbacks": [{"op": op, "count": n} for op, n in self.fallbacks],
            "host_syncs": self.host_syncs,
            "cpu_step_reads": self.cpu_step_reads,
            "allocations": self.allocations,
            "allocated_bytes": self.allocated_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "bytes_moved": self.bytes_moved,
            "bytes_moved_per_param": self.per_param(self.bytes_moved),
            "fallback_bus_bytes": self.fallback_bus_bytes,
            "bytes_with_fallbacks": self.bytes_with_fallbacks,
            "bytes_with_fallbacks_per_param": self.per_param(self.bytes_with_fallbacks),
            "least_bytes": self.least_bytes,
            "least_bytes_per_param": self.per_param(self.least_bytes),
            "scratch_bytes": self.scratch_bytes,
            "scratch_bytes_per_param": self.per_param(self.scratch_bytes),
            "all_native": self.all_native,
            "ops": [{"op": op, "count": n, "resolution": how, "kind": self.kinds.get(op, "unknown")}
                    for op, n, how in self.ops],
            "host_ops": [{"op": op, "count": n} for op, n in self.host_ops],
        }

    def format(self, top: int | None = None) -> str:
        """A readable multi-line summary; ``top`` limits the op list."""
        lines = [
            f"{self.optimizer}: {self.num_tensors} parameter tensors, {self.numel:,} elements, "
            f"{self.flat_buffers} {'flat buffer(s)' if self.optimizer.startswith('dml_optim') else 'tensors'} "
            f"(recorded on {self.device}, resolved for torch-directml 0.2.5)",
            f"  aten ops per step on DirectML: {self.total_ops} (+{self.views} views, metadata only)",
            f"  CPU fallbacks on DirectML:     {self.fallback_ops} op calls"
            + (f" ({', '.join(f'{op} x{n}' for op, n in self.fallbacks)})" if self.fallbacks else ""),
            f"  host syncs:                    {self.host_syncs}",
            f"  CPU step-counter reads:        {self.cpu_step_reads} (not a device sync on DirectML)",
            f"  allocations:                   {self.allocations} ({_bytes(self.allocated_bytes)}, "
            f"at most {_bytes(self.peak_allocated_bytes)} alive at once)",
            f"  bytes moved (read + written):  {_bytes(self.bytes_moved)}, "
            f"{self.per_param(self.bytes_moved):.1f} per parameter (least: {self.per_param(self.least_bytes):.1f})",
            f"  scratch kept between steps:    {_bytes(self.scratch_bytes)} "
            f"({self.per_param(self.scratch_bytes):.2f} per parameter)",
        ]
        if self.fallback_bus_bytes:
            lines.append(f"  fallbacks' bytes over the bus: {_bytes(self.fallback_bus_bytes)} (counted twice: "
                         f"{self.per_param(self.bytes_with_fallbacks):.1f} per parameter in all)")
        if self.host_ops:
            lines.append(f"  ops on CPU step counters:      {sum(n for _, n in self.host_ops)} (run on the host)")
        rows = self.ops if top is None else self.ops[:top]
        lines.append("  count  op                              DirectML resolution")
        for op, n, how in rows:
            lines.append(f"  {n:>5}  {op:<32} {how}")
        if top is not None and len(self.ops) > top:
            lines.append(f"  ... {len(self.ops) - top} more ops")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def audit_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, *, step: bool = True) -> AuditReport:
    """Run ``optimizer.step(closure)`` once under a recorder and classify what it dispatched.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (ours or torch's) whose
            parameters have gradients.
        closure: passed to ``step`` (its ops are recorded too).
        step: must be True (the audit is of one real step; kept for symmetry
            with callers that build the report from a step they run themselves).

    Returns:
        An :class:`AuditReport`.  The step really happens: parameters and
        states are updated as by a plain ``optimizer.step()``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if step is not True:
        raise ValueError(f"step must be True (audit_step runs one optimizer step), got {step!r}")
    return audit_call(optimizer, lambda: optimizer.step(closure) if closure is not None else optimizer.step())


def audit_call(optimizer: torch.optim.Optimizer, fn: Callable[[], Any]) -> AuditReport:
    """Like :func:`audit_step`, but record ``fn()`` (e.g. ``lambda: scaler.step(opt)``) as the step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _refuse_compiled(optimizer)
    if hasattr(optimizer, "_scratch_for_eager"):  # (a fused buffer runs the eager chain here: with its scratch)
        optimizer._scratch_for_eager()
    counters_before = _cpu_step_counters(optimizer)
    recorder = _Recorder()
    with recorder:
        fn()
    counters = counters_before | _cpu_step_counters(optimizer)
    return _report(optimizer, recorder, counters)


def _refuse_compiled(optimizer) -> None:
    """A torch.compile'd rule is one fused kernel, not the op chain DirectML runs: refuse it."""
    from dml_optim.optimizers.base import FlatOptimizer

    if not isinstance(optimizer, FlatOptimizer):
        return
    if any(b == "compiled" for names in optimizer.resolved_backends() for b in names):
        raise ValueError(
            "audit_step audits the eager op chain that DirectML runs, but this optimizer compiles some of its "
            "flat buffers (torch.compile on CPU/CUDA); construct it with backend='eager' to audit it"
        )


def _report(optimizer, recorder: _Recorder, counters: set[int]) -> AuditReport:
    resolve = Resolver()
    ops: Counter = Counter()
    host_ops: Counter = Counter()
    host_syncs = cpu_reads = 0
    views = 0
    read_by: Counter = Counter()
    written_by: Counter = Counter()
    for ev in recorder.records:
        if ev.view:  # metadata only (opcount's definition): counted apart from the ops
            views += ev.count
            continue
        on_counters = bool(ev.first_ptrs) and all(p in counters for p in ev.first_ptrs)
        if ev.name in HOST_SYNC_OPS:
            if on_counters:
                cpu_reads += ev.count
                continue
            host_syncs += ev.count
        if on_counters:
            host_ops[ev.name] += ev.count
            continue
        ops[ev.element or ev.name] += ev.count
        read_by[ev.element or ev.name] += ev.read
        written_by[ev.element or ev.name] += ev.written
    funcs = {ev.element or ev.name: (ev.func if ev.element is None else None, ev.name) for ev in recorder.records}
    rows, kinds, fallbacks = [], {}, []
    for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
        func, recorded = funcs[op]
        meta_args, meta_kwargs = recorder._meta_args.get(recorded, ((), {}))
        kind, how = resolve(op, func if func is not None else overload_of(op), meta_args, meta_kwargs)
        rows.append((op, n, how))
        kinds[op] = kind
        if kind == "fallback":
            fallbacks.append((op, n))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = str(params[0].device) if params else "cpu"
    return AuditReport(
        optimizer=_describe(optimizer),
        ops=rows,
        total_ops=sum(ops.values()),
        views=views,
        fallbacks=fallbacks,
        host_syncs=host_syncs,
        cpu_step_reads=cpu_reads,
        allocations=recorder.allocations,
        allocated_bytes=recorder.allocated_bytes,
        flat_buffers=_flat_buffer_count(optimizer),
        host_ops=sorted(host_ops.items(), key=lambda kv: (-kv[1], kv[0])),
        num_tensors=len(params),
        numel=sum(p.numel() for p in params),
        device=device,
        kinds=kinds,
        bytes_read=sum(read_by.values()),
        bytes_written=sum(written_by.values()),
        fallback_bus_bytes=sum(read_by[op] + written_by[op] for op, _ in fallbacks),
        least_bytes=_least_bytes(optimizer),
        scratch_bytes=_scratch_bytes(optimizer),
        peak_allocated_bytes=recorder.peak_bytes,
    )


def _flats(optimizer) -> list:
    """The flat buffers of a ``dml_optim`` optimizer (the engine's own objects: the owner index too)."""
    layouts = getattr(optimizer, "_layout", None)
    if layouts is not None:
        return [flat for layout in layouts for flat in layout.buffers]
    return list(optimizer.flat_buffers())


def _least_bytes(optimizer) -> int:
    """What any step of ``optimizer`` must move: parameters (or the master copy) and states read and written
    once, gradients read once (the Kahan compensation as a state)."""
    from dml_optim.core.quant import tensors_of

    if hasattr(optimizer, "flat_buffers"):
        total = 0
        for flat in _flats(optimizer):
            values = [flat.data] + [t for t in (flat.master, flat.kahan) if t is not None]
            states = [t for s in flat.states.values() for t in tensors_of(s)]
            total += 2 * sum(map(_nbytes, values + states)) + (_nbytes(flat.grad) if flat.grad is not None else
                                                              _nbytes(flat.data))
        return total
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            tensors = [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0]
            total += 2 * (_nbytes(p) + sum(map(_nbytes, tensors))) + _nbytes(p.grad)
    return total


def _scratch_bytes(optimizer) -> int:
    """Bytes a ``dml_optim`` optimizer keeps between steps beyond its parameters, gradients and states."""
    if not hasattr(optimizer, "flat_buffers"):
        return 0
    total = 0
    for flat in _flats(optimizer):
        kept = list(getattr(flat, "scratch", None) or [])
        owner = getattr(flat, "_owner", None)
        if owner is not None:
            kept.append(owner)
        total += sum(map(_nbytes, kept))
    return total


# --------------------------------------------------------------------------
# the torch.optim equivalent (the registry's)
# --------------------------------------------------------------------------


def audit_torch_equivalent(name: str, params: Sequence[torch.Tensor], *, foreach: bool | None = True,
                           fused: bool | None = None, warmup: int = 1, **hyper) -> AuditReport:
    """Audit one step of the torch.optim equivalent of ``name``
    (:func:`dml_optim.optimizers.registry.torch_equivalent`, the nearest twin).

    ``params`` must have gradients.  ``warmup`` steps run first (unrecorded),
    so the audited step is a steady-state one (states already allocated).
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    from dml_optim.optimizers.registry import torch_equivalent

    opt = torch_equivalent(name, params, foreach=foreach, fused=fused, **hyper)
    for _ in range(warmup):
        opt.step()
    return audit_step(opt)
