"""One update of one range of a flat buffer, written once for every backend and precision.

An optimizer class supplies the math as class-level functions of plain data
(no instance): ``constants(hyper)`` and ``coefficients(hyper, T)`` (the
per-step scalars, from :mod:`dml_optim.core.functional`) and ``rule(x, g,
*states, **scalars)`` (the in-place kernel).  This module strings them
together:

* :func:`step_scalars`: the rule's scalars at step count ``T``, gated by a
  ``finite`` flag (a skipped step: every coefficient named in the class's
  ``skip_identity`` takes its no-op value, so parameters and states stay
  bit-exactly as they were);
* :func:`run_rule`: the rule over one range in the compute dtype, with the
  precision modes: converted operands (FP16 storage, FP32 arithmetic), an
  FP32 master copy written back to the parameters, or Kahan-compensated
  low-precision parameters;
* :func:`fused_step`: both, plus the step counter's increment, for the
  compiled backend (:mod:`dml_optim.backends.compiled` traces it into one kernel).

The same code runs on Python numbers (eager, step counts known on the host:
no device op for the scalars), on 0-d device tensors (gated or capturable
steps, no host sync) and under ``torch.compile`` (everything a tensor).

Kahan summation (``kahan=True``, the technique of optimi): the parameters
stay in FP16/BF16 and a compensation buffer ``c`` of the same dtype carries
what rounding lost.  With ``x`` the stored parameters and ``u`` the update
computed in FP32::

    y = u + c;  t = round(x + y);  c = round(y - (t - x));  x = t
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import torch

from dml_optim.core.packing import storage_less
from dml_optim.core.quant import QuantizedState, block_mask, format_named
from dml_optim.core.rounding import RoundingKey, write_rounded
from dml_optim.core.rule import Rule

__all__ = ["step_scalars", "run_rule", "fused_step", "masked_scalars", "masked_step", "conversion_count",
           "coefficient_dtype", "storage_dtype", "KernelKey", "MaskedKey", "operand_names", "kernel_operands"]


class KernelKey(NamedTuple):
    """What selects one compiled step kernel (:func:`fused_step`'s structure): equal keys, one graph.

    ``storage``: how each operand is stored (``x``'s dtype, ``g``'s, then each state's dtype or quantized
    format name, then whether padding is masked, ``valid``)."""

    rule: Rule  # the optimizer's update (one rule per optimizer class: compared by identity)
    structure: tuple  # (name, value) of every structural hyperparameter (choices, flags, exact zeros)
    names: tuple  # the float hyperparameters the kernel takes as 0-d tensors, in order
    compute_dtype: torch.dtype
    gated: bool
    has_out: bool  # master weights: the rounded parameters are an output
    has_comp: bool  # Kahan summation: the compensation buffer
    n_states: int
    storage: tuple
    device: str

    @property
    def formats(self) -> tuple:
        """Per state: None (one tensor) or its quantized format's name (codes and scales)."""
        return tuple(s if isinstance(s, str) else None for s in self.storage[2 : 2 + self.n_states])

    @property
    def has_valid(self) -> bool:
        return self.storage[-1] is True


class MaskedKey(NamedTuple):
    """What selects one compiled masked-update kernel (:func:`masked_step`)."""

    rule: Rule
    fixed: tuple  # sorted (name, value) of the fixed scalars
    names: tuple  # the scalars with a row in the table
    table_dtype: torch.dtype
    storage: tuple  # the parameters' dtype, then each state's
    device: str


def operand_names(formats: Sequence[str | None], has_out: bool, has_comp: bool, has_valid: bool, gated: bool,
                  names: Sequence[str]) -> tuple[str, ...]:
    """The positional operands of a compiled step kernel, named, in their one order (what
    :func:`kernel_operands` packs and :func:`fused_step` unpacks): ``x, g``, each state (a quantized one:
    its codes and scales), ``params_out`` (master weights), ``comp`` (Kahan), ``valid`` (padding), ``T``,
    ``finite`` (gated), then each float hyperparameter of ``names`` (0-d tensors)."""
    out = ["x", "g"]
    for i, fmt in enumerate(formats):
        out += [f"state{i}"] if fmt is None else [f"state{i}.codes", f"state{i}.scales"]
    out += ["params_out"] * has_out + ["comp"] * has_comp + ["valid"] * has_valid + ["T"] + ["finite"] * gated
    return tuple(out + [f"hyper.{n}" for n in names])


def kernel_operands(key: KernelKey, values: Mapping[str, Any]) -> list:
    """The operands of ``key``'s kernel from ``values`` (by :func:`operand_names`' names)."""
    return [values[n] for n in operand_names(key.formats, key.has_out, key.has_comp, key.has_valid, key.gated,
                                             key.names)]


def storage_dtype(state) -> torch.dtype:
    """The dtype a state is stored in (``uint8`` for a block-quantized one: never the compute dtype)."""
    return torch.uint8 if isinstance(state, QuantizedState) else state.dtype


def coefficient_dtype(device: torch.device, compute_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype per-step coefficients are computed in on ``device``.

    Eager steps (``compute_dtype`` None): float64 where the device has it (the
    host path computes them in Python floats, i.e. float64, too), else
    float32; each coefficient is a handful of 0-d ops, once per step.  A
    compiled kernel (``compute_dtype`` given) recomputes its coefficients
    beside every element, so they follow the arithmetic: float64 for float64
    parameters, else float32, as torch's fused kernels compute theirs (float64
    powers and logarithms per element would make a GPU kernel compute-bound).
    """
    if compute_dtype is not None:
        return torch.float64 if compute_dtype == torch.float64 else torch.float32
    return torch.float64 if (AS_DEVICE[0] or device.type) in ("cpu", "cuda", "meta") else torch.float32


#: The device type whose coefficient dtype :func:`coefficient_dtype` follows instead of the buffer's own (None: its
#: own; ``dml_optim.backends.eager.laid_out_as`` sets it, with the scratch layout, to record a CPU step as DirectML
#: runs it).
AS_DEVICE: list = [None]


def _full_like(value, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, value)


def step_scalars(rule: Rule, hyper: Mapping[str, Any], T, finite: torch.Tensor | None,
                 coef_dtype: torch.dtype = torch.float32, constants: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The scalars of ``rule.apply`` after ``T`` completed steps (a number, or a 0-d device tensor);
    ``constants``: ``rule.constants(hyper)``, when the caller keeps them (per settings).

    With ``finite`` (a 0-d bool on the device), every coefficient of
    ``rule.skip_identity`` becomes ``where(finite, value, identity)``: a skipped
    step changes nothing.  Number operands become 0-d tensors made with a
    device fill (no host-to-device copy, no sync).
    """
    if isinstance(T, torch.Tensor):
        T = T.to(coef_dtype) + rule.step_offset
    else:
        T = T + rule.step_offset
    scalars = {**(rule.constants(hyper) if constants is None else constants), **rule.coefficients(hyper, T)}
    if finite is None:
        return scalars
    like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=coef_dtype, device=finite.device)
    for name, identity in rule.skip_identity.items():
        if name not in scalars:
            continue
        value = scalars[name]
        if not isinstance(value, torch.Tensor) and value == identity:
            continue  # already a no-op: stays a number (fewer ops)
        if not isinstance(value, torch.Tensor):
            value = _full_like(value, like)
        scalars[name] = torch.where(finite, value.to(like.dtype), _full_like(identity, like))
    return scalars


def conversion_count(x: torch.dtype, g: torch.dtype, states: Sequence[torch.dtype], compute_dtype: torch.dtype,
                     kahan: bool) -> int:
    """How many operand-sized buffers :func:`run_rule` uses in chunked (eager) mode: one per operand
    converted to ``compute_dtype``, and with Kahan summation the updated parameters, their old value
    and the compensation (FP16 x with FP32 states: 4; master weights with FP32 states: 1)."""
    if kahan:
        return 3 + (g != compute_dtype) + sum(s != compute_dtype for s in states)
    return (x != compute_dtype) + (g != compute_dtype) + sum(s != compute_dtype for s in states)


def run_rule(rule: Rule, x: torch.Tensor, g: torch.Tensor, states: Sequence[Any], scalars: Mapping[str, Any], *,
             compute_dtype: torch.dtype, finite: torch.Tensor | None = None, params_out: torch.Tensor | None = None,
             comp: torch.Tensor | None = None, buffers: Sequence[torch.Tensor] | None = None,
             scratch: Sequence[torch.Tensor | None] = (), fused: bool = False,
             valid: torch.Tensor | None = None, index: torch.Tensor | None = None,
             small: torch.Tensor | None = None, pad: torch.Tensor | None = None,
             rounding: RoundingKey | None = None, grad_scale: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Apply ``rule.apply`` to one range, in place on ``x`` and ``states``.

    ``x``: the values the rule updates (the parameters, or their FP32 master
    copy, in which case ``params_out`` receives the rounded result); ``comp``:
    the Kahan compensation buffer.  Operands whose dtype is not
    ``compute_dtype`` are converted: into ``buffers`` (preallocated, same
    length as ``x``; eager) or by ``.to()`` (``fused``: inside a compiled
    graph, where nothing is materialized).  A state may be a
    :class:`~dml_optim.core.quant.QuantizedState` (whole blocks): it is decoded the
    same way, and encoded back after the rule.  ``valid``: per block, how many
    elements hold values (an aligned, padded layout): padding encodes as 0 and
    the parameters' padding is kept 0.  ``scratch``: the rule's own
    temporaries (None entries: the rule allocates, or fuses).

    The eager low-bit chunk (``buffers`` given, quantized states): ``index`` (int32) receives each state's
    codes before its table gather (it may alias ``scratch[0]``, which the rule writes only later; after the rule
    it is the signed ``root`` encoder's work), ``small``
    (one element per block) is the encoder's divisor, and each state is encoded *in* its decoded buffer
    (:func:`dml_optim.core.quant.encode_into`): nothing is allocated.  ``pad`` instead of ``valid``: the
    chunk's padding positions (int64), set to 0 in the parameters after the rule (one ``scatter_``); the
    states' padding needs no mask there, as it only holds what the rule makes of zero gradients and zero
    parameters (0 in a signed state; the smallest level of an unsigned one, below the block's maximum).
    ``rounding``: the parameters (float16/bfloat16, the rule in FP32) are written stochastically, with the
    range's counter-based numbers (:func:`dml_optim.core.rounding.write_rounded`; eager only), else to the
    nearest value.  ``grad_scale``: a 0-d factor the gradients are multiplied by once in the compute dtype (the
    step inside backward's unscaling; ``g`` is then scratch the call may write), eager only.
    Returns the quantized states' encoder factors a compiled kernel returns (:func:`fused_step`), else ``[]``.
    """
    pool = iter(buffers) if buffers is not None else None

    def up(t, force: bool = False) -> torch.Tensor:
        if isinstance(t, QuantizedState):
            return t.decode(compute_dtype, out=next(pool) if pool is not None else None, index=index)
        if t.dtype == compute_dtype and not force:
            return t
        if pool is None:
            return t.to(compute_dtype, copy=True)
        return next(pool).copy_(t)

    if finite is not None:  # a skipped step's gradient may hold inf/nan: 0 * inf would be nan
        if fused:
            g = torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device))
        else:
            g.masked_fill_(finite.logical_not(), 0)
    x_old = up(x, force=True) if comp is not None else None
    xs = up(x, force=comp is not None)
    gs = up(g)
    if grad_scale is not None:
        gs = gs.mul_(grad_scale.to(gs.dtype))  # (the window's gradients, or their converted copy: scratch)
    ss = [up(s) for s in states]
    rule.apply(xs, gs, *ss, scratch=scratch, **scalars)
    mask = block_mask(valid, x.numel() // valid.numel()) if valid is not None else None
    if mask is not None:  # an epsilon of 0 makes padding 0/0: it stays 0 (it feeds the L2 term)
        if fused:
            xs = torch.where(mask.view(xs.shape), xs, torch.zeros((), dtype=xs.dtype, device=xs.device))
        else:
            xs.view(mask.shape).masked_fill_(mask.logical_not(), 0)
    if pad is not None:
        xs.view(-1).scatter_(0, pad, 0.0)
    # (the signed ``root`` encoder's work: the decoder's index, free once every state is decoded)
    work = (index.view(compute_dtype) if index is not None and compute_dtype.itemsize == 4 and not storage_less(index)
            else None)  # (no dtype view of a tensor without storage: DirectML reads the storage for it)
    returned = []  # (a compiled kernel returns the encoders' per-block factors: quant.encode_ says why)
    for s, c in zip(states, ss):
        if isinstance(s, QuantizedState):
            factor = s.encode_(c, mask, small=small, work=work, overwrite=not fused)
            if factor is not None:
                returned.append(factor)
        elif c is not s:
            s.copy_(c)
    if comp is not None:
        cs = up(comp, force=True)
        y = xs.sub_(x_old).add_(cs)  # u + c
        if finite is not None:  # a skipped step (u = 0) must not fold in the pending compensation either
            if fused:
                y = torch.where(finite, y, torch.zeros((), dtype=y.dtype, device=y.device))
            else:
                y.masked_fill_(finite.logical_not(), 0)
        t = torch.add(x_old, y, out=cs) if not fused else x_old + y
        x.copy_(t)  # round(x + y): x itself when y = 0
        back = cs.copy_(x) if not fused else x.to(compute_dtype)
        c_new = y.sub_(back.sub_(x_old)) if not fused else y - (back - x_old)  # round(y - (t - x))
        if finite is not None:  # skipped: c stays as it was (eager: in place in the scratch, no allocation)
            c_new = torch.where(finite, c_new, comp) if fused else torch.where(finite, c_new, comp, out=c_new)
        comp.copy_(c_new)
    elif xs is not x:
        write_rounded(xs, x, None if fused else rounding)
    if params_out is not None:
        params_out.copy_(x)
    return returned


def fused_step(rule: Rule, structure: Mapping[str, Any], names: Sequence[str], compute_dtype: torch.dtype, gated: bool,
               has_out: bool, has_comp: bool, formats: Sequence[str | None], has_valid: bool,
               *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The whole step of one range as the compiled backend traces it (positional tensors only: a
    :class:`KernelKey`'s fields, then the tensors in :func:`operand_names`' order).

    ``formats`` says how each state is stored: None (one tensor) or a quantized format's name (two
    tensors: codes and scales; ``valid`` then gives the padding of an aligned layout).  ``structure``
    holds the class's structural hyperparameter values (mode, flags, exact zeros), which reach the rule
    as Python values.  The step counter ``T`` (completed steps) is advanced inside the graph, by 1 or by
    ``finite``.  Returns the encoders' per-block factors (:func:`dml_optim.core.quant.encode_`: returned, they
    are computed once per block) and, with them, the step's scalars (2% of the 8-bit AdamW step at 16M elements
    on the CPU); the caller drops them.
    """
    given = dict(zip(operand_names(formats, has_out, has_comp, has_valid, gated, names), tensors))
    states = [given[f"state{i}"] if fmt is None else
              QuantizedState(given[f"state{i}.codes"], given[f"state{i}.scales"], format_named(fmt))
              for i, fmt in enumerate(formats)]
    x, g, T, finite = given["x"], given["g"], given["T"], given.get("finite")
    hyper = {n: given[f"hyper.{n}"] for n in names}
    hyper.update(structure)
    scalars = step_scalars(rule, hyper, T, finite, coefficient_dtype(x.device, compute_dtype))
    returned = run_rule(rule, x, g, states, scalars, compute_dtype=compute_dtype, finite=finite,
                        params_out=given.get("params_out"), comp=given.get("comp"), fused=True,
                        scratch=(None,) * rule.scratch_slots, valid=given.get("valid"))
    T.add_(finite.to(T.dtype) if finite is not None else 1)
    if returned:  # (then the step's scalars too: each computed once, not again at every vector of the second pass)
        returned += [v for v in scalars.values() if isinstance(v, torch.Tensor)]
    return tuple(returned)


def masked_scalars(rule: Rule, hyper: Mapping[str, Any], by_count: Mapping[int, dict[str, Any]], counts: Sequence[int | None],
                   sizes: Sequence[int], *, fold: bool) -> tuple[dict[str, Any], list[str], list[list[float]]]:
    """The scalars of one masked update: ``(fixed, names, table)``.

    ``counts``: per run of parameters, its completed steps, or None for a run without a gradient
    (it takes the rule's no-op, ``skip_identity``, and its gradient slot must be zero);
    ``sizes``: how many parameters each run has; ``by_count``: the host scalars
    (:func:`step_scalars`) of each count that occurs.  Structure (a scalar that is neither a step
    coefficient nor has a no-op value: a sign, a flag) and a coefficient that is exactly 0
    everywhere (it removes ops) are ``fixed`` Python values; with ``fold`` (eager) so is any
    scalar that takes one value everywhere.  Every other scalar has a row in ``table`` with one
    value per parameter, named by ``names`` in order (:func:`masked_step` gathers the rows to the
    elements); a compiled kernel takes its values there, so a scheduler's new ``lr`` is data, not a
    new kernel.
    """
    some = by_count[next(c for c in counts if c is not None)]
    idle = {**some, **{k: v for k, v in rule.skip_identity.items() if k in some}}  # a step that changes nothing
    rows = [by_count[n] if n is not None else idle for n in counts]
    coefficients = set(rule.coefficients(hyper, 0)) | set(rule.skip_identity)

    def is_fixed(k: str) -> bool:
        values = {row[k] for row in rows}
        return (k not in coefficients or values == {0} and not isinstance(some[k], torch.Tensor)
                or fold and len(values) == 1)

    fixed = {k: v for k, v in some.items() if is_fixed(k)}
    names = [k for k in some if k not in fixed]
    table = [[float(row[k]) for row, size in zip(rows, sizes) for _ in range(size)] for k in names]
    return fixed, names, table


def masked_step(rule: Rule, fixed: Mapping[str, Any], names: Sequence[str], x: torch.Tensor, g: torch.Tensor,
                *rest: torch.Tensor, scratch: Sequence[torch.Tensor | None] | None = None) -> None:
    """One masked update in place (eager, and as the compiled backend traces it).

    ``rest``: ``*states, table, owner``: ``table`` has one row per name of ``names`` and one
    column per parameter (:func:`masked_scalars`), ``owner`` the parameter index of every element
    (int32); each row is gathered to the elements and the rule runs once over the whole range.
    """
    *states, table, owner = rest
    scalars = dict(fixed)
    if names:
        scalars.update(zip(names, table.index_select(1, owner).unbind(0)))
    rule.apply(x, g, *states, scratch=list(scratch) if scratch is not None else [None] * rule.scratch_slots, **scalars)
