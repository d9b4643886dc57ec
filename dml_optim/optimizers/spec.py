"""What an optimizer *is*, as data: its hyperparameters, their ranges, and its torch.optim twin.

Each optimizer class carries one :class:`OptimizerSpec` (``cls.spec``); the
registry (:mod:`dml_optim.optimizers.registry`) lists the classes.  Everything
that maps names (the CLI, the audit, the benchmarks, the precision harness,
the state-dict loader, the tests) reads these declarations, so an optimizer's
facts are written once.

torch.optim names.  Frameworks and schedulers read and write torch's
param-group keys (``OneCycleLR`` cycles ``group["betas"]`` or
``group["momentum"]``; code reads ``group["weight_decay"]``).  A
:class:`TorchAlias` declares a torch key with *the same meaning* as one or
more of ours (``betas`` = ``(alpha, beta)`` for ONNX Adam).  Param groups carry
both names; :func:`sync_group` keeps them equal: a write through either name
takes effect at the next step, and a contradiction is an error naming both.
A torch keyword whose meaning differs (ONNX Adam's ``eps``: epsilon is added
before the bias correction there, after it in torch) is listed in
:attr:`TorchEquivalent.refused` with the reason, which the constructor's
``TypeError`` quotes.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dml_optim.core.functional import check_hyperparameter

__all__ = ["Hyperparameter", "TorchAlias", "TorchEquivalent", "OptimizerSpec", "sync_group", "agree", "REQUIRED",
           "IMPLEMENTATION_FLAGS"]


class _Required:
    """Marker default of a hyperparameter that must be given (ONNX Momentum's ``R``)."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter: name, default, allowed values, and how it reaches a kernel.

    ``kind`` is ``"float"`` (range-checked, stored as a float), ``"choice"``
    (one of ``choices``) or ``"bool"``.  Float hyperparameters reach the
    compiled kernel as 0-d tensors; ``"choice"``/``"bool"`` ones, and a float
    listed in ``zero_skips`` being exactly 0, select the kernel's structure.
    """

    name: str
    default: Any
    doc: str
    kind: str = "float"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def check(self, value) -> Any:
        """The value as stored (a float for ``"float"``); raises naming the hyperparameter."""
        if self.kind == "float":
            return check_hyperparameter(self.name, value, low=self.low, high=self.high,
                                        low_open=self.low_open, high_open=self.high_open)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{self.name} must be a bool, got {value!r}")
            return value
        if not isinstance(value, str) or value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
        return value

    def describe_range(self) -> str:
        if self.kind == "bool":
            return "True or False"
        if self.kind == "choice":
            return " or ".join(map(repr, self.choices))
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}{')' if self.high_open or self.high is None else ']'}"


@dataclass(frozen=True)
class TorchAlias:
    """A torch.optim param-group key with the same meaning as ``ours``.

    ``to_torch(*ours_values)`` gives the torch value; ``from_torch(value)``
    gives ours as a tuple (raising ``TypeError``/``ValueError`` on a malformed value).
    """

    torch: str
    ours: tuple[str, ...]
    to_torch: Callable[..., Any]
    from_torch: Callable[[Any], tuple]


def _pair(value, names: tuple[str, str] = ("first", "second")) -> tuple[Any, Any]:
    """The two elements of a pair, as given: each is validated under its own name afterwards (so
    ``betas=("0.1", 0.999)`` is refused as ``beta1``, naming the value, like every hyperparameter).
    One float and one Tensor is refused as torch.optim refuses it (``ValueError``)."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"must be a pair of numbers, got {_short(value)}")
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"must be a pair of numbers, got {_short(value)}") from None
    import torch

    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        shown = " and ".join(f"{n}={_describe(v)}" for n, v in zip(names, (a, b)))
        raise ValueError(f"must be either both floats or both Tensors (as in torch.optim), got {shown}")
    return a, b


def _describe(value) -> str:
    import torch

    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return f"a tensor of shape {tuple(value.shape)}"
    return _short(value)


def _one_float(value) -> tuple[float]:
    if isinstance(value, bool):
        raise TypeError(f"must be a number, got {value!r}")
    try:
        return (float(value),)
    except OverflowError:
        raise ValueError(f"is too large for a float, got {_short(value)}") from None
    except (TypeError, ValueError):
        raise TypeError(f"must be a number, got {_short(value)}") from None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def betas_alias(first: str, second: str) -> TorchAlias:
    """torch's ``betas`` = ``(first, second)``."""
    return TorchAlias("betas", (first, second), lambda a, b: (a, b), lambda value: _pair(value, (first, second)))


def same_alias(torch_name: str, ours: str) -> TorchAlias:
    """A torch key that is one of ours under another name (``weight_decay`` = ``norm_coefficient``)."""
    return TorchAlias(torch_name, (ours,), lambda v: v, _one_float)


@dataclass(frozen=True)
class TorchEquivalent:
    """The torch.optim optimizer nearest to ours, and how names and values map.

    ``aliases``: torch keys with our meaning under another name (kept in param
    groups).  ``same``: our hyperparameters that *are* torch's (same name,
    same meaning).  ``nearest``: our names passed to torch under another name
    although the meaning differs slightly (ONNX Adam's ``epsilon`` → ``eps``),
    for side-by-side runs.  Conditions are ``(name, predicate(hyperparameters),
    reason)``: ``requires`` must hold for a twin to exist at all
    (``norm_coefficient_post == 0``); ``exact_when`` for the twin to compute
    the same update (``epsilon == 0``), which :meth:`OptimizerSpec.torch_kwargs`
    enforces when asked for an exact twin.
    ``refused``: torch keywords our constructor refuses, with the reason.
    ``flags``: torch flags that change the update; a torch checkpoint with one
    set that we don't implement is refused by the state-dict loader.
    """

    class_name: str | None  # None: no torch.optim twin (Lion): no side-by-side torch run, no torch kwargs
    aliases: tuple[TorchAlias, ...] = ()
    same: tuple[str, ...] = ()
    nearest: Mapping[str, str] = field(default_factory=dict)
    requires: tuple[tuple[str, Callable[[Mapping[str, Any]], bool], str], ...] = ()
    exact_when: tuple[tuple[str, Callable[[Mapping[str, Any]], bool], str], ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ("maximize", "amsgrad", "decoupled_weight_decay")
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def exists(self) -> bool:
        """Whether torch.optim has this twin (an optimizer without one names ``class_name=None``)."""
        return self.class_name is not None

    @property
    def torch_class(self):
        import torch

        if self.class_name is None:
            raise ValueError("this optimizer has no torch.optim twin")
        return getattr(torch.optim, self.class_name)

    def implementation_flags(self) -> dict[str, Any]:
        """torch's implementation keys of the twin (``foreach``, ``fused``, ``differentiable``,
        ``decoupled_weight_decay``) as the *installed* torch's twin has them in its defaults, with
        its default values (``fixed`` overrides: AdamW's ``decoupled_weight_decay`` is True)."""
        if self.class_name is None:
            return {}
        flags = _twin_flags(self.class_name)
        return dict(flags, **{k: v for k, v in self.fixed.items() if k in flags})

    def check_implementation_flags(self, group: Mapping[str, Any]) -> None:
        """Refuse implementation-flag values that would change the update (naming key and value).

        ``foreach``/``fused``: None or a bool, accepted and without effect
        (every step is flat); ``differentiable``: False (our steps are in place);
        a ``fixed`` key: its value (``decoupled_weight_decay=False`` is
        torch.optim.Adam's L2 rule, not AdamW's).
        """
        for key, default in self.implementation_flags().items():
            if key not in group:
                continue
            value = group[key]
            if key in ("foreach", "fused"):
                if value is not None and not isinstance(value, bool):
                    raise TypeError(f"{key} must be None or a bool, got {_short(value)}")
            elif key == "differentiable":
                if value is not False:
                    raise TypeError(f"differentiable={_short(value)}: dml_optim's steps are in place and not "
                                     f"differentiable; use torch.optim.{self.class_name}(differentiable=True) for that")
            elif key in self.fixed and (isinstance(value, bool) != isinstance(default, bool) or value != default):
                raise ValueError(f"{key}={_short(value)}: this optimizer implements torch.optim.{self.class_name}'s "
                                 f"rule with {key}={default!r} only")


#: torch.optim keys that select an implementation, not the update (and AdamW's flag for its rule).
IMPLEMENTATION_FLAGS = ("foreach", "fused", "differentiable", "decoupled_weight_decay")
_TWIN_FLAGS: dict[str, dict[str, Any]] = {}


def _twin_flags(class_name: str) -> dict[str, Any]:
    """The implementation keys of the installed ``torch.optim.<class_name>`` with their defaults
    (read once from an instance: torch 2.4's AdamW has no ``decoupled_weight_decay``, 2.7's has)."""
    flags = _TWIN_FLAGS.get(class_name)
    if flags is None:
        import torch

        probe = getattr(torch.optim, class_name)([torch.zeros(1, requires_grad=True)], lr=0.0)
        flags = _TWIN_FLAGS[class_name] = {k: probe.defaults[k] for k in IMPLEMENTATION_FLAGS if k in probe.defaults}
    return flags


@dataclass(frozen=True)
class OptimizerSpec:
    """Everything the rest of the package needs to know about one optimizer.

    ``name`` is the registry/CLI name; ``default_lr`` the constructor's
    default (None: required, as ONNX Momentum's ``R``); ``train_lr`` the rate
    ``dml-optim train`` uses on its built-in task (tuned for 1,000 steps of
    that small model, hence larger than the library default).
    """

    name: str
    title: str
    reference: str
    hyperparameters: tuple[Hyperparameter, ...]
    torch: TorchEquivalent
    default_lr: float | None
    train_lr: float
    #: ``(predicate(group), message)``: conditions between hyperparameters (a ``ValueError`` otherwise)
    constraints: tuple[tuple[Callable[[Mapping[str, Any]], bool], str], ...] = ()

    # -- hyperparameters ----------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Hyperparameter names, ``lr`` first."""
        return tuple(h.name for h in self.hyperparameters)

    def hyperparameter(self, name: str) -> Hyperparameter:
        for h in self.hyperparameters:
            if h.name == name:
                return h
        raise KeyError(f"{self.name} has no hyperparameter {name!r} (it has {', '.join(self.names)})")

    def defaults(self) -> dict[str, Any]:
        """Our defaults (``lr`` included when it has one)."""
        return {h.name: h.default for h in self.hyperparameters if h.default is not REQUIRED}

    def check(self, group: dict[str, Any]) -> None:
        """Check every hyperparameter of ``group`` and store it back as checked (floats stay floats)."""
        for h in self.hyperparameters:
            group[h.name] = h.check(group[h.name])
        for holds, message in self.constraints:
            if not holds(group):
                raise ValueError(f"{message} (got {', '.join(f'{h.name}={group[h.name]!r}' for h in self.hyperparameters if h.name in message)})")

    # -- torch.optim names ------------------------------------------------------------

    @property
    def torch_names(self) -> tuple[str, ...]:
        return tuple(a.torch for a in self.torch.aliases)

    def torch_values(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """torch's names for the hyperparameters of ``group`` (our names must be present)."""
        return {a.torch: a.to_torch(*(group[n] for n in a.ours)) for a in self.torch.aliases}

    def from_torch(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Our names for the torch keys present in ``values`` (``lr`` included)."""
        out: dict[str, Any] = {}
        for a in self.torch.aliases:
            if a.torch in values:
                try:
                    out.update(zip(a.ours, a.from_torch(values[a.torch])))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{a.torch} {exc}") from None
        if "lr" in values:
            out["lr"] = values["lr"]
        return out

    def torch_kwargs(self, hyper: Mapping[str, Any], *, exact: bool = True) -> dict[str, Any]:
        """Keyword arguments of the torch.optim twin of ``hyper`` (our names; defaults filled).

        ``exact``: raise ``ValueError`` naming the hyperparameter when the
        configuration has no exact torch.optim equivalent; otherwise the
        nearest twin (for side-by-side speed or accuracy comparisons).
        """
        if not self.torch.exists:
            raise ValueError(f"{self.name} has no torch.optim twin")
        full = {**self.defaults(), **hyper}
        for name, ok, reason in self.torch.requires + (self.torch.exact_when if exact else ()):
            if not ok(full):
                raise ValueError(f"{self.name}: {name}={full[name]!r} has no {'exact ' if exact else ''}torch.optim."
                                 f"{self.torch.class_name} equivalent ({reason})")
        kwargs = {"lr": full["lr"], **self.torch_values(full)}
        kwargs.update({name: full[name] for name in self.torch.same})
        kwargs.update({theirs: full[ours] for ours, theirs in self.torch.nearest.items()})
        return kwargs

    def from_torch_group(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """Our hyperparameters from a torch.optim param group (aliases, same-name keys, ``lr``)."""
        out = self.from_torch(saved)
        out.update({name: saved[name] for name in self.torch.same if name in saved})
        return out


def sync_group(spec: OptimizerSpec, group: dict[str, Any], previous: Mapping[str, tuple] | None,
               where: str) -> dict[str, tuple]:
    """Make our names and torch's agree in ``group`` (in place); return the new snapshot.

    ``previous`` is the snapshot returned by the last call for this group
    (``None`` for a new group).  For each alias:

    * new group: values given under one name fill the other; given under both,
      they must agree;
    * later: whichever side changed since ``previous`` is copied to the other;
      if both changed they must agree.

    A disagreement is a ``ValueError`` naming both keys and values.
    """
    snapshot: dict[str, tuple] = {}
    for alias in spec.torch.aliases:
        ours = tuple(group.get(n, _MISSING) for n in alias.ours)
        theirs = group.get(alias.torch, _MISSING)
        if isinstance(theirs, list):
            theirs = tuple(theirs)
        old = previous.get(alias.torch) if previous is not None else None
        ours_changed = old is None or not _same(ours, old[0])
        theirs_changed = theirs is not _MISSING and (old is None or not _same(theirs, old[1]))
        if old is None and _MISSING in ours:  # a new group that names only torch's key (or neither)
            ours_changed = False
        if theirs_changed:
            try:
                derived = alias.from_torch(theirs)
                derived = tuple(spec.hyperparameter(n).check(v) for n, v in zip(alias.ours, derived))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {alias.torch}={theirs!r}: {exc}") from None
            if ours_changed and _MISSING not in ours:
                try:
                    checked = tuple(spec.hyperparameter(n).check(v) for n, v in zip(alias.ours, ours))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{where}: {exc}") from None
                if not agree(alias, checked, theirs, derived):
                    mine = ", ".join(f"{n}={v!r}" for n, v in zip(alias.ours, ours))
                    raise ValueError(
                        f"{where}: {alias.torch}={theirs!r} and {mine} disagree "
                        f"({alias.torch} means {', '.join(alias.ours)} = {', '.join(map(repr, derived))}); "
                        "set one of the two names"
                    )
                derived = checked  # both given and consistent: each keeps the value it was given
            group.update(zip(alias.ours, derived))
            ours = derived
        elif _MISSING in ours:
            raise KeyError(f"{where}: missing hyperparameter(s) {', '.join(n for n, v in zip(alias.ours, ours) if v is _MISSING)}")
        else:
            try:  # our values are checked here too: to_torch must not meet a malformed one
                ours = tuple(spec.hyperparameter(n).check(v) for n, v in zip(alias.ours, ours))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from None
            theirs = alias.to_torch(*ours)
            group[alias.torch] = theirs
        snapshot[alias.torch] = (ours, theirs)
    return snapshot


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def agree(alias: TorchAlias, ours: tuple, theirs, derived: tuple) -> bool:
    """Whether our values ``ours`` and torch's ``theirs`` (read back as ``derived``) say the same thing.

    Exact equality in either direction, or floats within a few units in the
    last place of the values' scale (at least 1): converting through an
    arithmetic alias is not exact in floating point (torch's ``dampening =
    1 - beta`` read back gives ``1 - (1 - 0.1) = 0.09999999999999998``), and
    a value given consistently under both names must not be refused for it.
    """
    if _same(derived, ours):
        return True
    try:
        if _same(alias.to_torch(*ours), theirs):
            return True
    except (TypeError, ValueError):
        pass
    scale = max((abs(v) for v in (theirs if isinstance(theirs, tuple) else (theirs,))
                 if isinstance(v, (int, float)) and not isinstance(v, bool)), default=0.0)
    return len(derived) == len(ours) and all(_close(d, o, scale) for d, o in zip(derived, ours))


def _close(a, b, theirs_scale: float) -> bool:
    """Within 4 ulps of the largest magnitude involved, torch's value included: ``beta = 1 - dampening``
    read back loses ulps of ``dampening`` (absolute), while a one-to-one alias (``eps``/``epsilon``)
    loses nothing, so two small values that differ are refused."""
    if _same(a, b):
        return True
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return False
    scale = max(abs(a), abs(b), theirs_scale)
    return abs(a - b) <= 4 * sys.float_info.epsilon * scale


def _same(a, b) -> bool:
    """Equality that treats NaN == NaN and tolerates tensors (compares values)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        if a == b:
            return True
    except (TypeError, RuntimeError):
        return False
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
