"""The loops people run: a training loop's optimizer work, beside torch.optim's fused step, and DirectML's path.

**CPU rows** (``loops``): AdamW over three models, each in three loops, ``dml_optim`` (the default backend)
beside ``torch.optim.AdamW(fused=True)``, each candidate on its own copy of the parameters, timed
round-robin (:func:`~dml_optim.benchmark.timing.round_robin`), one thread.  An iteration is what a training
loop does around ``backward()``, with the backward's gradients simulated identically for both (one
``torch._foreach`` op):

* ``plain``: ``zero_grad()`` (``set_to_none=False``: dml_optim's default; gradients accumulate in place),
  the gradients added, ``step()``; constant lr;
* ``lambdalr``: the same, and ``LambdaLR`` changing lr every step (warm-up and cosine schedules do);
* ``none+lambdalr``: ``zero_grad(set_to_none=True)`` (accelerate, transformers' Trainer), fresh gradient
  tensors every step, ``LambdaLR``.

Models: ``gpt`` (the 30 tensors of a two-layer byte-level GPT, 0.46M parameters), ``many-small`` (1,000
tensors of 256 elements), ``few-large`` (4 tensors of 256k elements).  A record per (model, loop):
each candidate's ``ms_per_step`` (median), ``round_ms`` (each round's sample) and the target's value
``ratio_fused_to_ours`` (torch fused's time over ours, round by round: :func:`~dml_optim.benchmark.timing.paired_ratio`)
with its quartiles (``spread``); the target: at least :data:`VS_FUSED_LIMIT`.

**DirectML's path** (``loops_eager``): ``backend="eager"`` on the CPU, tensors of 16 elements (the
arithmetic is negligible: this is host time per step, what DirectML's dispatch pays on top of its kernels),
AdamW: a steady step of one tensor beside ``torch.optim.AdamW(foreach=False)``'s (its for-loop step) on one
tensor (at most :data:`EAGER_VS_FORLOOP_LIMIT`), a step whose lr changed beside a steady one (at most
:data:`EAGER_LR_CHANGE_LIMIT`), 2,000 tensors beside one (at most :data:`EAGER_MANY_LIMIT`, default checks), and,
for information, the same with ``checks="refs"`` (the default ``"full"`` reads every parameter's ``.grad`` and
data pointer, about 0.1 us each in C: at 2,000 tensors those reads cost several steps of one tensor) and the floor of
any exact default: those reads alone (one ``.grad`` and one ``data_ptr()`` per parameter, two C-level passes, timed
in the same rounds), added to the ``"refs"`` step, over one tensor (``ratio_many_floor``).
Then, for information (the record's ``loops``), the three loops on DirectML's path with a real ``backward()``
(:func:`measure_eager_backward_loops`: the same models' tensor counts, 16 elements each, so the iteration's time
is host time; the hooks that move fresh gradients into the flat buffer run inside ``backward()``), beside torch
fused and torch's for-loop AdamW.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from dml_optim.benchmark.timing import paired_ratio, round_robin, wall_seconds

__all__ = ["MODELS", "LOOPS", "VS_FUSED_LIMIT", "EAGER_VS_FORLOOP_LIMIT", "EAGER_LR_CHANGE_LIMIT", "EAGER_MANY_LIMIT",
           "model_shapes", "measure_loops", "measure_eager_loops", "measure_eager_backward_loops", "loop_targets"]

_GRAD = operator.attrgetter("grad")

#: torch fused's iteration time over dml_optim's, at least (every CPU loop row).
VS_FUSED_LIMIT = 1.0
#: DirectML's path: a steady eager step of one tensor over torch.optim's for-loop AdamW step, at most.
EAGER_VS_FORLOOP_LIMIT = 1.2
#: ... a step whose lr changed over a steady one, at most.
EAGER_LR_CHANGE_LIMIT = 1.2
#: ... 2,000 tensors over one, at most (default checks).
EAGER_MANY_LIMIT = 3.0

LOOPS = ("plain", "lambdalr", "none+lambdalr")


def _gpt_shapes(vocab: int = 256, d: int = 128, context: int = 128, layers: int = 2) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,), (vocab, d), (vocab,)]


MODELS: dict[str, Callable[[bool], list[tuple[int, ...]]]] = {
    "gpt": lambda quick: _gpt_shapes(d=32 if quick else 128),
    "many-small": lambda quick: [(256,)] * (100 if quick else 1000),
    "few-large": lambda quick: [(1 << (12 if quick else 18),)] * 4,
}


def model_shapes(name: str, quick: bool = False) -> list[tuple[int, ...]]:
    """The parameter shapes of loop model ``name``."""
    return MODELS[name](quick)


class _Loop:
    """One candidate's training loop: its parameters, optimizer, scheduler and gradients, simulated or (``backward``)
    made by a real ``backward()`` of ``sum((p * g).sum())``, whose gradients are the same ``grads``; ``backend``:
    dml_optim's (None: the default)."""

    def __init__(self, candidate: str, shapes, loop: str, values: list, grads: list, backend: str | None = None,
                 backward: bool = False):
        import dml_optim

        self.params = [torch.nn.Parameter(v.clone()) for v in values]
        self.grads = grads
        self.none = loop.startswith("none")
        self.backward = backward
        if candidate == "torch fused":
            self.opt = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01, fused=True)
        elif candidate == "torch for-loop":
            self.opt = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01, foreach=False)
        else:
            self.opt = dml_optim.AdamW(self.params, lr=1e-3, weight_decay=0.01, **({"backend": backend} if backend else {}))
        self.sched = (torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 1e-3 * s))
                      if "lambdalr" in loop else None)

    def step(self) -> None:
        opt = self.opt
        opt.zero_grad(set_to_none=self.none)
        if self.backward:  # (autograd: fresh gradients after set_to_none, else accumulated where they are)
            sum((p * g).sum() for p, g in zip(self.params, self.grads)).backward()
        elif self.none:  # (backward: fresh gradient tensors)
            for p, g in zip(self.params, torch._foreach_mul(self.grads, 1.0)):
                p.grad = g
        else:  # (backward: accumulated into the gradients that stay)
            held = [p.grad for p in self.params]
            if held[0] is None:
                for p, g in zip(self.params, self.grads):
                    p.grad = g.clone()
            else:
                torch._foreach_add_(held, self.grads)
        opt.step()
        if self.sched is not None:
            self.sched.step()


def _values(shapes, seed: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * scale for s in shapes]


def _row(name: str, t: dict) -> dict[str, Any]:
    return {"candidate": name, "ms_per_step": t["seconds"] * 1e3, "ms_min": t["min_seconds"] * 1e3,
            "ms_max": t["max_seconds"] * 1e3, "samples": t["samples"], "inner_steps": t["inner"],
            "round_ms": [x * 1e3 for x in t["round_seconds"]]}


def _ratio(rows: dict, numerator: str, denominator: str) -> tuple[float, list[float]]:
    median, q1, q3 = paired_ratio(rows[numerator]["round_ms"], rows[denominator]["round_ms"])
    return median, [q1, q3]


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def measure_loops(model: str, settings: dict, log: Callable[[str], None], *, quick: bool = False) -> list[dict]:
    """The CPU loop records of ``model`` (one per loop of :data:`LOOPS`; see the module docstring)."""
    shapes = model_shapes(model, quick)
    values, grads = _values(shapes, 0, 0.1), _values(shapes, 7, 1e-2)
    records = []
    for loop in LOOPS:
        rows = _measure_loop(shapes, loop, values, grads, ("dml_optim", "torch fused"), settings)
        ratio, spread = _ratio(rows, "torch fused", "dml_optim")
        record = {"optimizer": "adamw", "workload": f"{model} {loop}", "model": model, "loop": loop, "tensors": len(shapes),
                  "parameters": sum(math.prod(s) for s in shapes), "vs_fused_limit": VS_FUSED_LIMIT,
                  "ratio_fused_to_ours": ratio, "spread_fused_to_ours": spread, "rows": list(rows.values())}
        log(f"  loops {model:10} {loop:14} dml_optim {rows['dml_optim']['ms_per_step']:.3f} ms, torch fused "
            f"{rows['torch fused']['ms_per_step']:.3f} ms: {ratio:.2f}x [{spread[0]:.2f}, {spread[1]:.2f}]")
        records.append(record)
    return records


def _measure_loop(shapes, loop: str, values: list, grads: list, names: tuple[str, ...], settings: dict,
                  backend: str | None = None, backward: bool = False) -> dict[str, dict]:
    """Each candidate of ``names`` in ``loop`` (:class:`_Loop`), timed round-robin on one thread: its row."""
    def measure():
        loops = {name: _Loop(name, shapes, loop, values, grads, backend, backward) for name in names}
        for stepper in loops.values():
            for _ in range(3):
                stepper.step()
        return round_robin({k: s.step for k, s in loops.items()},
                           lambda fn, inner: wall_seconds(fn, torch.device("cpu"), inner), settings)

    return {k: _row(k, t) for k, t in _one_thread(measure).items()}


def measure_eager_backward_loops(settings: dict, log: Callable[[str], None], *,
                                 quick: bool = False) -> list[dict[str, Any]]:
    """DirectML's path in the loops people run, a real ``backward()`` each iteration (the post-accumulate-grad
    hooks move fresh gradients into the flat buffer there): each model of :data:`MODELS` with as many tensors of
    16 elements (host time), each loop of :data:`LOOPS`, ``backend="eager"`` beside torch fused and torch's
    for-loop AdamW (what DirectML can run); the iteration's time, ratios round by round with their quartiles."""
    records = []
    for model in MODELS:
        shapes = [(16,)] * len(model_shapes(model, quick))
        values, grads = _values(shapes, 0, 0.1), _values(shapes, 7, 1e-2)
        for loop in LOOPS:
            rows = _measure_loop(shapes, loop, values, grads, ("dml_optim", "torch fused", "torch for-loop"), settings,
                                 backend="eager", backward=True)
            fused, fused_spread = _ratio(rows, "torch fused", "dml_optim")
            forloop, forloop_spread = _ratio(rows, "torch for-loop", "dml_optim")
            records.append({"model": model, "loop": loop, "tensors": len(shapes), "elements_per_tensor": 16,
                            "ratio_fused_to_ours": fused, "spread_fused_to_ours": fused_spread,
                            "ratio_forloop_to_ours": forloop, "spread_forloop_to_ours": forloop_spread,
                            "rows": list(rows.values())})
            log(f"  loops eager {model:10} {loop:14} (backward) dml_optim {rows['dml_optim']['ms_per_step']:.3f} ms, "
                f"torch fused {fused:.2f}x, torch for-loop {forloop:.2f}x ours")
    return records


class _Reads:
    """The reads an exact binding check of ``params`` cannot do without, alone: each parameter's ``.grad`` and
    ``data_ptr()``, in two C-level passes (``checks="full"`` makes them beside its O(1) storage counts)."""

    def __init__(self, params: list):
        self.params = params

    def step(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # (as the check reads them: no __torch_function__ lookup)
            list(map(_GRAD, self.params))
            list(map(torch.Tensor.data_ptr, self.params))


class _Eager:
    """A steady AdamW step on DirectML's path (``backend="eager"``) or torch.optim's for-loop step, over
    ``n`` tensors of 16 elements; ``lr_change``: a new lr before every step."""

    def __init__(self, kind: str, n: int, lr_change: bool = False, checks: str = "full", device=None):
        import dml_optim

        gen = torch.Generator().manual_seed(n)
        self.params = [torch.nn.Parameter(torch.randn(16, generator=gen).to(device or "cpu")) for _ in range(n)]
        for p in self.params:
            p.grad = (torch.randn(16, generator=gen) * 1e-2).to(device or "cpu")
        if kind == "torch for-loop":
            self.opt = torch.optim.AdamW(self.params, lr=1e-3, foreach=False)
        else:
            self.opt = dml_optim.AdamW(self.params, lr=1e-3, backend="eager", checks=checks)
        self.group = self.opt.param_groups[0]
        self.k = 0
        self.step = self._changing if lr_change else self.opt.step

    def _changing(self) -> None:
        self.k += 1
        self.group["lr"] = 1e-3 / (1.0 + 1e-3 * (self.k & 1023))
        self.opt.step()


def measure_eager_loops(settings: dict, log: Callable[[str], None], *, quick: bool = False,
                        loop_settings: dict | None = None) -> dict[str, Any]:
    """DirectML's path, host time per step (see the module docstring): one record with every candidate's row
    and the three ratios with their quartiles; ``loops``: :func:`measure_eager_backward_loops` (sampled with
    ``loop_settings``; None: ``settings``)."""
    many = 200 if quick else 2000
    candidates = {"eager, 1 tensor": ("eager", 1, False), "eager, 1 tensor, lr changing": ("eager", 1, True),
                  f"eager, {many} tensors": ("eager", many, False),
                  f"eager, {many} tensors, lr changing": ("eager", many, True),
                  f"eager, {many} tensors, checks=refs": ("eager", many, False, "refs"),
                  "torch for-loop, 1 tensor": ("torch for-loop", 1, False)}

    from dml_optim import standin

    on_standin, why_not = standin.available(load=True)
    if on_standin:  # (DirectML's semantics: no storage, so the binding checks read storage offsets)
        dev = standin.device()
        candidates.update({"stand-in, 1 tensor": ("eager", 1, False, "full", dev),
                           f"stand-in, {many} tensors": ("eager", many, False, "full", dev)})

    def measure():
        steppers = {name: _Eager(*args) for name, args in candidates.items()}
        steppers[f"reads of an exact check, {many} tensors"] = _Reads(steppers[f"eager, {many} tensors"].params)
        for s in steppers.values():
            for _ in range(20):
                s.step()
        return round_robin({k: s.step for k, s in steppers.items()},
                           lambda fn, inner: wall_seconds(fn, torch.device("cpu"), inner), settings)

    timed = _one_thread(measure)
    rows = {k: _row(k, t) for k, t in timed.items()}
    vs_loop, vs_loop_spread = _ratio(rows, "eager, 1 tensor", "torch for-loop, 1 tensor")
    lr_change, lr_spread = _ratio(rows, "eager, 1 tensor, lr changing", "eager, 1 tensor")
    many_ratio, many_spread = _ratio(rows, f"eager, {many} tensors", "eager, 1 tensor")
    refs_ratio, refs_spread = _ratio(rows, f"eager, {many} tensors, checks=refs", "eager, 1 tensor")
    floor_ratio, *floor_spread = paired_ratio(  # (round by round: the refs step and the reads, over one tensor)
        list(map(operator.add, rows[f"eager, {many} tensors, checks=refs"]["round_ms"],
                 rows[f"reads of an exact check, {many} tensors"]["round_ms"])), rows["eager, 1 tensor"]["round_ms"])
    record = {"optimizer": "adamw", "workload": "eager", "tensors_many": many, "elements_per_tensor": 16,
              "ratio_to_forloop": vs_loop, "spread_to_forloop": vs_loop_spread, "forloop_limit": EAGER_VS_FORLOOP_LIMIT,
              "ratio_lr_change": lr_change, "spread_lr_change": lr_spread, "lr_change_limit": EAGER_LR_CHANGE_LIMIT,
              "ratio_many": many_ratio, "spread_many": many_spread, "many_limit": EAGER_MANY_LIMIT,
              "ratio_many_refs": refs_ratio, "spread_many_refs": refs_spread,
              "ratio_many_floor": floor_ratio, "spread_many_floor": floor_spread,
              "rows": list(rows.values()),
              "loops": measure_eager_backward_loops(loop_settings or settings, log, quick=quick)}
    if on_standin:  # the host time of a step on the stand-in DirectML device (its dispatcher, not DirectML's)
        record["ratio_many_standin"], record["spread_many_standin"] = _ratio(
            rows, f"stand-in, {many} tensors", "stand-in, 1 tensor")
        record["ratio_standin_to_cpu"], record["spread_standin_to_cpu"] = _ratio(
            rows, "stand-in, 1 tensor", "eager, 1 tensor")
    else:
        record["standin"] = f"not measured: the stand-in DirectML device is unavailable here ({why_not})"
    log("  loops eager (host us per step): " + ", ".join(f"{k} {r['ms_per_step'] * 1e3:.1f}" for k, r in rows.items()))
    log(f"  loops eager: 1 tensor / torch for-loop {vs_loop:.2f}x, lr changing / steady {lr_change:.2f}x, "
        f"{many} / 1 tensors {many_ratio:.2f}x ({refs_ratio:.2f}x with checks='refs', {floor_ratio:.2f}x with 'refs' "
        "and the reads of an exact check)")
    return record


def loop_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of ``doc``'s loop records: ``(name, required, op, measured, spread)`` each as a dict."""
    out = []

    def add(name, required, op, value, spread, rec, row="loops"):
        ok = value >= required if op == ">=" else value <= required
        out.append({"target": name, "required": required, "op": op, "unit": "x", "measured": value,
                    "spread": spread, "pass": ok, "status": "PASS" if ok else "MISS", "row": row,
                    "optimizer": rec["optimizer"], "workload": rec["workload"]})

    for rec in doc.get("loops", []):
        add(f"loop {rec['model']} {rec['loop']}: >= {rec['vs_fused_limit']:.1f}x torch fused", rec["vs_fused_limit"],
            ">=", rec["ratio_fused_to_ours"], rec["spread_fused_to_ours"], rec)
    for rec in doc.get("loops_eager", []):
        add(f"eager steady step, 1 tensor: <= {rec['forloop_limit']:.1f}x torch's for-loop AdamW", rec["forloop_limit"],
            "<=", rec["ratio_to_forloop"], rec["spread_to_forloop"], rec, "loops_eager")
        add(f"eager step with a new lr: <= {rec['lr_change_limit']:.1f}x a steady step", rec["lr_change_limit"], "<=",
            rec["ratio_lr_change"], rec["spread_lr_change"], rec, "loops_eager")
        add(f"eager steady step, {rec['tensors_many']} tensors: <= {rec['many_limit']:.1f}x one tensor",
            rec["many_limit"], "<=", rec["ratio_many"], rec["spread_many"], rec, "loops_eager")
    return out
