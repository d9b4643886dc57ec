"""The one list of optimizers: names, classes, and their torch.optim twins.

Every command (``train``, ``audit``, ``bench``, ``compare``), the precision
harness and the tests find optimizers here; nothing else maps names to
classes.  What an optimizer *is* lives on its class (``cls.spec``, an
:class:`~dml_optim.optimizers.spec.OptimizerSpec`: hyperparameters and
ranges, default learning rates, the torch.optim twin in both directions);
this module only lists the classes and builds instances from names.

Adding an optimizer: write its module (a :class:`FlatOptimizer` subclass with
a ``spec``), add the class to :data:`OPTIMIZERS`, and add one entry to the
test matrix (``tests/matrix.py``).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from dml_optim.optimizers.adagrad import Adagrad
from dml_optim.optimizers.adam import Adam
from dml_optim.optimizers.adamw import AdamW
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.dml_adam import DmlAdam
from dml_optim.optimizers.lion import Lion
from dml_optim.optimizers.momentum import Momentum
from dml_optim.optimizers.sgd import SGD
from dml_optim.optimizers.spec import OptimizerSpec

__all__ = ["OPTIMIZERS", "NAMES", "get", "spec", "name_of", "build", "torch_equivalent", "check_hyperparameters", "lr_for",
           "epsilon_name", "ours_for_torch"]

#: Registry name → class, in the order the CLI and the docs list them.
OPTIMIZERS: dict[str, type[FlatOptimizer]] = {cls.spec.name: cls for cls in (Adam, DmlAdam, AdamW, Adagrad, Momentum, SGD,
                                                                            Lion)}
#: The registry names (the CLI's ``--optimizer`` choices).
NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def get(name: str) -> type[FlatOptimizer]:
    """The class registered as ``name``; ``ValueError`` listing the names otherwise."""
    try:
        return OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"optimizer name must be one of {', '.join(NAMES)}, got {name!r}") from None


def spec(name: str) -> OptimizerSpec:
    """The :class:`OptimizerSpec` of ``name``."""
    return get(name).spec


def name_of(optimizer) -> str:
    """The registry name of an optimizer class or instance."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for name, registered in OPTIMIZERS.items():
        if issubclass(cls, registered):
            return name
    raise ValueError(f"{cls.__name__} is not a registered dml_optim optimizer ({', '.join(NAMES)})")


def ours_for_torch(name: str, key: str) -> tuple[str, ...]:
    """Our hyperparameter names for torch.optim's ``key`` in ``name``'s spec (empty when it has none)."""
    twin = spec(name).torch
    for alias in twin.aliases:
        if alias.torch == key:
            return alias.ours
    if key in twin.same:
        return (key,)
    return tuple(ours for ours, theirs in twin.nearest.items() if theirs == key)


def epsilon_name(name: str) -> str | None:
    """The name of ``name``'s epsilon (the hyperparameter torch.optim calls ``eps``), or None (Momentum)."""
    names = ours_for_torch(name, "eps")
    return names[0] if names else None


def check_hyperparameters(name: str, hyper: dict[str, Any]) -> None:
    """``TypeError`` for hyperparameter names ``name`` does not have (our names)."""
    unknown = sorted(set(hyper) - set(spec(name).names))
    if unknown:
        raise TypeError(f"{name}: unknown hyperparameter(s) {', '.join(unknown)} (expected some of {', '.join(spec(name).names)})")


def lr_for(name: str) -> float:
    """The learning rate tools use when none is given: the class default (ONNX Momentum has none: 1e-2)."""
    return spec(name).default_lr if spec(name).default_lr is not None else 1e-2


def _constructor_kwargs(cls: type[FlatOptimizer], hyper: dict[str, Any]) -> dict[str, Any]:
    """``hyper`` (our names) as ``cls``'s constructor takes it (AdamW takes ``betas``, not ``beta1``/``beta2``)."""
    params = inspect.signature(cls).parameters
    out = {k: v for k, v in hyper.items() if k in params}
    for alias in cls.spec.torch.aliases:
        missing = [n for n in alias.ours if n not in params]
        if missing and any(n in hyper for n in alias.ours):
            defaults = cls.spec.defaults()
            out[alias.torch] = alias.to_torch(*(hyper.get(n, defaults[n]) for n in alias.ours))
    return out


def build(name: str, params: Iterable, **hyper_and_options) -> FlatOptimizer:
    """A ``name`` optimizer over ``params``; hyperparameters in our names (``lr`` defaults to :func:`lr_for`),
    options (``backend=``, ``master_weights=``, ...) as the class takes them."""
    cls = get(name)
    hyper = {k: v for k, v in hyper_and_options.items() if k in cls.spec.names}
    options = {k: v for k, v in hyper_and_options.items() if k not in cls.spec.names}
    hyper.setdefault("lr", lr_for(name))
    return cls(params, **_constructor_kwargs(cls, hyper), **options)


def torch_equivalent(name: str, params: Iterable, *, exact: bool = False, foreach: bool | None = True,
                     fused: bool | None = None, **hyper) -> torch.optim.Optimizer:
    """The torch.optim optimizer matching ``name`` with ``hyper`` (our names; defaults ours).

    ``exact=True`` refuses configurations the twin computes differently
    (ONNX/DirectML Adam with ``epsilon > 0``: epsilon is placed differently);
    otherwise the nearest twin, for side-by-side comparisons.  ``foreach=True``
    is what torch 2.4 picks on a DirectML (``privateuseone``) device.
    """
    check_hyperparameters(name, hyper)
    s = spec(name)
    hyper = dict(hyper)
    hyper.setdefault("lr", lr_for(name))
    kwargs = s.torch_kwargs(hyper, exact=exact)
    return s.torch.torch_class(params, **kwargs, foreach=foreach, fused=fused)
