"""Calling a compiled kernel without its dynamo frame (the compiled backend's steady call).

A kernel compiled through :class:`_Capture` keeps its one FX graph and inductor's callable; after its first
call, :func:`_make_direct` builds a :class:`_Direct` that calls inductor's callable with the graph's inputs
taken from the kernel's arguments, checked once against dynamo's call on probe operands.
"""

from __future__ import annotations

import torch

from dml_optim.core.update import MaskedKey

__all__ = ["DIRECT_CALLS"]

#: Call plain kernels without their dynamo frame once verified (:class:`_Direct`); False: always dynamo's call.
DIRECT_CALLS = True


def _direct_eligible(key) -> bool:
    """Plain step kernels (1-d operands of one length, 0-d counters and hyperparameters) may be called
    directly; masked and quantized ones (2-d operands, index tensors) always go through dynamo."""
    if isinstance(key, MaskedKey):
        return False
    return not any(isinstance(s, str) for s in key.storage) and key.storage[-1] is False


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

