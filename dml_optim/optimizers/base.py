"""The stateful wrapper every optimizer shares: flat buffers, a validated two-phase step.

A subclass declares what it is (``spec``: hyperparameters, torch.optim twin;
``state_names``, ``step_offset``, ``max_step``, ``dtypes``, ``skip_identity``)
and its math as class-level functions of plain data (``constants``,
``coefficients``, ``rule``); :mod:`dml_optim.update` strings them together.
This class does the rest:

* **layout**: each param group's trainable parameters are packed into one
  :class:`~dml_optim.flat.FlatBuffer` per (device, dtype); frozen parameters
  (``requires_grad=False``) are not packed and cost nothing until they are
  unfrozen, when the next step takes them in;
* **following the parameters**: a step (and ``zero_grad``, ``state_dict``)
  first checks the bindings (:meth:`FlatBuffer.check`); parameters moved or
  cast (``model.to()``, ``.half()``, ``accelerator.prepare``) are re-packed
  on their new device and dtype with their state carried over (cast as
  ``load_state_dict`` casts); a changed shape is refused, naming the
  parameter;
* **plan, then commit**: every check, conversion and coefficient is done
  before the first write, so a step that raises leaves parameters and states
  untouched; ``atomic=True`` also rolls back a failure inside the kernels;
* **step classes**: parameters that stepped together share one counter; a
  step runs the rule once per class of parameters with gradients (re-packing
  when ``None`` gradients left a class in pieces);
* **paths**: eager with counts on the host (coefficients are Python numbers:
  no device op, no sync); eager with counts on the device (gated steps:
  ``nonfinite="skip"`` and loss scaling, and ``capturable=True``); compiled
  (one fused kernel per class, :mod:`dml_optim.compiled`);
* **precision**: ``state_dtype``, ``compute_dtype``, ``master_weights``,
  ``kahan`` (:mod:`dml_optim.update`); chunked through bounded scratch when
  the eager path converts;
* **torch conventions**: param groups carry torch.optim's names too, kept in
  sync (:func:`~dml_optim.optimizers.spec.sync_group`); ``torch.amp.GradScaler``'s
  ``grad_scale``/``found_inf`` protocol; ``capturable`` steps for CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch
from torch.optim import Optimizer

from dml_optim.flat import Binding, FlatBuffer, StepClass, describe_param, group_key, local_tensor
from dml_optim.functional import check_like
from dml_optim.optimizers.spec import REQUIRED, OptimizerSpec, sync_group
from dml_optim.options import (
    CHECK_MODES,
    CHUNK_ELEMENTS,
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
from dml_optim.update import coefficient_dtype, conversion_count, run_rule, step_scalars

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from dml_optim.options import OptimizerOptions

__all__ = ["FlatOptimizer", "BufferInfo"]


@dataclass
class _GroupLayout:
    """The packed form of one param group."""

    buffers: list[FlatBuffer]
    frozen: list[int]  # indices (in the group's params) of parameters not packed (requires_grad=False)
    synced: dict  # torch-name snapshot (spec.sync_group)


@dataclass(frozen=True)
class BufferInfo:
    """A read-only description of one flat buffer (:meth:`FlatOptimizer.flat_buffers`).

    The tensors are the optimizer's own flat tensors (views, not copies):
    reading them is free, writing them changes the optimizer.  ``step_counts``
    (completed steps per packed parameter, in buffer order, which is
    ``param_indices``' order) reads the device counters when the counts live
    there (a host sync).
    """

    group: int
    device: torch.device
    dtype: torch.dtype
    param_indices: tuple[int, ...]
    numel: int
    data: torch.Tensor
    grad: torch.Tensor | None
    states: dict[str, torch.Tensor]
    master: torch.Tensor | None
    kahan: torch.Tensor | None
    scratch: tuple[torch.Tensor, ...]
    step_counts: tuple[int, ...]
    step_classes: int
    backend: str


@dataclass
class _Plan:
    """What one group's step will do (computed without writing anything)."""

    candidate: dict
    synced: dict
    bindings: list[Binding | None]  # per buffer; None: clean
    repack: bool


class FlatOptimizer(Optimizer):
    """Base class of the flat optimizers; see the module docstring."""

    #: What this optimizer is (name, hyperparameters, torch.optim twin).
    spec: ClassVar[OptimizerSpec]
    #: Names of the per-parameter state tensors (torch.optim's names).
    state_names: ClassVar[tuple[str, ...]] = ()
    #: T passed to the rule = completed steps + step_offset.
    step_offset: ClassVar[int] = 0
    #: The largest completed-step count a parameter may reach, and why.
    max_step: ClassVar[int] = MAX_STEP
    max_step_reason: ClassVar[str] = "step counts are saved as float64, exact to 2**53"
    #: Parameter dtypes the rule accepts.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = SUPPORTED_DTYPES
    #: Scalars that make a step an exact no-op when gated (a skipped step).
    skip_identity: ClassVar[dict[str, float]] = {}
    #: Float hyperparameters whose exact zero removes ops (a structural choice for the compiled kernel).
    zero_skips: ClassVar[tuple[str, ...]] = ()
    #: Scratch tensors the rule takes (the most it ever uses).
    scratch_slots: ClassVar[int] = 1
    #: ``f(saved_torch_group) -> reason | None``: torch.optim checkpoints this class must refuse
    #: beyond the generic flags check (AdamW refuses an L2-decay Adam checkpoint).
    checkpoint_refusal: ClassVar[Callable[[dict], str | None] | None] = None

    # -- the math (class-level: no instance state, so the compiled kernel can call them) ----

    @classmethod
    def constants(cls, hyper) -> dict[str, Any]:
        """Scalars of the rule that do not change with the step (from the hyperparameters)."""
        return {}

    @classmethod
    def coefficients(cls, hyper, T) -> dict[str, Any]:  # pragma: no cover - abstract
        """Per-step scalars at step ``T`` (a number or a 0-d tensor)."""
        raise NotImplementedError

    @staticmethod
    def rule(x, g, *states, scratch, **scalars) -> None:  # pragma: no cover - abstract
        """The in-place update of one range (a function of :mod:`dml_optim.functional`)."""
        raise NotImplementedError

    @classmethod
    def scratch_count(cls, hyper, gated: bool) -> int:
        """Full-size scratch tensors the eager rule needs."""
        return 1

    @classmethod
    def group_state_names(cls, hyper) -> tuple[str, ...]:
        """The states a group with these hyperparameters keeps (AdamW's AMSGrad adds one)."""
        return cls.state_names

    # -- construction ---------------------------------------------------------------------------

    def __init__(self, params, hyperparameters: dict[str, Any], torch_names: dict[str, Any],
                 options: "dict[str, Any]"):
        cls = type(self)
        options = dict(options)
        self.atomic = check_flag("atomic", options.pop("atomic", False))
        #: ``"full"``: every step compares every parameter's binding (two C-level passes);
        #: ``"fast"``: only the first and last of each buffer (see the README).
        self.checks = check_choice("checks", options.pop("checks", "full"), CHECK_MODES)
        self.pack_via = check_choice("pack_via", options.pop("pack_via", "auto"), PACK_MODES)
        for name in options:
            if name in cls.spec.torch.refused:
                raise TypeError(f"{cls.__name__}() got {name}={options[name]!r}: {cls.spec.torch.refused[name]}")
            if name not in OPTION_NAMES:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
        group_options = {**OPTION_DEFAULTS, **options}
        check_options(group_options)
        defaults = {**self._resolve_torch_names(hyperparameters, torch_names), **group_options}
        cls.spec.check(defaults)
        sync_group(cls.spec, defaults, None, "defaults")
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of Tensors or dicts, got a Tensor")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"params must be given as an ordered collection (a list), got a {type(params).__name__}")
        self._layout: list[_GroupLayout] = []
        super().__init__(params, defaults)
        from dml_optim.optimizers._stateview import StateView

        self.state = StateView(self)

    @classmethod
    def _resolve_torch_names(cls, hyper: dict[str, Any], torch_names: dict[str, Any]) -> dict[str, Any]:
        """Our hyperparameters with torch.optim keywords (same meaning) applied; conflicts are errors."""
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
            for name, v in zip(alias.ours, derived):
                if hyper[name] != defaults.get(name) and hyper[name] != v:
                    raise TypeError(f"{cls.__name__}() got {alias.torch}={value!r} and {name}={hyper[name]!r}, which "
                                    f"disagree ({alias.torch} sets {name}={v!r}); pass one of the two")
                hyper[name] = v
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
        group["params"] = params
        gi = len(self.param_groups)
        for i, p in enumerate(params):
            self._check_param(p, i, gi)
        self._check_duplicates(params, gi)
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
        synced = sync_group(cls.spec, group, None, where)
        self._check_group(group, gi)
        super().add_param_group(group)
        group = self.param_groups[-1]
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        self._layout.append(_GroupLayout(self._pack(group, trainable), frozen, synced))

    def _check_param(self, p, index: int, group_index: int) -> None:
        where = f"params: param_groups[{group_index}]['params'][{index}]"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where} must be a Tensor, got {type(p).__name__}")
        if p.is_complex():
            raise TypeError(f"{where} is complex ({p.dtype}); dml_optim refuses complex parameters: "
                            "pass torch.view_as_real(p) parameters instead")
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

    def _check_duplicates(self, params: list, gi: int) -> None:
        first: dict[int, int] = {}
        for i, p in enumerate(params):
            if id(p) in first:
                raise ValueError(f"params: param_groups[{gi}] lists the same parameter twice "
                                 f"(['params'][{first[id(p)]}] and ['params'][{i}])")
            first[id(p)] = i
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"params: {describe_param(p, i, gi)} appears in more than one parameter group")

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        """Hyperparameters and options of ``group`` (in place), and the options against its parameters."""
        type(self).spec.check(group)
        check_options(group)
        if group["master_weights"] or group["kahan"]:
            option = "master_weights" if group["master_weights"] else "kahan"
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype not in LOW_PRECISION_DTYPES:
                    raise ValueError(f"{option}=True needs float16 or bfloat16 parameters, got {p.dtype} "
                                     f"({describe_param(p, i, gi)}); convert the model first (model.half())")
        if group["kahan"] and group["compute_dtype"] is not None and group["compute_dtype"] in LOW_PRECISION_DTYPES:
            raise ValueError(f"kahan=True needs a wider compute dtype than the parameters, got compute_dtype={group['compute_dtype']}")

    def _via_host(self, device: torch.device) -> bool:
        return self.pack_via == "host" or (self.pack_via == "auto" and device.type not in ("cpu", "meta"))

    def _pack(self, group: dict[str, Any], indices: Sequence[int]) -> list[FlatBuffer]:
        by_key: dict[tuple, list[int]] = {}
        for i in indices:
            by_key.setdefault(group_key(group["params"][i]), []).append(i)
        buffers = []
        for key_indices in by_key.values():
            params = [group["params"][i] for i in key_indices]
            buffers.append(FlatBuffer(params, key_indices, via_host=self._via_host(local_tensor(params[0]).device)))
        return buffers

    # -- precision ------------------------------------------------------------------------------

    @staticmethod
    def _precision(group) -> tuple:
        return (group["state_dtype"], group["compute_dtype"], group["master_weights"], group["kahan"])

    @classmethod
    def _master_dtype(cls, group, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the master copy (``master_weights=True``): the compute dtype, at least FP32."""
        cdtype = cls._compute_dtype(group, dtype)
        return torch.float32 if cdtype in LOW_PRECISION_DTYPES else cdtype

    @staticmethod
    def _state_dtype(group, dtype: torch.dtype) -> torch.dtype:
        """States are FP32 with master weights or Kahan unless ``state_dtype`` says otherwise."""
        if group["state_dtype"] is not None:
            return group["state_dtype"]
        return torch.float32 if group["master_weights"] or group["kahan"] else dtype

    @classmethod
    def _compute_dtype(cls, group, dtype: torch.dtype) -> torch.dtype:
        """Arithmetic dtype: ``compute_dtype``, else FP32 (at least) with master weights or Kahan, else the parameters'."""
        if group["compute_dtype"] is not None:
            return group["compute_dtype"]
        if group["master_weights"] or group["kahan"]:
            sdtype = cls._state_dtype(group, dtype)
            return torch.float32 if sdtype in LOW_PRECISION_DTYPES else sdtype
        return dtype

    def _converts(self, group, flat: FlatBuffer) -> bool:
        """The eager rule needs converted operands (it then runs in chunks)."""
        cdtype = self._compute_dtype(group, flat.dtype)
        x_dtype = flat.master.dtype if flat.master is not None else flat.dtype
        return (group["kahan"] or x_dtype != cdtype or flat.dtype != cdtype
                or any(s.dtype != cdtype for s in flat.states.values()))

    def _ensure_state(self, group, flat: FlatBuffer) -> None:
        """Allocate flat states, master copy and compensation buffer (first step, or after a re-pack)."""
        names = type(self).group_state_names(group)
        if flat.precision is not None and all(n in flat.states for n in names):
            return
        flat.precision = self._precision(group)
        sdtype = self._state_dtype(group, flat.dtype)
        with torch.no_grad():
            for name in names:
                if name not in flat.states:
                    flat.states[name] = torch.zeros(flat.numel, dtype=sdtype, device=flat.device)
            if group["master_weights"] and flat.master is None:
                flat.master = flat.data.to(self._master_dtype(group, flat.dtype))
            if group["kahan"] and flat.kahan is None:
                flat.kahan = torch.zeros(flat.numel, dtype=flat.dtype, device=flat.device)
        flat.scratch = []

    def _ensure_scratch(self, group, flat: FlatBuffer, gated: bool, compiled: bool) -> None:
        """Scratch for the eager rule: full size, or one chunk when it converts; none for a compiled
        buffer (the fused kernel needs none; an eager call on it, under a dispatch mode, allocates)."""
        if compiled:
            flat.scratch = []
            return
        converts = self._converts(group, flat)
        size = min(flat.numel, CHUNK_ELEMENTS) if converts else flat.numel
        count = type(self).scratch_count(group, gated)
        count += conversion_count(converts, group["kahan"], len(flat.states))
        if len(flat.scratch) == count and all(len(s) == size for s in flat.scratch):
            return
        cdtype = self._compute_dtype(group, flat.dtype)
        flat.scratch = [torch.empty(size, dtype=cdtype, device=flat.device) for _ in range(count)]

    # -- AMP: torch.amp.GradScaler -----------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``torch.amp.GradScaler`` hands this optimizer ``grad_scale``/``found_inf``.

        True only where in-step unscaling pays: float16/bfloat16 gradients
        (GradScaler's ``unscale_`` refuses them) and DirectML buffers (the step
        then unscales and skips on the device without GradScaler's host sync;
        GradScaler's own inf check and update still fall back to the CPU there,
        which is why :class:`~dml_optim.DynamicLossScaler` is the DirectML
        path).  On CPU and CUDA with float32 gradients GradScaler unscales with
        its own native kernels and calls ``step()`` only when nothing
        overflowed; frameworks (Lightning's mixed precision with gradient
        clipping) require that.
        """
        return any(flat.dtype in LOW_PRECISION_DTYPES or flat.device.type == "privateuseone"
                   for layout in self._layout for flat in layout.buffers)

    # -- stepping -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step; ``closure`` re-evaluates the loss."""
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
        work = self._prepare()
        self._raise_if_nonfinite([flat for group, flat in work if group["nonfinite"] == "raise"])
        finite = self._all_finite([flat for group, flat in work if group["nonfinite"] == "skip"])
        self._run(work, lambda group, flat: finite.to(flat.device) if group["nonfinite"] == "skip" else None)
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
        work = self._prepare()
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
        self._run(work, lambda group, flat: finite.to(flat.device))
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

    def _unscale(self, work, inv_scale: torch.Tensor) -> torch.Tensor:
        """Unscale the gradients of ``work``; 0-d bool: all of them are finite."""
        for _, flat in work:
            flat.grad.mul_(inv_scale.to(flat.device))
        return self._all_finite([flat for _, flat in work])

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

    # -- preparing a step: check everything, then apply binding changes ------------------------------

    def _prepare(self) -> list[tuple[dict, FlatBuffer]]:
        """Validate every group, then bring bindings up to date and allocate states.

        Raises before any parameter or state is written.  Returns the buffers
        that have at least one gradient.
        """
        plans = [self._plan(gi, group) for gi, group in enumerate(self.param_groups)]
        work = []
        for gi, (group, plan) in enumerate(zip(self.param_groups, plans)):
            params = group["params"]
            group.update(plan.candidate)
            group["params"] = params
            layout = self._layout[gi]
            layout.synced = plan.synced
            if plan.repack:
                self._repack_group(gi)
                bindings = [flat.diagnose() for flat in layout.buffers]
            else:
                bindings = plan.bindings
            for flat, binding in zip(layout.buffers, bindings):
                active = self._bind(flat, binding)
                if active is not None and not any(active):
                    continue
                self._ensure_state(group, flat)
                work.append((group, flat))
        return work

    def _plan(self, gi: int, group: dict[str, Any]) -> _Plan:
        """Everything a group's step needs to know, without writing anything."""
        layout = self._layout[gi]
        candidate = {k: v for k, v in group.items() if k != "params"}
        candidate["params"] = group["params"]
        synced = sync_group(type(self).spec, candidate, layout.synced, f"param_groups[{gi}]")
        self._check_group(candidate, gi)
        del candidate["params"]
        repack = bool(layout.frozen) and any(group["params"][i].requires_grad for i in layout.frozen)
        bindings: list[Binding | None] = []
        full = self.checks == "full"
        for flat in layout.buffers:
            if flat.precision is not None and flat.precision != self._precision(candidate):
                old, new = flat.precision, self._precision(candidate)
                names = ("state_dtype", "compute_dtype", "master_weights", "kahan")
                changed = [f"{k} from {a} to {b}" for k, a, b in zip(names, old, new) if a != b]
                raise ValueError(f"param_groups[{gi}]: {', '.join(changed)} after the states were allocated is not "
                                 "supported; build a new optimizer with the new options and load_state_dict() into it")
            if flat.check(full):
                bindings.append(None)
                continue
            binding = flat.diagnose()
            for i in binding.foreign:
                self._check_grad(flat, i, gi)
            for i in binding.rebound:
                repack |= self._check_rebound(flat, i, gi)
            bindings.append(binding)
        if repack:
            for i in layout.frozen:
                p = group["params"][i]
                if p.requires_grad:
                    self._check_param(p, i, gi)
        return _Plan(candidate, synced, bindings, repack)

    def _check_grad(self, flat: FlatBuffer, i: int, gi: int) -> None:
        p = flat.params[i]
        grad = p.grad
        where = describe_param(p, flat.indices[i], gi)
        if grad.is_sparse:
            raise TypeError(f"grad of {where} is sparse; dml_optim supports dense gradients only")
        check_like(f"grad of {where}", local_tensor(grad), "the parameter", local_tensor(p))

    def _check_rebound(self, flat: FlatBuffer, i: int, gi: int) -> bool:
        """A re-bound parameter: can it be followed?  Returns True when the group must be re-packed."""
        p = flat.params[i]
        t = local_tensor(p)
        shape = flat.shapes()[i] if not flat.staged else t.shape
        where = describe_param(p, flat.indices[i], gi)
        if t.shape != shape:
            raise RuntimeError(f"{where} was re-bound to a tensor of another shape (it was {tuple(shape)}) after the "
                               "optimizer was created; dml_optim follows moves and casts, not reshapes: create the "
                               "optimizer after changing the model")
        if t.dtype not in type(self).dtypes:
            self._check_param(p, flat.indices[i], gi)
        return t.dtype != flat.dtype or t.device != flat.device or not flat.owned

    # -- applying binding changes -------------------------------------------------------------------

    def _bind(self, flat: FlatBuffer, binding: Binding | None) -> list[bool] | None:
        """Adopt re-bound parameters, gather foreign gradients, split and order the step classes.

        Returns which parameters have a gradient (None: all of them).
        """
        if binding is None:
            active = None
        else:
            if binding.rebound:
                flat.adopt_params(binding.rebound)
            if binding.foreign:
                flat.gather_grads(binding.foreign)
            active = binding.active
        if flat.staged:
            flat.stage_in()
        counter = flat.counter
        if active is None and len(counter.classes) == 1:
            counter.classes[0].active = True
            return None
        if active is not None and not any(active):
            return active
        counter.split(active)
        order = counter.order()
        if order is not None and flat.owned:
            flat.permute(order)
            if active is not None:
                where = {i: pos for pos, i in enumerate(order)}
                permuted = [False] * len(active)
                for i, a in enumerate(active):
                    permuted[where[i]] = a
                active = permuted
        if active is not None:  # slots of None gradients may hold an old gradient (inf included)
            for c in counter.classes:
                if not c.active:
                    a, b = flat.segment(c.first, c.stop)
                    flat.ensure_grad()[a:b].zero_()
        return active

    def _repack_group(self, gi: int, include: set[int] = frozenset()) -> None:
        """Rebuild a group's buffers for its parameters' current devices, dtypes and trainability.

        Existing state is carried over per parameter (cast to the new state
        dtype, moved to the new device, as ``load_state_dict`` does); newly
        trainable parameters start with fresh state, as torch.optim gives them.
        """
        group = self.param_groups[gi]
        layout = self._layout[gi]
        carried: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        for flat in layout.buffers:
            counts = flat.counter.counts()
            sources = {name: flat.views(t) for name, t in flat.states.items()}
            if flat.master is not None:
                sources["master_param"] = flat.views(flat.master)
            if flat.kahan is not None:
                sources["kahan_comp"] = flat.views(flat.kahan)
            for i, gindex in enumerate(flat.indices):
                carried[gindex] = ({k: v[i] for k, v in sources.items()}, counts[i])
        members = sorted(set(carried) | {i for i in layout.frozen if group["params"][i].requires_grad or i in include})
        layout.frozen = [i for i in range(len(group["params"])) if i not in set(members)]
        old = layout.buffers
        layout.buffers = self._pack(group, members)
        for flat in layout.buffers:
            grads = [p.grad for p in flat.params]
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                flat.gather_grads(present)
            if not any(gi_ in carried for gi_ in flat.indices):
                continue
            self._ensure_state(group, flat)
            counts = []
            with torch.no_grad():
                for i, gindex in enumerate(flat.indices):
                    states, count = carried.get(gindex, ({}, 0))
                    counts.append(count)
                    for name, src in states.items():
                        dst = {"master_param": flat.master, "kahan_comp": flat.kahan}.get(name, flat.states.get(name))
                        if dst is not None:
                            a, b = flat.segment(i, i + 1)
                            dst[a:b].copy_(src.reshape(-1))
            flat.counter.set_counts(counts)
        del old

    # -- non-finite gradients ----------------------------------------------------------------------

    @staticmethod
    def _finite(flat: FlatBuffer) -> torch.Tensor:
        """0-d bool on the device: every gradient element is finite (one reduction, no host sync).

        ``max |g| < inf`` is false for an inf and for a NaN (the max propagates NaN).
        """
        if flat.numel == 0:
            return torch.ones((), dtype=torch.bool, device=flat.device)
        return torch.linalg.vector_norm(flat.grad, float("inf")) < math.inf

    def _all_finite(self, flats: list[FlatBuffer]) -> torch.Tensor | None:
        """0-d bool on the first buffer's device: every gradient of ``flats`` is finite (None for none)."""
        finite = None
        for flat in flats:
            ok = self._finite(flat)
            finite = ok if finite is None else finite.logical_and_(ok.to(finite.device))
        return finite

    def _raise_if_nonfinite(self, flats: list[FlatBuffer]) -> None:
        """``nonfinite="raise"``: one host sync per step; names the offending parameters."""
        finite = self._all_finite(flats)
        if finite is None or bool(finite):
            return
        bad = []
        for gi, layout in enumerate(self._layout):
            for flat in layout.buffers:
                if any(flat is f for f in flats):
                    bad += [describe_param(p, idx, gi) for p, idx, g in zip(flat.params, flat.indices, flat.grad_views)
                            if p.grad is not None and not bool(torch.isfinite(g).all())]
        raise FloatingPointError(f"non-finite gradient (inf or nan) in {', '.join(bad)}; nothing was updated")

    # -- running the rule ------------------------------------------------------------------------------

    def _run(self, work, gate: Callable[[dict, FlatBuffer], torch.Tensor | None]) -> None:
        """Plan every class update (checks and host coefficients), then commit them."""
        from dml_optim.backends import resolved_backend, runner_for

        cls = type(self)
        planned = []
        for group, flat in work:
            self._check_range(group, flat, {h.name: group[h.name] for h in cls.spec.hyperparameters if h.kind == "float"})
            finite = gate(group, flat)
            runner = runner_for(self, group, flat)
            self._ensure_scratch(group, flat, finite is not None, resolved_backend(self, group, flat) == "compiled")
            for c in flat.counter.classes:
                if not c.active:
                    continue
                scalars = None  # host scalars whenever the host knows the count (also a declined runner's fallback)
                if c.count is not None:
                    if c.count + 1 > cls.max_step:
                        raise OverflowError(
                            f"{cls.__name__}: this would be step {c.count + 1} of a parameter, beyond the "
                            f"{cls.max_step} steps it can count ({cls.max_step_reason}); nothing was updated")
                    if finite is None and not group["capturable"]:
                        scalars = step_scalars(cls, group, c.count, None)
                        self._check_range(group, flat, scalars)
                planned.append((group, flat, c, finite, runner, scalars))
        self._commit(work, planned)

    def _check_range(self, group, flat: FlatBuffer, scalars: dict[str, Any]) -> None:
        """Refuse per-step scalars the compute dtype cannot hold (before any write)."""
        cdtype = self._compute_dtype(group, flat.dtype)
        limit = torch.finfo(cdtype).max
        for name, value in scalars.items():
            if isinstance(value, float) and abs(value) > limit:
                raise ValueError(f"{name}={value!r} (from the hyperparameters of this param group) is beyond the "
                                 f"range of {cdtype} (max {limit:g}); nothing was updated")

    def _commit(self, work, planned) -> None:
        """Run the planned updates; then advance the host bookkeeping.

        Only kernels run here.  If one raises (a device fault, an interrupt, an
        injected failure), an optimizer built with ``atomic=True`` restores
        parameters, states and counters from a snapshot taken before the first
        write; otherwise the exception gets a note naming what may have been
        partially updated.
        """
        snapshot = self._snapshot(work) if self.atomic else None
        done = 0
        try:
            for group, flat, c, finite, runner, scalars in planned:
                if runner is None or not runner(group, flat, c, finite):
                    self._apply_eager(group, flat, c, finite, scalars)
                done += 1
            for _, flat in work:
                if flat.staged:
                    flat.stage_out()
        except BaseException as exc:
            if snapshot is not None:
                for dst, src in snapshot:
                    dst.copy_(src)
            elif hasattr(exc, "add_note"):
                exc.add_note(
                    f"dml_optim: {type(self).__name__}.step() failed while writing (after {done} of {len(planned)} "
                    "updates had finished); parameters and states may be partially updated. Restore a checkpoint, "
                    "or construct the optimizer with atomic=True to roll failed steps back."
                )
            raise
        for group, flat in work:
            gated = group["capturable"] or any(f is not None for g, fl, _, f, _, _ in planned if fl is flat)
            flat.counter.advance(gated)
            if group["capturable"]:
                flat.counter.forget_host_counts()
            flat.mark_clean()

    def _snapshot(self, work) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of everything a commit writes (``atomic=True`` only)."""
        tensors = []
        for _, flat in work:
            tensors += flat.tensors()
            tensors += [c.tensor for c in flat.counter.classes if c.tensor is not None]
        return [(t, t.clone()) for t in tensors]

    def _apply_eager(self, group, flat: FlatBuffer, c: StepClass, finite, scalars) -> None:
        """The eager rule over one class, with counts on the host (``scalars`` given) or on the device."""
        cls = type(self)
        if scalars is None:  # counts on the device: the scalars are computed there
            if c.tensor is None:
                flat.counter.ensure_tensors(flat.device)
            scalars = step_scalars(cls, group, c.tensor, finite, coefficient_dtype(flat.device))
        start, end = flat.segment(c.first, c.stop)
        self._apply_range(group, flat, start, end, scalars, finite)
        if c.tensor is not None:
            if c.count is not None and finite is None and not group["capturable"]:
                c.tensor = None  # the host count advances; a stale device mirror is dropped
            else:
                c.tensor.add_(finite.long() if finite is not None else 1)

    def _apply_range(self, group, flat: FlatBuffer, start: int, end: int, scalars, finite) -> None:
        """The rule over elements ``[start, end)``, chunked when operands are converted."""
        cls = type(self)
        names = cls.group_state_names(group)
        x = flat.master if flat.master is not None else flat.data
        out = flat.data if flat.master is not None else None
        cdtype = self._compute_dtype(group, flat.dtype)
        n_rule = cls.scratch_count(group, finite is not None)
        rule_scratch, conversions = flat.scratch[:n_rule], flat.scratch[n_rule:]
        scratch_full = bool(flat.scratch) and len(flat.scratch[0]) >= flat.numel
        if not self._converts(group, flat):
            whole = start == 0 and end == flat.numel
            cut = (lambda t: t) if whole else (lambda t: t[start:end])
            scratch = [cut(s) for s in rule_scratch] if scratch_full else [None] * cls.scratch_slots
            run_rule(cls, cut(x), cut(flat.grad), [cut(flat.states[n]) for n in names], scalars,
                     compute_dtype=cdtype, finite=finite, scratch=scratch + [None] * (cls.scratch_slots - len(scratch)))
            return
        chunk = len(flat.scratch[0]) if flat.scratch and len(flat.scratch[0]) else CHUNK_ELEMENTS
        for a in range(start, end, chunk):
            b = min(a + chunk, end)
            k = b - a
            run_rule(cls, x[a:b], flat.grad[a:b], [flat.states[n][a:b] for n in names], scalars,
                     compute_dtype=cdtype, finite=finite, params_out=out[a:b] if out is not None else None,
                     comp=flat.kahan[a:b] if flat.kahan is not None else None,
                     buffers=[t[:k] for t in conversions] if conversions else None,
                     scratch=[s[:k] for s in rule_scratch] + [None] * (cls.scratch_slots - len(rule_scratch)))

    # -- zero_grad ------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient with one op per flat buffer.

        Unlike torch.optim (whose default is ``set_to_none=True``), the default
        keeps each ``p.grad`` a view of the flat gradient buffer, so autograd
        accumulates in place and nothing is allocated per step.  As in
        torch.optim, a ``None`` gradient stays ``None``.  With
        ``set_to_none=True`` gradients become ``None`` (and a parameter that
        gets no gradient before the next step is not updated); the next step
        gathers the new gradients into the flat buffer (one copy each).
        Frozen (unpacked) parameters' gradients are handled as torch.optim would.
        """
        if not set_to_none:
            self._follow()  # re-pointing gradients at buffers the parameters left would be wrong
        for group, layout in zip(self.param_groups, self._layout):
            for flat in layout.buffers:
                flat.zero_grad(set_to_none)
            for i in layout.frozen:
                p = group["params"][i]
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().requires_grad_(False).zero_()

    # -- introspection ------------------------------------------------------------------------------------

    def flat_buffers(self) -> list[BufferInfo]:
        """One :class:`BufferInfo` per flat buffer, in group order."""
        from dml_optim.backends import resolved_backend

        out = []
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            for flat in layout.buffers:
                out.append(BufferInfo(
                    group=gi, device=flat.device, dtype=flat.dtype, param_indices=tuple(flat.indices),
                    numel=flat.numel, data=flat.data, grad=flat.grad, states=dict(flat.states), master=flat.master,
                    kahan=flat.kahan, scratch=tuple(flat.scratch), step_counts=tuple(flat.counter.counts()),
                    step_classes=len(flat.counter.classes), backend=resolved_backend(self, group, flat),
                ))
        return out

    def attach_grads(self) -> None:
        """Point every packed parameter's ``.grad`` at its view of the flat gradient buffer
        (allocated if needed), for code that writes gradients straight into
        :attr:`BufferInfo.grad` (the precision harness, benchmarks)."""
        self._follow()
        for layout in self._layout:
            for flat in layout.buffers:
                flat.attach_grads()

    def _buffers_of(self, gi: int) -> list[FlatBuffer]:
        return self._layout[gi].buffers

    def _locate(self, p) -> tuple[int, FlatBuffer | None, int]:
        """``(group index, buffer or None, position)`` of parameter ``p`` (buffer None: frozen)."""
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            for flat in layout.buffers:
                for i, q in enumerate(flat.params):
                    if q is p:
                        return gi, flat, i
            for i in layout.frozen:
                if group["params"][i] is p:
                    return gi, None, i
        raise KeyError(f"not a parameter of this optimizer: tensor of shape {tuple(getattr(p, 'shape', ()))}")

    # -- state dict ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (``state`` by parameter index, ``param_groups``),
        plus ``dml_optim: {"format_version": 1, "optimizer": <class name>}``.

        Contains only tensors and plain Python values, so
        ``torch.load(..., weights_only=True)`` loads it.  State tensors are
        views of the flat buffers (torch.save stores each buffer once); for
        distributed (DTensor) parameters they are DTensors with the
        parameter's sharding.
        """
        from dml_optim.optimizers.state_dict import save

        return save(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of the torch.optim equivalent.

        Everything is checked before anything is written.  State tensors are
        cast to this optimizer's state dtype and device (a checkpoint saved on
        CUDA in float32 loads into a DirectML float16 optimizer and back).
        """
        from dml_optim.optimizers.state_dict import load

        load(self, state_dict)

    # -- following the parameters outside a step ---------------------------------------------------

    def _follow(self) -> None:
        """Re-pack groups whose parameters were moved, cast or unfrozen (``zero_grad``, ``state_dict``, loads)."""
        full = self.checks == "full"
        for gi, (group, layout) in enumerate(zip(self.param_groups, self._layout)):
            repack = bool(layout.frozen) and any(group["params"][i].requires_grad for i in layout.frozen)
            moved = [(flat, flat.rebound()) for flat in layout.buffers if flat.moved(full)]
            for flat, rebound in moved:
                for i in rebound:
                    repack |= self._check_rebound(flat, i, gi)
            if repack:
                self._repack_group(gi)
            else:
                for flat, rebound in moved:
                    if rebound:
                        flat.adopt_params(rebound)

    def _include(self, keys: Sequence[tuple[int, int]]) -> None:
        """Pack the frozen parameters among ``keys`` (``(group, index)``): they are getting state."""
        for gi in sorted({gi for gi, pi in keys if pi in self._layout[gi].frozen}):
            self._repack_group(gi, include={pi for g, pi in keys if g == gi})
