"""The ``eager`` backend: the rule as a chain of element-wise ops over the flat buffer (DirectML's path).

Every op of :mod:`dml_optim.core.functional` is a native DirectML kernel, so this is what DirectML runs
(and what the CPU and CUDA run for small buffers, gated steps and the compiled backend's fallbacks):

* **plan** (:meth:`EagerBackend.plan`): for each class of parameters that step together
  (:class:`~dml_optim.core.steps.StepClass`), the step limit is checked and, when the host knows the count
  and the step is not gated, the rule's scalars are computed on the host as Python numbers (range-checked
  against the compute dtype, kept per settings token and count): no device op, no sync.  Parameters at
  several counts on :data:`MASKED_DEVICES` take one masked update instead (:func:`masked_plan`);
* **scratch**: the rule's temporaries are preallocated once and kept (:func:`ensure_scratch`,
  :func:`scratch_layout`), within :func:`scratch_budget` (32 MiB or 0.5 bytes per element, whichever is
  larger): full size when that fits, or when nothing converts on a device outside
  :data:`PLAIN_CHUNK_DEVICES`; else the rule runs chunk by chunk.  Converted operands (a wider compute
  dtype, Kahan summation) take chunks of :data:`~dml_optim.core.options.CHUNK_ELEMENTS` elements; a
  quantized buffer's chunks are sized by :func:`chunk_elements` (its scratch: the
  rule's, one decoded buffer per state, the encoder's per-block divisor, the decoder's index), decoded
  into the scratch, encoded in place, its parameters' padding zeroed by position
  (:func:`padding_positions`): nothing is allocated after the first step.  A plan names both
  (:attr:`EagerPlan.chunk`, :attr:`EagerPlan.scratch`);
* **run** (:meth:`EagerBackend.run`): the rule per class (counts on the host, or on the device for gated
  and ``capturable`` steps), or the masked update.
"""

from __future__ import annotations

import contextlib
import operator
import time

import torch

from dml_optim.backends.base import ClassUpdate, EagerPlan, eager_cache, MaskedUpdate, Route, SteadyCall, StepRequest, grad_range, runtime
from dml_optim.core.dtypes import check_range, check_step_limit, compute_dtype, converts
from dml_optim.core.options import CHUNK_ELEMENTS
from dml_optim.core.packing import storage_less_device
from dml_optim.core.rule import Rule
from dml_optim.core.update import (AS_DEVICE, coefficient_dtype, conversion_count, masked_scalars, masked_step, run_rule,
                                   step_scalars, storage_dtype)

__all__ = ["EagerBackend", "BACKEND", "chunk_elements", "MASKED_DEVICES", "MIN_SCRATCH", "SCRATCH_PER_ELEMENT", "PLAIN_CHUNK_DEVICES",
           "several_counts", "masks", "ensure_scratch", "scratch_layout", "scratch_budget", "laid_out_as", "padding_positions",
           "plan_updates", "masked_plan", "steady_call", "apply_class", "apply_range", "apply_masked", "forget_device_counts"]

#: Devices where parameters at several step counts take one masked update (:func:`masks`).
#: Not the CPU: there one update per run of parameters at one count, in the buffer's order, is faster
#: (2 cores, 40 x 16k parameters with changing None patterns, AdamW: per-element gathers made the masked
#: kernel 5.7 ms a step; 4.2M elements at two counts: 3.5 ms masked, 1.7 ms as two eager updates).
MASKED_DEVICES = ("privateuseone", "cuda")

#: The scratch a chunked eager step may keep, in bytes: this or :data:`SCRATCH_PER_ELEMENT` bytes per element of
#: the buffer, whichever is larger (issue 34: the step's own memory within 32 MB or 0.5 B/param).
MIN_SCRATCH = 32 << 20
SCRATCH_PER_ELEMENT = 0.5
#: Devices where a buffer that converts nothing (FP32 parameters, states and arithmetic) runs its rule in chunks
#: once a full-size scratch would be over the bound (:func:`scratch_budget`): DirectML, where memory is a 4-16 GB
#: card's and the chunks cost a few dispatches (AdamW: 8 ops per chunk; resnet50 32 instead of 8, gpt2 64).
#: Not the CPU: there 4 chunks of 6.4M elements took 1.4x to 1.75x the time of one call on 25.6M (AdamW, 2 threads
#: on the shared 2-core VM, where every op's parallel region waits for a descheduled thread; equal with 1 thread),
#: and the CPU steps a large FP32 buffer eagerly only when asked to (its default is torch's fused kernel).  Not
#: CUDA either, unmeasured there (its eager path runs where compiling is unavailable).
PLAIN_CHUNK_DEVICES = ("privateuseone",)
#: Device types whose tensors have no storage (DirectML): a scratch tensor cannot serve as another dtype's through a
#: dtype view there (:func:`scratch_layout`; the audit lays a CPU step out as DirectML's).
OPAQUE_DEVICES = ("privateuseone",)

#: The device type whose scratch policy :func:`scratch_layout` follows instead of the buffer's own (None: its own;
#: :func:`laid_out_as`).
_LAYOUT_DEVICE: list[str | None] = [None]


@contextlib.contextmanager
def laid_out_as(device_type: str | None):
    """Within it, buffers get the scratch layout of ``device_type`` and compute their on-device coefficients in its
    dtype (``"privateuseone"``: the audit records a CPU step as DirectML lays it out and computes it, and a test
    checks a run on the stand-in against the CPU's); the layout is made at a buffer's first step, and kept."""
    saved = _LAYOUT_DEVICE[0], AS_DEVICE[0]
    _LAYOUT_DEVICE[0] = AS_DEVICE[0] = device_type
    try:
        yield
    finally:
        _LAYOUT_DEVICE[0], AS_DEVICE[0] = saved


def several_counts(group, flat) -> bool:
    """The parameters of ``flat`` with a gradient have two or more step counts, all known on the host,
    and the buffer can step them in its order (not ``capturable``; operands in the compute dtype: no
    chunks, no Kahan, no quantized states; its own storage): no re-pack for a new ``None`` pattern."""
    if group["capturable"] or not flat.owned or flat.staged or converts(group, flat):
        return False
    active = {c.count for c in flat.counter.classes if c.active}
    return len(active) >= 2 and None not in active


def masks(group, flat, masked_kernel: bool) -> bool:
    """Whether ``flat`` steps as one masked update (:func:`masked_plan`) rather than one update per
    run of parameters at one count: on :data:`MASKED_DEVICES` (DirectML: O(1) ops whatever the
    pattern; CUDA: one kernel instead of a launch per run), with several counts
    (:func:`several_counts`) in three or more runs, or two when the masked update compiles
    (``masked_kernel``)."""
    if flat.device.type not in MASKED_DEVICES or not several_counts(group, flat):
        return False
    if sum(c.active for c in flat.counter.classes) >= 3:
        return True
    # two runs (e.g. the layers unfrozen last, and the others): two plain eager rules cost fewer
    # passes over memory than one masked eager update; one compiled kernel beats two
    return masked_kernel


def chunk_elements(numel: int, bytes_per_element: int, *, ops_per_chunk: int, max_scratch: int | None = None,
                   min_scratch: int = MIN_SCRATCH, scratch_per_param: float = SCRATCH_PER_ELEMENT,
                   max_ops: int | None = None, align: int = 256) -> int:
    """How many elements one chunk of an eager step over ``numel`` elements takes, at ``bytes_per_element`` bytes of
    scratch per chunk element: the scratch may be ``max(min_scratch, scratch_per_param * numel)`` bytes
    (``max_scratch`` overrides); the chunks are made equal, rounded up to ``align`` (whole blocks); with
    ``max_ops``, ValueError if the step would dispatch more than ``max_ops`` ops (``ops_per_chunk`` each)."""
    if numel <= 0:
        return 0
    budget = max_scratch if max_scratch is not None else max(min_scratch, int(scratch_per_param * numel))
    largest = max(align, budget // max(1, bytes_per_element) // align * align)
    chunks = -(-numel // largest)
    size = -(-numel // chunks)
    size = -(-size // align) * align
    if max_ops is not None and chunks * ops_per_chunk > max_ops:
        raise ValueError(f"{numel} elements in chunks of {size} take {chunks * ops_per_chunk} ops, over {max_ops}")
    return min(size, -(-numel // align) * align)


def ensure_scratch(rule: Rule, group, flat, gated: bool, compiled: bool) -> None:
    """Scratch for the eager rule: full size, or one chunk when it converts; none for a compiled
    buffer (the fused kernel needs none; an eager call on it, under a dispatch mode, allocates).

    A quantized buffer's chunk is sized by :func:`chunk_elements`: its scratch (the
    rule's, one decoded buffer per state, the encoder's per-block divisor, the decoder's int32 index,
    which shares the rule's first scratch tensor when it has one) stays within 32 MiB or 0.5 bytes per
    element, whichever is larger, in as few equal chunks as that allows (:func:`scratch_layout`)."""
    if compiled:
        flat.scratch = []
        return
    size, cdtype, count, extras = scratch_layout(rule, group, flat, gated)
    if (len(flat.scratch) == count + len(extras) and all(t.numel() == size for t in flat.scratch[:count])
            and all(t.numel() == n and t.dtype == d for t, (n, d) in zip(flat.scratch[count:], extras))):
        return
    flat.scratch = [torch.empty(size, dtype=cdtype, device=flat.device) for _ in range(count)]
    flat.scratch += [torch.empty(n, dtype=d, device=flat.device) for n, d in extras]


def scratch_layout(rule: Rule, group, flat, gated: bool) -> tuple:
    """``(chunk, compute dtype, count, extras)`` of ``flat``'s eager scratch: ``count`` tensors of ``chunk``
    elements (the rule's, then one per converted operand), then ``extras`` as ``(elements, dtype)``: a
    quantized buffer's per-block divisor and, when the rule keeps no scratch, the decoder's index."""
    convert = converts(group, flat)
    cdtype = compute_dtype(group, flat.dtype, flat.bits)
    n_rule = rule.scratch_count(group, gated)
    count = n_rule
    if convert:
        x = flat.master if flat.master is not None else flat.data
        count += conversion_count(x.dtype, flat.dtype, [storage_dtype(s) for s in flat.states.values()], cdtype,
                                  group["kahan"])
    itemsize = cdtype.itemsize
    budget = scratch_budget(flat.numel)
    if not convert:  # full size while that fits the bound (the rule in one call per range), else chunks
        device = _LAYOUT_DEVICE[0] or flat.device.type
        if count * itemsize * flat.numel <= budget or device not in PLAIN_CHUNK_DEVICES:
            return flat.numel, cdtype, count, []
        return (chunk_elements(flat.numel, count * itemsize, ops_per_chunk=0, max_scratch=budget, align=flat.align),
                cdtype, count, [])
    if not flat.bits:
        return min(flat.numel, CHUNK_ELEMENTS), cdtype, count, []
    # the decoder's index fits in the rule's first scratch tensor, viewed as int32: not on a device without storage
    # (DirectML: a dtype view reads the storage), which keeps it apart
    device = _LAYOUT_DEVICE[0] or flat.device.type
    shared = n_rule > 0 and itemsize >= 4 and device not in OPAQUE_DEVICES and not storage_less_device(flat.device)
    per_element = count * itemsize + (0 if shared else 4)
    divisor = itemsize / flat.align  # the encoder's divisor: one element per block
    size = min(flat.numel, chunk_elements(flat.numel, per_element, ops_per_chunk=0, align=flat.align,
                                          max_scratch=int(budget * per_element / (per_element + divisor))))
    extras = [(size // flat.align, cdtype)]  # the encoder's divisor
    if not shared:
        extras.append((size, torch.int32))  # the decoder's index (else in the rule's first scratch)
    return size, cdtype, count, extras


def scratch_budget(numel: int) -> int:
    """The bytes of scratch a buffer of ``numel`` elements may keep: :data:`MIN_SCRATCH` or
    :data:`SCRATCH_PER_ELEMENT` per element, whichever is larger."""
    return max(MIN_SCRATCH, int(SCRATCH_PER_ELEMENT * numel))


def padding_positions(flat, a: int, b: int) -> torch.Tensor | None:
    """The padding positions of elements ``[a, b)`` of an aligned buffer, relative to ``a`` (int64 on the
    device, from the host's layout, built once per layout and range and kept in the buffer's runtime record;
    None where the range has none)."""
    if flat.valid is None:
        return None
    cache = eager_cache(flat)
    if cache.layout is not flat.offsets:  # (none yet, or a new layout)
        cache.layout, cache.pads = flat.offsets, {}
    known = cache.pads
    if (a, b) not in known:
        where = [j - a for i, n in enumerate(flat.sizes)
                 for j in range(max(a, flat.offsets[i] + n), min(b, flat.offsets[i + 1]))]
        known[(a, b)] = torch.tensor(where, dtype=torch.int64, device=flat.device) if where else None
    return known[(a, b)]


def _host_scalars(request: StepRequest, count: int) -> dict:
    """The rule's host scalars after ``count`` completed steps, range-checked; kept per settings token and
    the buffer's dtype and bits, with the compute dtype they are checked against and the rule's constants (a
    steady step finds its count's, or computes only the coefficients of its new count; a scheduler's new
    ``lr`` is a new token: computed again)."""
    rule, group, flat = request.owner.rule, request.group, request.flat
    settings = runtime(flat).settings
    cache = eager_cache(flat)
    if (settings is None or cache.settings is not settings or cache.dtype is not flat.dtype
            or cache.bits != flat.bits):
        cache.settings, cache.dtype, cache.bits, cache.scalars = settings, flat.dtype, flat.bits, {}
        cache.compute = compute_dtype(group, flat.dtype, flat.bits)
        cache.constants = rule.constants(group)
    known = cache.scalars
    scalars = known.get(count)
    if scalars is None:
        if len(known) >= 64:
            known.clear()
        scalars = step_scalars(rule, group, count, None, constants=cache.constants)
        check_range(group, flat, scalars, cache.compute)
        known[count] = scalars
    return scalars


def plan_updates(request: StepRequest) -> tuple:
    """One :class:`ClassUpdate` per active class: host scalars whenever the host knows the count and the
    step is neither gated nor ``capturable`` (also a declined compiled call's fallback), step limits checked."""
    rule, group, flat = request.owner.rule, request.group, request.flat
    host = request.finite is None and not group["capturable"]
    updates = []
    for c in flat.counter.classes:
        if not c.active:
            continue
        scalars = None
        if c.count is not None:
            check_step_limit(rule, c.count)
            if host:
                scalars = _host_scalars(request, c.count)
        updates.append(ClassUpdate(c, scalars))
    return tuple(updates)


def masked_plan(request: StepRequest, compiled: bool) -> MaskedUpdate:
    """One masked update of the buffer (range-checked, nothing written).

    Parameters with a gradient at several step counts would take one update per count, and a
    re-pack whenever ``None`` gradients leave a count's parameters in pieces.  Instead the buffer
    steps once, in place and in its order (:func:`dml_optim.core.update.masked_step`): every scalar
    that differs between parameters has one value per parameter (the host's, for the
    parameter's count; the rule's no-op for a parameter without a gradient, whose gradient
    slot is zero), gathered to the elements by their owners (:meth:`FlatBuffer.owner`).  The op
    count does not depend on the pattern; the cost is the owner index (4 bytes per element,
    kept) and one compute-dtype tensor per varying scalar while the step runs (eager).
    """
    rule, group, flat = request.owner.rule, request.group, request.flat
    classes = flat.counter.classes
    by_count = {}
    for c in classes:
        if c.active and c.count not in by_count:
            check_step_limit(rule, c.count)
            by_count[c.count] = _host_scalars(request, c.count)
    fixed, names, rows = masked_scalars(rule, group, by_count, [c.count if c.active else None for c in classes],
                                        [c.stop - c.first for c in classes], fold=not compiled)
    table = torch.tensor(rows, dtype=compute_dtype(group, flat.dtype, flat.bits), device=flat.device)
    return MaskedUpdate(fixed, names, table.view(len(names), len(flat)))


class EagerBackend:
    """The eager rule: runs every buffer (see the module docstring)."""

    name = "eager"

    def supports(self, rule: Rule, group, flat) -> str | None:
        return None

    def plan(self, request: StepRequest, route: Route = Route(), last=None) -> EagerPlan:
        """This step's updates (nothing written but the scratch allocated the first time).  ``route.compiled``:
        the buffer's rule compiles (no scratch: its kernel needs none; an eager call on it, under a dispatch
        mode, allocates); ``route.masked``: a masked update would compile; ``route.timed``: the step's wall time
        counts toward ``auto``'s tiering.  ``last``: a repeat's previous plan, whose scratch, chunking and
        conversions it keeps (only the host scalars are new; they are kept per settings token and count)."""
        compiled, masked_kernel, timed = route.compiled, route.masked, route.timed
        group, flat = request.group, request.flat
        finite = request.finite
        if (last is not None and isinstance(last, EagerPlan) and last.masked is None and finite is None
                and last.request.finite is None and last.compiled_buffer == compiled
                and len(last.scratch) == len(flat.scratch) and all(map(operator.is_, last.scratch, flat.scratch))):
            # (a repeat: the same buffer, structure, classes and scratch; only the host scalars are new)
            updates = plan_updates(request)
            return EagerPlan(request, updates=updates, chunk=last.chunk, scratch=last.scratch, timed=timed,
                             converts=last.converts, compiled_buffer=compiled,
                             steady=steady_call(request, updates, last.scratch, last.converts, last.steady))
        if (finite is None and request.window is None and len(flat.counter.classes) > 1
                and masks(group, flat, masked_kernel)):  # (a range stepping alone: one update per class)
            ensure_scratch(request.owner.rule, group, flat, True, compiled or masked_kernel)
            return EagerPlan(request, masked=masked_plan(request, masked_kernel),
                             scratch=tuple(flat.scratch))
        ensure_scratch(request.owner.rule, group, flat, finite is not None, compiled)
        convert = converts(group, flat)
        chunk = flat.scratch[0].numel() if flat.scratch and (convert or flat.scratch[0].numel() < flat.numel) else 0
        return EagerPlan(request, updates=plan_updates(request), chunk=chunk, scratch=tuple(flat.scratch),
                         timed=timed, converts=convert, compiled_buffer=compiled)

    def run(self, plan: EagerPlan) -> None:
        request = plan.request
        if plan.masked is not None:
            apply_masked(request, plan.masked, plan.scratch)
            forget_device_counts(request.flat)
            return
        start = time.perf_counter() if plan.timed else 0.0
        call = plan.steady
        if call is not None:  # (one class over the whole buffer, its tensors bound: apply_range's common case)
            call.apply(*call.operands, scratch=call.scratch, **plan.updates[0].scalars)
        else:
            for update in plan.updates:
                apply_class(request, update, plan)
        if plan.timed:  # (CPU ops are synchronous: this is the step's own time)
            runtime(request.flat).eager_s += time.perf_counter() - start


#: The eager backend.
BACKEND = EagerBackend()


def forget_device_counts(flat) -> None:
    """After a masked update: the host counts advance; a stale device mirror is dropped."""
    for k in flat.counter.classes:
        if k.active:
            k.tensor = None


def steady_call(request: StepRequest, updates: tuple, scratch: tuple, convert: bool,
                kept: SteadyCall | None) -> SteadyCall | None:
    """A repeat's call of the rule over the whole buffer, its tensors bound once (:class:`SteadyCall`), the call :func:`apply_range` makes in its common case (one class at a host
    count over the whole buffer, ungated, nothing converted, a full-size scratch or none), so that a steady step
    only computes its host scalars.  ``kept``: the last step's, returned while the buffer's parameters, gradients,
    master copy and states are the same tensors (identities: a few pointer comparisons); None for any other step
    (several classes, counts on the device, conversions, chunks), which runs through :func:`apply_class`."""
    flat = request.flat
    if convert or request.finite is not None or request.window is not None or len(updates) != 1 or not flat.numel:
        return None  # (a range stepping alone reads its window: apply_range)
    c, scalars = updates[0]
    if scalars is None or c.tensor is not None or flat.segment(c.first, c.stop) != (0, flat.numel):
        return None
    if kept is not None:
        bound, states = kept.bound, flat.states
        if (bound[0] is flat.data and bound[1] is flat.grad and bound[2] is flat.master
                and all(map(operator.is_, bound[3:], map(states.get, kept.names)))):
            return kept
    rule, group = request.owner.rule, request.group
    names = rule.group_state_names(group)
    rule_scratch = scratch[:rule.scratch_count(group, False)]
    if rule_scratch and rule_scratch[0].numel() < flat.numel:
        return None  # (chunks)
    slots = list(rule_scratch) + [None] * (rule.scratch_slots - len(rule_scratch))
    states = tuple(flat.states[n] for n in names)
    x = flat.master if flat.master is not None else flat.data
    return SteadyCall(rule.apply, (x, flat.grad, *states), slots, (flat.data, flat.grad, flat.master, *states), names)


def apply_masked(request: StepRequest, masked: MaskedUpdate, scratch) -> None:
    """One masked update over the whole buffer (:func:`masked_plan`), eager."""
    rule = request.owner.rule
    flat = request.flat
    fixed, names, table = masked
    n = len(scratch) if scratch and scratch[0].numel() >= flat.numel else 0
    masked_step(rule, fixed, names, flat.data, flat.grad, *[flat.states[k] for k in rule.group_state_names(request.group)],
                table, flat.owner(), scratch=list(scratch[:n]) + [None] * (rule.scratch_slots - n))


def apply_class(request: StepRequest, update: ClassUpdate, plan: EagerPlan) -> None:
    """The eager rule over one class, with counts on the host (``update.scalars``) or on the device."""
    owner, group, flat, finite = request.owner, request.group, request.flat, request.finite
    rule = owner.rule
    c, scalars = update
    if scalars is None:  # counts on the device: the scalars are computed there
        if c.tensor is None:
            flat.counter.ensure_tensors(flat.device)
        scalars = step_scalars(rule, group, c.tensor, finite, coefficient_dtype(flat.device))
    start, end = flat.segment(c.first, c.stop)
    apply_range(request, start, end, scalars, plan.scratch, plan.converts,
                count=c.count if c.count is not None else c.tensor)
    if c.tensor is not None:
        if c.count is not None and finite is None and not group["capturable"]:
            c.tensor = None  # the host count advances; a stale device mirror is dropped
        else:
            c.tensor.add_(finite.long() if finite is not None else 1)


def apply_range(request: StepRequest, start: int, end: int, scalars, scratch, convert: bool | None = None,
                count=None) -> None:
    """The rule over elements ``[start, end)`` of the buffer, chunked when operands are converted (``convert``:
    :func:`~dml_optim.core.dtypes.converts`, when the caller knows it).  ``count``: the range's step count (an
    int, or its tensor on the device), which keys stochastic rounding's numbers with each element's index."""
    owner, group, flat, finite = request.owner, request.group, request.flat, request.finite
    rule = owner.rule
    names = rule.group_state_names(group)
    x = flat.master if flat.master is not None else flat.data
    out = flat.data if flat.master is not None else None
    cdtype = compute_dtype(group, flat.dtype, flat.bits)
    n_rule = rule.scratch_count(group, finite is not None)
    rule_scratch, conversions = scratch[:n_rule], scratch[n_rule:]
    scratch_full = bool(scratch) and scratch[0].numel() >= flat.numel
    if not (converts(group, flat) if convert is None else convert):
        # one call over the range with a full-size scratch (or none: the rule allocates), else chunk by chunk
        chunk = rule_scratch[0].numel() if rule_scratch and not scratch_full else end - start
        for a in range(start, end, chunk or 1):
            b = min(a + chunk, end)
            if a == 0 and b == flat.numel and request.window is None:  # the common case: the whole buffer, no view op
                xs, gs, ss = x, flat.grad, [flat.states[n] for n in names]
                slots = list(rule_scratch) if scratch_full else []
            else:
                xs, gs, ss = x[a:b], grad_range(flat, request.window, a, b), [flat.states[n][a:b] for n in names]
                slots = [s[a:b] for s in rule_scratch] if scratch_full else [s[: b - a] for s in rule_scratch]
            slots += [None] * (rule.scratch_slots - len(slots))
            if finite is None and request.grad_scale is None:
                rule.apply(xs, gs, *ss, scratch=slots, **scalars)
            else:
                run_rule(rule, xs, gs, ss, scalars, compute_dtype=cdtype, finite=finite, scratch=slots,
                         grad_scale=request.grad_scale)
        return
    chunk = scratch[0].numel() if scratch and scratch[0].numel() else CHUNK_ELEMENTS
    index = small = None
    if flat.bits and conversions:  # quantized: the decoder's index, the encoder's divisor; padding zeroed by position
        shared = conversions[-1].dtype != torch.int32  # (as scratch_layout made it: no index of its own)
        n_conv = len(conversions) - (1 if shared else 2)
        small = conversions[n_conv]
        index = rule_scratch[0].view(torch.int32) if shared else conversions[n_conv + 1]
        conversions = conversions[:n_conv]
    rounding = flat.rounding
    for a in range(start, end, chunk):
        b = min(a + chunk, end)
        k = b - a
        key = rounding._replace(count=count, start=flat.draw_start(a, b)) if rounding is not None else None
        run_rule(rule, x[a:b], grad_range(flat, request.window, a, b), [flat.states[n][a:b] for n in names], scalars,
                 compute_dtype=cdtype, finite=finite, params_out=out[a:b] if out is not None else None,
                 comp=flat.kahan[a:b] if flat.kahan is not None else None,
                 valid=flat.block_valid(a, b) if not flat.bits else None,
                 buffers=[t[:k] for t in conversions] if conversions else None,
                 scratch=[s[:k] for s in rule_scratch] + [None] * (rule.scratch_slots - len(rule_scratch)),
                 index=index, small=small[: k // flat.align] if small is not None else None, rounding=key,
                 pad=padding_positions(flat, a, b) if flat.bits else None, grad_scale=request.grad_scale)
