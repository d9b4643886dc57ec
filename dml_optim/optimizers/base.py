"""The stateful wrapper every optimizer shares: flat buffers, a validated two-phase step.

A subclass declares what it is (``spec``: hyperparameters, torch.optim twin, if any)
and its math as one value, ``rule`` (a :class:`~dml_optim.core.rule.Rule`: the
per-step scalars, the element-wise update, the states, the fused kernel where torch
has one); the backends and :mod:`dml_optim.core.update` receive that value, never
the optimizer (docs/guide/writing-an-optimizer.md).  This class does the rest:

* **layout** (:mod:`~dml_optim.optimizers.layout`): each param group's trainable parameters are packed
  into one :class:`~dml_optim.core.flat.FlatBuffer` per (device, dtype); frozen parameters
  (``requires_grad=False``) are not packed and cost nothing until they are unfrozen, when the next step
  takes them in;
* **following the parameters**: a step (and ``zero_grad``, ``state_dict``) first checks the bindings
  (:meth:`FlatBuffer.check`); parameters moved or cast (``model.to()``, ``.half()``,
  ``accelerator.prepare``) are re-packed on their new device and dtype with their state carried over
  (cast as ``load_state_dict`` casts); a changed shape is refused, naming the parameter;
* **plan, then commit** (:mod:`~dml_optim.optimizers.engine`): every check,
  conversion and coefficient is done before the first write, so a step that
  raises leaves parameters and states untouched; ``atomic=True`` also rolls
  back a failure inside the kernels;
* **step classes**: parameters that stepped together share one counter; a
  step runs the rule once per class of parameters with gradients (re-packing
  when ``None`` gradients left a class in pieces);
* **paths**: eager with counts on the host (coefficients are Python numbers:
  no device op, no sync); eager with counts on the device (gated steps:
  ``nonfinite="skip"`` and loss scaling, and ``capturable=True``); compiled
  (one fused kernel per class, :mod:`dml_optim.backends.compiled`);
* **precision**: ``state_dtype``, ``compute_dtype``, ``master_weights``,
  ``kahan`` (:mod:`dml_optim.core.update`); chunked through bounded scratch when
  the eager path converts;
* **torch conventions**: param groups carry torch.optim's names too, kept in
  sync (:func:`~dml_optim.optimizers.spec.sync_group`); ``torch.amp.GradScaler``'s
  ``grad_scale``/``found_inf`` protocol; ``capturable`` steps for CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch
from torch.optim import Optimizer

from dml_optim.backends.choose import is_compiling as _is_compiling
from dml_optim.core.dtypes import check_directml_dtypes
from dml_optim.core.flat import describe_param
from dml_optim.core.rule import Rule
from dml_optim.core.grads import zero_in_place
from dml_optim.optimizers.contract import ContractMixin
from dml_optim.optimizers.engine import EngineMixin
from dml_optim.optimizers.hooks import hook_step
from dml_optim.optimizers.introspect import BufferInfo, buffer_infos
from dml_optim.optimizers.layout import GroupLayout, LayoutMixin
from dml_optim.optimizers.settings import tensors_given, watch
from dml_optim.optimizers.spec import REQUIRED, OptimizerSpec, agree, sync_group
from dml_optim.core.options import (
    CHECK_MODES,
    LOW_PRECISION_DTYPES,
    MAX_STEP,
    OPTION_DEFAULTS,
    OPTION_NAMES,
    PACK_MODES,
    SUPPORTED_DTYPES,
    check_choice,
    check_flag,
    check_options,
)

__all__ = ["FlatOptimizer", "BufferInfo"]

#: What ``torch.no_grad()`` reads and sets (C functions), for the repeat of a steady step (:meth:`FlatOptimizer.step`).
_GRAD_ENABLED = torch.is_grad_enabled
_SET_GRAD_ENABLED = torch._C._set_grad_enabled


class FlatOptimizer(LayoutMixin, EngineMixin, ContractMixin, Optimizer):
    """Base class of the flat optimizers; see the module docstring."""

    #: What this optimizer is (name, hyperparameters, torch.optim twin).
    spec: ClassVar[OptimizerSpec]
    #: The update, as data (:class:`~dml_optim.core.rule.Rule`): what the backends run.  The class attributes
    #: below are read from it (``__init_subclass__``), for the code of this layer and the tests.
    rule: ClassVar[Rule]
    #: ``f(saved_torch_group) -> reason | None``: torch.optim checkpoints this class must refuse
    #: beyond the generic flags check (AdamW refuses an L2-decay Adam checkpoint).
    checkpoint_refusal: ClassVar[Callable[[dict], str | None] | None] = None

    def __init_subclass__(cls, **kwargs) -> None:
        """Complete the class's :class:`~dml_optim.core.rule.Rule` (its ``floats`` from the spec: the compiled
        kernel's scalar arguments) and read the rule's facts into class attributes (``state_names``, ``step_offset``,
        ``max_step``, ``dtypes``, ...), so that a subclass declares its update once, as its ``rule``."""
        super().__init_subclass__(**kwargs)
        rule = cls.__dict__.get("rule")
        if not isinstance(rule, Rule):
            return  # (a subclass of a concrete optimizer: its parent's rule)
        spec = cls.__dict__.get("spec")
        if not (rule.floats or rule.switches) and spec is not None:
            rule = cls.rule = dataclasses.replace(
                rule, floats=tuple(h.name for h in spec.hyperparameters if h.kind == "float"),
                switches=tuple(h.name for h in spec.hyperparameters if h.kind != "float"))
        for name in ("unsigned_states", "step_offset", "max_step", "max_step_reason", "dtypes", "skip_identity",
                     "zero_skips", "scratch_slots", "fused_counts"):
            setattr(cls, name, getattr(rule, name))
        cls.state_names = rule.states

    # -- the rule's functions, read through the class (this layer's code and the tests) ----

    @classmethod
    def constants(cls, hyper) -> dict[str, Any]:
        """Scalars of the rule that do not change with the step (``rule.constants``)."""
        return cls.rule.constants(hyper)

    @classmethod
    def coefficients(cls, hyper, T) -> dict[str, Any]:
        """Per-step scalars at step ``T`` (a number or a 0-d tensor; ``rule.coefficients``)."""
        return cls.rule.coefficients(hyper, T)

    @classmethod
    def fused_kernel(cls, hyper, count: int) -> tuple[str, dict[str, Any]] | None:
        """torch's fused CPU kernel of the rule after ``count`` completed steps, or None (``rule.fused_kernel``)."""
        return cls.rule.fused_kernel(hyper, count)

    @classmethod
    def scratch_count(cls, hyper, gated: bool) -> int:
        """Full-size scratch tensors the eager rule needs (``rule.scratch_count``)."""
        return cls.rule.scratch_count(hyper, gated)

    @classmethod
    def group_state_names(cls, hyper) -> tuple[str, ...]:
        """The states a group with these hyperparameters keeps (AdamW's AMSGrad adds one)."""
        return cls.rule.group_state_names(hyper)

    @classmethod
    def initial_state(cls, hyper, name: str) -> float:
        """The value a fresh state starts at (0; Adagrad's ``sum``: ``initial_accumulator_value``)."""
        return cls.rule.initial_state(hyper, name)

    # -- construction ---------------------------------------------------------------------------

    def __init__(self, params, hyperparameters: dict[str, Any], torch_names: dict[str, Any],
                 options: "dict[str, Any]", torch_flags: "dict[str, Any] | None" = None):
        cls = type(self)
        options = dict(options)
        self.atomic = check_flag("atomic", options.pop("atomic", False))
        #: ``"full"`` (the default): every step compares two storage use counts per buffer and every
        #: parameter's binding (two C-level passes; see ``FlatBuffer.check``); ``"refs"``: the counts alone
        #: (O(1), blind to a re-binding while the caller holds the old tensors); ``"fast"``: the counts and
        #: the first and last parameter's (see the README).
        self.checks = check_choice("checks", options.pop("checks", "full"), CHECK_MODES)
        self.pack_via = check_choice("pack_via", options.pop("pack_via", "auto"), PACK_MODES)
        #: True (the default): a step whose buffers, bindings and structural settings did not change since a
        #: plain step repeats that step's plan (no layout work, no new decision); False: every step is planned
        #: from scratch, the path a repeat must equal bit for bit (tests, and a suspicion that a repeat is wrong)
        self.repeat = check_flag("repeat", options.pop("repeat", True))
        for name in options:
            if name in cls.spec.torch.refused:
                raise TypeError(f"{cls.__name__}() got {name}={options[name]!r}: {cls.spec.torch.refused[name]}")
            if name not in OPTION_NAMES:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
        group_options = {**OPTION_DEFAULTS, **options}
        check_options(group_options)
        flags = cls.spec.torch.implementation_flags()
        flags.update(torch_flags or {})
        defaults = {**self._resolve_torch_names(hyperparameters, torch_names), **flags, **group_options}
        self._given = tensors_given(defaults)  # (tensor settings, before validation writes numbers: watched)
        cls.spec.check(defaults)
        cls.spec.torch.check_implementation_flags(defaults)
        sync_group(cls.spec, defaults, None, "defaults")
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"got a Tensor of shape {tuple(params.shape)}")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"params must be given as an ordered collection (a list), got a {type(params).__name__}")
        self._layout: list[GroupLayout] = []
        #: the buffers of the last step, when it can be repeated without planning again (:meth:`_repeat`)
        self._steady: tuple | None = None
        super().__init__(params, defaults)
        from dml_optim.optimizers._stateview import StateView

        self.state = StateView(self)

    @classmethod
    def _resolve_torch_names(cls, hyper: dict[str, Any], torch_names: dict[str, Any]) -> dict[str, Any]:
        """Our hyperparameters with torch.optim keywords (same meaning) applied; conflicts are errors.

        A torch keyword given is kept as given (``dampening=0.1`` reads back 0.1, not ``1 - 0.9``)."""
        hyper = dict(hyper)
        defaults = cls.spec.defaults()
        for alias in cls.spec.torch.aliases:
            value = torch_names.get(alias.torch)
            if value is None:
                continue
            try:
                derived = alias.from_torch(value)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{alias.torch} {exc}") from None
            try:  # validated here, so a bad value is named by the keyword the caller wrote (weight_decay=-1)
                for n, v in zip(alias.ours, derived):
                    cls.spec.hyperparameter(n).check(v)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{alias.torch}={value!r}: {exc}") from None
            given = tuple(hyper[n] for n in alias.ours)
            explicit = [n for n in alias.ours if hyper[n] != defaults.get(n)]
            if explicit and not agree(alias, given, value, derived):
                name = explicit[0]
                v = derived[alias.ours.index(name)]
                raise TypeError(f"{cls.__name__}() got {alias.torch}={value!r} and {name}={hyper[name]!r}, which "
                                f"disagree ({alias.torch} sets {name}={v!r}); pass one of the two")
            if not explicit:
                hyper.update(zip(alias.ours, derived))
            hyper[alias.torch] = value
        return hyper

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its trainable parameters are packed into flat buffers at once."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        cls = type(self)
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError(f"params must be given as an ordered collection (a list), got a {type(params).__name__}")
        else:
            params = list(params) if params is not None else []
        gi = len(self.param_groups)
        params = self._named(group, params, gi)
        for i, p in enumerate(params):
            self._check_param(p, i, gi)
        params = self._deduplicated(group, params, gi)
        self._keep_params(group, params)
        where = f"param_groups[{gi}]"
        # torch names given in the dict win over our defaults; given under both names they must agree
        for alias in cls.spec.torch.aliases:
            if alias.torch in group and not any(n in group for n in alias.ours):
                try:
                    group.update(zip(alias.ours, alias.from_torch(group[alias.torch])))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{where}: {alias.torch} {exc}") from None
        derived = {a.torch for a in cls.spec.torch.aliases if any(n in param_group for n in a.ours)}
        for name, value in self.defaults.items():
            if value is REQUIRED and name not in group:
                raise ValueError(f"{where}: hyperparameter {name!r} is required")
            if name not in derived:  # a torch name is derived from ours when the dict gives ours
                group.setdefault(name, value)
        given = {**{k: v for k, v in getattr(self, "_given", {}).items() if k not in param_group}, **tensors_given(group)}
        synced = sync_group(cls.spec, group, None, where)
        self._check_group(group, gi)
        super().add_param_group(group)
        group = self.param_groups[-1]
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        self._layout.append(GroupLayout(self._pack(group, trainable), frozen, synced, watched=watch(group, given)))
        self.forget_steady()

    def _check_param(self, p, index: int, group_index: int) -> None:
        where = f"params: param_groups[{group_index}]['params'][{index}]"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where} must be a Tensor, got {type(p).__name__}")
        if p.is_complex():
            raise TypeError(f"{where} is complex ({p.dtype}); dml_optim refuses complex parameters (DirectML has "
                            "no kernel for view_as_real/view_as_complex, so a complex parameter cannot be a view "
                            "of a real flat buffer there): keep the parameter real with a trailing dimension of 2 "
                            "and call torch.view_as_complex on it in forward() (README, \"Limitations\")")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{where} must be floating point, got dtype {p.dtype}")
        if p.dtype not in type(self).dtypes:
            raise TypeError(f"{where} has dtype {p.dtype}; {type(self).__name__} takes "
                            f"{', '.join(str(d).replace('torch.', '') for d in type(self).dtypes)} parameters only"
                            f"{type(self)._dtype_hint()}")
        if not p.is_leaf:
            raise ValueError(f"{where} is not a leaf tensor; optimize leaf tensors (nn.Parameter or detach().requires_grad_())")
        if p.is_sparse:
            raise TypeError(f"{where} is sparse; dml_optim supports dense parameters only")
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(f"{where} has a sparse .grad; dml_optim supports dense gradients only "
                            "(clear it with p.grad = None, or use torch.optim.SparseAdam for sparse gradients)")

    @classmethod
    def _dtype_hint(cls) -> str:
        return ""

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        """Hyperparameters and options of ``group`` (in place), and the options against its parameters."""
        type(self).spec.check(group)
        type(self).spec.torch.check_implementation_flags(group)
        check_options(group)
        check_directml_dtypes(group, gi)
        if group["master_weights"] or group["kahan"]:
            option = "master_weights" if group["master_weights"] else "kahan"
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype not in LOW_PRECISION_DTYPES:
                    raise ValueError(f"{option}=True needs float16 or bfloat16 parameters, got {p.dtype} "
                                     f"({describe_param(p, i, gi)}); convert the model first (model.half())")
        if group["kahan"] and group["compute_dtype"] is not None and group["compute_dtype"] in LOW_PRECISION_DTYPES:
            raise ValueError(f"kahan=True needs a wider compute dtype than the parameters, got compute_dtype={group['compute_dtype']}")

    # -- AMP: torch.amp.GradScaler -----------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``torch.amp.GradScaler`` hands this optimizer ``grad_scale``/``found_inf``.

        True only where in-step unscaling pays: float16 gradients
        (GradScaler's ``unscale_`` refuses them) and DirectML buffers (the step
        then unscales and skips on the device without GradScaler's host sync;
        GradScaler's own inf check and update still fall back to the CPU there,
        which is why :class:`~dml_optim.DynamicLossScaler` is the DirectML
        path).  On CPU and CUDA with float32 or bfloat16 gradients GradScaler
        unscales with its own native kernels and calls ``step()`` only when
        nothing overflowed, exactly as for torch.optim; frameworks (Lightning's
        mixed precision with gradient clipping) require that.
        """
        return any(flat.dtype == torch.float16 or flat.device.type == "privateuseone"
                   for layout in self._layout for flat in layout.buffers)

    # -- stepping -------------------------------------------------------------------------------------

    @hook_step  # (torch.optim's step hooks and profiler range, without torch's costlier context manager)
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step; ``closure`` re-evaluates the loss."""
        self._check_params()
        if closure is None and self._steady is not None and not _is_compiling():
            # the repeat of a steady step (engine._repeat) under the grad mode torch.no_grad() sets: set here
            # directly, since the decorator costs about 3 us a call (a third of the repeat's own host work);
            # while dynamo traces a step, the decorated full path runs and the trace sees torch.no_grad()
            enabled = _GRAD_ENABLED()
            _SET_GRAD_ENABLED(False)
            try:
                if self._repeat():
                    return None
            finally:
                _SET_GRAD_ENABLED(enabled)
        return self._step(closure)

    @torch.no_grad()
    def _step(self, closure: Callable[[], Any] | None):
        """:meth:`step` when the last step cannot be repeated: settings, bindings, classes, plan, commit."""
        self._check_capture()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # torch.amp.GradScaler's protocol (see _step_supports_amp_scaling)
            scale = getattr(self, "grad_scale", None)
            self.step_scaled(torch.reciprocal(scale.float()) if scale is not None else None, found_inf=found_inf)
            return loss
        self.forget_steady()
        requests = self.step_requests(in_place=True)
        self._raise_if_nonfinite([r.flat for r in requests if r.group["nonfinite"] == "raise"])
        finite = self._all_finite([r.flat for r in requests if r.group["nonfinite"] == "skip"])
        planned = self._run(requests, lambda group, flat: finite.to(flat.device) if group["nonfinite"] == "skip" else None)
        self.keep_steady(planned)
        return loss

    @torch.no_grad()
    def step_scaled(self, inv_scale: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """A loss-scaled step with no host sync; returns ``found_inf`` (0-d float32).

        Gradients are multiplied by ``inv_scale`` (a 0-d device tensor; None if
        they are already unscaled), checked for inf/NaN on the device, and the
        update of *every* buffer is gated by that one flag: on overflow,
        parameters, states and step counters stay exactly as they were.  If
        ``found_inf`` is given (already known), it is used as is.
        """
        self._check_capture()
        self._check_params()
        requests = self.step_requests()
        work = [(r.group, r.flat) for r in requests]
        if not work:
            device = (inv_scale if inv_scale is not None else found_inf).device
            return torch.zeros((), dtype=torch.float32, device=device)
        if found_inf is None:
            finite = self._unscale(work, inv_scale)
        else:
            if inv_scale is not None:
                for _, flat in work:
                    flat.grad.mul_(inv_scale.to(flat.device))
            finite = found_inf == 0
        self._run(requests, lambda group, flat: finite.to(flat.device))
        return finite.logical_not().float()

    @torch.no_grad()
    def unscale_(self, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale``; return ``found_inf`` (0-d float32).

        For gradient clipping between unscaling and stepping: afterwards call
        ``step_scaled(None, found_inf=found_inf)``.  No host sync; parameters
        and states are not touched.
        """
        work = self._prepare()
        if not work:
            return torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        return self._unscale(work, inv_scale).logical_not().float()

    def _check_capture(self) -> None:
        """Refuse to be recorded into a CUDA graph unless every group is ``capturable``."""
        if not any(flat.device.type == "cuda" for layout in self._layout for flat in layout.buffers):
            return
        if torch.cuda.is_current_stream_capturing() and not all(g["capturable"] for g in self.param_groups):
            raise RuntimeError(
                f"{type(self).__name__}.step() is being captured in a CUDA graph, but the optimizer was not built "
                "with capturable=True: its step counts and bias corrections live on the host and would be frozen "
                "into the graph. Construct it with capturable=True to capture whole training steps."
            )

    # -- zero_grad ------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient with one op per flat buffer (a buffer most of whose parameters have no
        gradient, frozen after the optimizer was built: one per run of those with one, a few at most).

        Unlike torch.optim (whose default is ``set_to_none=True``), the default keeps each ``p.grad`` a view
        of the flat gradient buffer, so autograd accumulates in place and nothing is allocated per step.  As in
        torch.optim, a ``None`` gradient stays ``None``.  With ``set_to_none=True`` gradients become ``None``
        (and a parameter that gets no gradient before the next step is not updated) and no op runs, as in
        torch.optim; the next step reads the new gradients where they are (torch's fused kernel, on the CPU)
        or gathers them into the flat buffer (one copy each).  Frozen (unpacked) parameters' gradients are
        handled as torch.optim would.
        """
        if not set_to_none:
            self._follow()  # re-pointing gradients at buffers the parameters left would be wrong
        for group, layout in zip(self.param_groups, self._layout):
            for flat in layout.buffers:
                flat.zero_grad(set_to_none, self.checks)
            for i in layout.frozen:
                p = group["params"][i]
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        zero_in_place(p.grad)

    # -- introspection ------------------------------------------------------------------------------------

    def flat_buffers(self) -> list[BufferInfo]:
        """One :class:`BufferInfo` per flat buffer, in group order (:mod:`~dml_optim.optimizers.introspect`)."""
        return buffer_infos(self)

    def attach_grads(self) -> None:
        """Point every packed parameter's ``.grad`` at its view of the flat gradient buffer
        (allocated if needed), for code that writes gradients straight into
        :attr:`BufferInfo.grad` (the precision harness, benchmarks)."""
        self._follow()
        for layout in self._layout:
            for flat in layout.buffers:
                flat.attach_grads()
