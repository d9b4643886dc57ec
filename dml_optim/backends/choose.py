"""The one place that decides how a flat buffer's rule runs: ``eager``, ``compiled`` or ``fused``.

:func:`decide` makes the decision once per (buffer, structural settings) and keeps it in the buffer's
:class:`~dml_optim.backends.base.BufferRuntime` (the one cache; ``decisions`` counts how many were
made); :func:`plan_step` asks the chosen backend for a step's plan (falling back to the rule's backend
where torch's kernel cannot take a step), :func:`run_plan` runs it; :func:`resolved_backend` reads the
decision.  A scheduler's new ``lr`` is not a new decision: the structural settings exclude the float
hyperparameters' values (their zeros excepted: an exact zero removes ops).

* ``eager``: the DirectML-native op chain of :mod:`dml_optim.core.functional`
  (about ten element-wise ops per step over the flat buffer).  Always used on
  DirectML (``privateuseone``), where every op is a native kernel and
  ``torch.compile`` has no backend.
* ``compiled`` (CPU, CUDA): the same step fused into one kernel by
  ``torch.compile`` (:mod:`dml_optim.backends.compiled`).  Falls back to eager with one
  :class:`~dml_optim.backends.compiled.CompileFallbackWarning` per optimizer when
  compilation is unavailable or fails.
* ``fused`` (CPU): torch's own fused CPU kernel of the same rule, called on
  the flat buffers (:mod:`dml_optim.backends.fused`).  Warns once and runs ``auto``'s
  choice where it cannot (another device, a precision mode, ...).
* ``auto``: eager on DirectML.  On the CPU, fused wherever it can run
  (:func:`fuses`): 1.0 to 3x faster than the compiled kernel called directly
  from 32k to 1M elements (AdamW, 2 threads: 14 vs 73 us at 32k, 0.24 vs 0.28
  ms at 1M), about as fast above, and nothing to compile.  Otherwise, on CPU
  and CUDA, compiled for buffers of
  :data:`AUTO_COMPILE_MIN_ELEMENTS` elements or more, where a first compile
  (seconds) is earned back quickly; a smaller CPU buffer (from
  :data:`AUTO_TIER_MIN_ELEMENTS`) starts eager and compiles once its eager
  steps have taken :data:`AUTO_COMPILE_AFTER_EAGER_S` in all (rent or buy:
  a short job never pays a compile, a long one loses at most about one
  compile's time on the slower path); quantized states and masked updates
  (parameters at several step counts) compile from thresholds of their own.

Measured on a 2-core CPU VM (AdamW, 8 tensors, 2 threads, torch 2.13): the
compiled step, called without its dynamo frame, beats the eager chain from
16k elements on (0.12 vs 0.20 ms at 16k, 0.53 vs 1.47 ms at 1M) and torch's
fused AdamW up to 1M elements (1.2 to 1.4x); a first compile takes about 5 s
with inductor's disk cache warm, 20 s cold.  On CUDA the eager chain's cost is
mostly kernel launches (about ten per step), which a fused kernel removes
whatever the size, so the threshold is lower.
"""

from __future__ import annotations

from typing import Any

from dml_optim.backends import compiled as _compiled
from dml_optim.backends import eager as _eager
from dml_optim.backends import fused as _fused
from dml_optim.backends.base import Decision, EagerPlan, FusedPlan, Owner, Plan, Route, StepRequest, runtime
from dml_optim.backends.eager import ensure_scratch, several_counts
from dml_optim.backends.fused import copies_in, copy_in, present_indices, reads_in_place, remember_read
from dml_optim.backends.modes import counting_kernels, dispatch_mode_active, eager_only_now, is_compiling
from dml_optim.core.grads import held_elsewhere
from dml_optim.core.options import BACKENDS

#: What the optimizer layers use of backends/ besides the decision, re-exported here: ``dml_optim.optimizers`` imports
#: ``backends.choose`` and nothing else of backends/ (tests/test_layering.py), so the backends' modules can change
#: behind this one seam.  The plans and the request (base), the buffer's runtime, the gradients read in place or
#: copied (fused's, which every backend's request uses), the eager scratch, the trace and dispatch-mode tests.
SEAM = ("EagerPlan", "FusedPlan", "Owner", "StepRequest", "runtime", "ensure_scratch", "several_counts", "copies_in",
        "copy_in", "present_indices", "reads_in_place", "remember_read", "dispatch_mode_active", "is_compiling")

__all__ = [*SEAM, "AUTO_COMPILE_MIN_ELEMENTS", "AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED", "AUTO_COMPILE_MIN_ELEMENTS_MASKED",
           "AUTO_COMPILE_AFTER_EAGER_S", "AUTO_TIER_MIN_ELEMENTS", "BACKEND_OF", "resolve", "decide", "fuses", "tiers",
           "tier_due", "tiering_pending", "compiles", "plan_step", "run_plan", "resolved_backend", "resolved_backends"]

#: ``backend="auto"`` compiles a flat buffer from this many elements on.
AUTO_COMPILE_MIN_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 20}
#: ... and a buffer of quantized states (``state_bits``) from this many: its eager chain is 40 to 50 ops per
#: state per chunk (decode, update, encode), which a fused kernel replaces at every size that pays a compile
#: (1M-element AdamW, 2 cores: 8-bit eager 37 ms per step on one thread, compiled a few ms)
AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED = {"cpu": 1 << 16, "cuda": 1 << 16}

#: ... and a smaller CPU buffer (from AUTO_TIER_MIN_ELEMENTS on) once its eager steps have taken this long in
#: all: the rent-or-buy rule.  A first compile costs about 5 s on a 2-core CPU with inductor's disk cache
#: warm (20 s cold), and the compiled step is 1.6 to 2.7x faster than the eager chain from 16k elements on
#: (AdamW, 2 threads: 0.12 vs 0.20 ms at 16k, 0.53 vs 1.47 ms at 1M); so a short job never pays a compile,
#: and a long one spends at most about one compile's time on the slower path.
AUTO_COMPILE_AFTER_EAGER_S = {"cpu": 5.0}
AUTO_TIER_MIN_ELEMENTS = {"cpu": 1 << 14}
#: ... and a masked update (parameters at several step counts) from this many (CUDA, where its per-element
#: gathers are cheap: not measured on a GPU yet; the CPU steps such buffers one run at a time, see
#: ``backends.eager.MASKED_DEVICES``).
AUTO_COMPILE_MIN_ELEMENTS_MASKED = {"cuda": 1 << 16}

#: The backends by name (each implements :class:`~dml_optim.backends.base.Backend`).
BACKEND_OF = {"eager": _eager.BACKEND, "compiled": _compiled.BACKEND, "fused": _fused.BACKEND}


def _device_type(device) -> str:
    import torch

    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":", 1)[0]
    raise TypeError(f"device must be a torch.device or a string, got {device!r}")


def resolve(backend: str, device, numel: int, quantized: bool = False, eager_s: float = 0.0) -> str:
    """The backend (``"eager"`` or ``"compiled"``) that runs a flat buffer's rule.

    ``backend`` is the optimizer's option, ``device`` the buffer's device (a
    ``torch.device`` or a string such as ``"privateuseone:0"``), ``numel``
    its element count, ``quantized`` whether it keeps quantized states,
    ``eager_s`` the wall time its eager steps took so far (the tiering of
    :data:`AUTO_COMPILE_AFTER_EAGER_S`).  ``"compiled"`` resolves to
    ``"eager"`` where compilation is unavailable (DirectML, no C++ compiler, ...).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "eager":
        return "eager"
    if backend == "fused":  # (a buffer the fused kernel cannot run: what auto runs)
        backend = "auto"
    device_type = _device_type(device)
    if not _compiled.compile_available(device_type)[0]:
        return "eager"
    if backend == "compiled":
        return "compiled"
    threshold = (AUTO_COMPILE_MIN_ELEMENTS_QUANTIZED if quantized else AUTO_COMPILE_MIN_ELEMENTS).get(device_type)
    if threshold is not None and numel >= threshold:
        return "compiled"
    return "compiled" if tier_due(device_type, numel, quantized, eager_s) else "eager"


def tiers(device_type: str, numel: int, quantized: bool) -> bool:
    """Whether ``auto`` counts the eager time of such a buffer, to compile it later (:func:`tier_due`)."""
    return not quantized and numel >= AUTO_TIER_MIN_ELEMENTS.get(device_type, 1 << 62)


def tier_due(device_type: str, numel: int, quantized: bool, eager_s: float) -> bool:
    """A buffer below the size threshold has run eagerly for as long as its first compile would take."""
    return tiers(device_type, numel, quantized) and eager_s >= AUTO_COMPILE_AFTER_EAGER_S[device_type]


def _token(owner: Owner, flat, rt) -> tuple:
    """What a decision depends on besides the structural settings (compared by identity; the buffer's kind and
    size are its own for life): the tiering clock's verdict and whether the optimizer fell back from compiling."""
    return (rt.eager_s > 0 and tier_due(flat.device.type, flat.numel, flat.bits is not None, rt.eager_s),
            owner.compile_fallback is None)


def kernel_key(owner: Owner, group, flat):
    """The compiled kernel key of ``flat`` (:func:`dml_optim.backends.compiled.kernel_key`), kept per structural
    settings and allocated states."""
    rt = runtime(flat)
    made_for = (rt.structure, len(flat.states), flat.master is None, flat.kahan is None, flat.numel, flat.dtype)
    kept = rt.key
    if kept is None or rt.structure is None or kept[0][0] is not made_for[0] or kept[0][1:] != made_for[1:]:
        kept = rt.key = (made_for, _compiled.kernel_key(owner.rule, group, flat))
    return kept[1]


def decide(owner: Owner, group: dict[str, Any], flat) -> Decision:
    """The decision for ``flat`` under ``group``'s settings: made once per (buffer, structural settings,
    :func:`_token`) and kept (``BufferRuntime.decisions`` counts how many were made).  Static: a dynamo trace
    or a dispatch mode (:func:`~dml_optim.backends.modes.eager_only_now`) runs the eager rule for one step
    without changing it."""
    rt = runtime(flat)
    if rt.structure is None:  # (not stepped yet: the settings are not validated, nothing to keep it for)
        return _decide(owner, group, flat, rt)
    token = _token(owner, flat, rt)
    decision = rt.decision
    if decision is not None and rt.token[0] is rt.structure and rt.token[1] == token:
        return decision
    decision = _decide(owner, group, flat, rt)
    rt.decision, rt.token = decision, (rt.structure, token)
    rt.decisions += 1
    return decision


def _decide(owner: Owner, group, flat, rt) -> Decision:
    backend = group["backend"]
    if backend not in BACKENDS:  # (an invalid option: the next step refuses it)
        return Decision("eager", "eager", False, f"backend={backend!r} is not a backend")
    why_not_fused = None
    if backend in ("auto", "fused"):
        why_not_fused = _fused.BACKEND.supports(owner.rule, group, flat)
    else:
        why_not_fused = f"backend={backend!r}"
    rule, masked = "eager", False
    # (stochastic rounding's counter-based numbers are the eager rule's: DirectML's path runs it)
    if backend != "eager" and owner.compile_fallback is None and group.get("rounding") != "stochastic":
        quantized = flat.bits is not None
        if resolve(backend, flat.device, flat.numel, quantized, rt.eager_s) == "compiled":
            rule = "compiled"
        device_type = flat.device.type
        masked = (_compiled.BACKEND.supports(owner.rule, group, flat) is None and not (
            backend in ("auto", "fused") and flat.numel < AUTO_COMPILE_MIN_ELEMENTS_MASKED.get(device_type, 1 << 62)))
    plain = "fused" if why_not_fused is None else rule
    return Decision(plain, rule, masked, why_not_fused)


def fuses(owner: Owner, group: dict[str, Any], flat) -> bool:
    """Whether ``flat`` runs torch's fused kernel (:mod:`dml_optim.backends.fused`) under ``group``'s settings now:
    ``backend`` is ``"fused"`` or ``"auto"`` and the buffer qualifies (``backend="fused"`` warns once where
    it does not).  Not while dynamo traces the step, nor under a dispatch mode other than the op counter
    (the audit records the op chain DirectML runs)."""
    backend = group["backend"]
    if backend != "auto" and backend != "fused":
        return False
    return _fuses(owner, group, decide(owner, group, flat))


def _fuses(owner: Owner, group, decision: Decision) -> bool:
    """:func:`fuses`, the decision made."""
    if decision.why_not_fused is not None:
        if group["backend"] == "fused":
            _fused.warn_fallback(owner, decision.why_not_fused)
        return False
    return not eager_only_now()


def compiles(owner: Owner, group: dict[str, Any], flat) -> bool:
    """Whether ``flat``'s rule runs compiled (its memory policy: no scratch)."""
    return decide(owner, group, flat).rule == "compiled"


def tiering_pending(owner: Owner, buffers_by_group) -> bool:
    """Some buffer of ``buffers_by_group`` (``(group, buffers)`` pairs: an optimizer's ``buffers_by_group()``) runs
    eagerly under ``auto`` now and will compile once it has run eagerly for :data:`AUTO_COMPILE_AFTER_EAGER_S` (a
    benchmark of the steady state steps it until this is False)."""
    return any(group["backend"] in ("auto", "fused") and tiers(flat.device.type, flat.numel, flat.bits is not None)
               and not tier_due(flat.device.type, flat.numel, flat.bits is not None, runtime(flat).eager_s)
               and resolved_backend(owner, group, flat) == "eager" and _compiled.compile_available(flat.device.type)[0]
               for group, flats in buffers_by_group for flat in flats)


#: The routes of the eager rule and of torch's fused kernel, made once (a step plans every buffer through one):
#: (the rule compiles, the step is timed for tiering) -> Route.
_ROUTES = {(compiled, timed): Route(compiled=compiled, timed=timed) for compiled in (False, True) for timed in (False, True)}


def _rule_plan(request: StepRequest, decision: Decision, last: Plan | None) -> EagerPlan:
    """The plan of the rule's backend (compiled or eager) for ``request``."""
    owner, group, flat = request.owner, request.group, request.flat
    backend = group["backend"]
    key = None
    if request.grad_scale is not None:  # (gradients unscaled inside the rule: the eager rule's, DirectML's path)
        return _eager.BACKEND.plan(request, _ROUTES[decision.rule == "compiled", False], last)
    if decision.rule == "compiled" and not eager_only_now():
        key = kernel_key(owner, group, flat)
        reason = _compiled.BACKEND.broken(key)
        if reason is not None:  # another optimizer found this kernel broken: this one is told too, once
            _compiled.fall_back(owner, flat.device, reason)
            key = None
    elif backend == "compiled" and not eager_only_now() and owner.compile_fallback is None:
        _compiled.fall_back(owner, flat.device, _compiled.compile_available(flat.device.type)[1])
    masked = decision.masked and not eager_only_now() and owner.compile_fallback is None
    if key is not None:
        return _compiled.BACKEND.plan(request, Route(compiled=True, key=key, masked=masked), last)
    if masked and _eager.masks(group, flat, True) and request.finite is None:
        return _compiled.BACKEND.plan(request, Route(masked=True), last)
    timed = backend in ("auto", "fused") and tiers(flat.device.type, flat.numel, flat.bits is not None)
    return _eager.BACKEND.plan(request, _ROUTES[decision.rule == "compiled", timed], last)


def plan_step(request: StepRequest, last: Plan | None = None) -> Plan:
    """This step's plan for one buffer, by the decided backend (nothing written but gradients gathered where
    torch's kernel declined a step it was to read in place): torch's fused kernel for an ungated step of a
    buffer it runs, else the rule's backend (compiled or eager).  ``last``: the buffer's previous plan, when
    the step repeats it."""
    owner, group, flat = request.owner, request.group, request.flat
    decision = decide(owner, group, flat)
    if request.finite is None and _fuses(owner, group, decision):
        plan = _fused.BACKEND.plan(request, _ROUTES[False, False], last)
        if plan is not None:
            flat.scratch = []
            return plan
    if request.grads is not None and not request.copied:  # (a count the fused kernel cannot take: gathered)
        foreign = [i for i, g in enumerate(request.grads) if g is not None and not flat.holds_grad(i, g)]
        held = held_elsewhere(request.grads)  # (the request's list the only one: a gradient held too stays theirs)
        flat.gather_grads(foreign, frozenset(i for i in foreign if held[i]))
        request = request._replace(grads=None)
    return _rule_plan(request, decision, last)


def run_plan(plan: Plan) -> None:
    """Run ``plan`` with the backend that made it."""
    BACKEND_OF[plan.backend].run(plan)


def resolved_backend(owner: Owner, group: dict[str, Any], flat) -> str:
    """The backend ``flat`` runs with now (after any fallback; an invalid option: ``"eager"``,
    the next step refuses it).  ``"fused"`` is what its plain steps run: a step gated on a
    ``GradScaler``'s ``found_inf`` and one at a count beyond :data:`dml_optim.backends.fused.MAX_COUNT` (or whose
    kernel scalars leave the dtype's range) run the rule as :func:`resolve` decides, eager or compiled."""
    if group["backend"] in ("auto", "fused") and fuses(owner, group, flat):
        return "fused"
    decision = decide(owner, group, flat)
    if decision.rule == "compiled" and _compiled.BACKEND.broken(kernel_key(owner, group, flat)) is None:
        return "compiled"
    return "eager"


def resolved_backends(owner: Owner, buffers_by_group) -> list[list[str]]:
    """For each param group of ``buffers_by_group`` (an optimizer's ``buffers_by_group()``), the backend each of its
    flat buffers runs with now."""
    return [[resolved_backend(owner, group, flat) for flat in flats] for group, flats in buffers_by_group]
