"""``dml-optim audit``: what one optimizer step dispatches on DirectML, ours beside torch.optim's.

A thin layer over :mod:`dml_optim.audit`: builds random parameters with the
shapes of a model inventory and random gradients, runs one warm-up step and
audits the next one, for the ``dml_optim`` optimizer and for its torch.optim
equivalent as torch 2.4 runs it on a DirectML device (``foreach=True``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys

from dml_optim.commands import UsageError

HELP = "count the aten ops, CPU fallbacks, host syncs, allocations and bytes moved of one step, ours vs torch.optim"

DESCRIPTION = """\
Record the aten ops of one optimizer step (after one warm-up step) and resolve
each with torch-directml 0.2.5's dispatch table: how many ops the step
dispatches on a DirectML device, which of them fall back to the CPU, how many
host synchronisations and new allocations it makes. The dml_optim optimizer is
printed beside its torch.optim equivalent with foreach=True, which is what
torch 2.4 uses on a DirectML (privateuseone) device:

  adam      dml_optim.Adam     vs torch.optim.Adam(betas=(alpha, beta))
  dml-adam  dml_optim.DmlAdam  vs torch.optim.Adam(betas=(beta1, beta2))
  adamw     dml_optim.AdamW    vs torch.optim.AdamW (the same signature)
  adagrad   dml_optim.Adagrad  vs torch.optim.Adagrad
  momentum  dml_optim.Momentum vs torch.optim.SGD(momentum=alpha, dampening=1-beta)
  sgd       dml_optim.SGD      vs torch.optim.SGD (the same signature)
  lion      dml_optim.Lion     alone (torch.optim has no Lion: its column shows dashes)

foreach ops count as one op per tensor (torch-directml has no foreach
kernels). Bytes moved: per op, each distinct tensor read and each tensor
written (an in-place op's tensor both, an out= tensor written only), per
parameter; "least" is what any step must move (parameters, gradients and
states read once, parameters and states written once). An op that falls back
to the CPU on DirectML copies its tensors to the host and back: its bytes
cross the bus too, so they are counted twice in "bytes incl. fallback round
trips". Scratch: what the optimizer keeps between steps beyond parameters,
gradients and states, laid out as on DirectML (chunks once a full-size scratch
would pass 32 MiB or 0.5 bytes per parameter); allocations: what the step
allocates while it runs. Reads of torch.optim's CPU step counters are reported apart from
host syncs: they are not device syncs on DirectML. The recording runs on the
CPU here; the resolution is the table's. Parameters and gradients are float32
on the CPU: a model of N parameters needs about 4*N bytes per copy (params,
grads, each state, scratch), one optimizer at a time (gpt2, 124M parameters:
~0.5 GB a copy; measured peak 2.7 GB and 90 s for --optimizer adam on a
2-core VM).
"""

EPILOG = """\
models: a built-in name (resnet50, gpt2, bert-base-uncased, vit-b-16, tiny-mlp,
many-small; many-small-N, one-Nk, one-Nm) or the path of an inventory JSON file.

examples:
  dml-optim audit --optimizer adam
  dml-optim audit --optimizer dml-adam --model resnet50
  dml-optim audit --optimizer adamw --model bert-base-uncased
  dml-optim audit --optimizer adamw --state-bits 8     # a low-bit step: still 0 fallbacks, 0 syncs
  dml-optim audit --optimizer momentum --model gpt2 --json
  dml-optim audit --optimizer adagrad --model my-model.json
  dml-optim audit --optimizer adamw --model resnet50 --clip

--clip audits gradient clipping instead of the step: dml_optim.clip_grad_norm_
over the optimizer's flat gradient buffers beside torch.nn.utils.clip_grad_norm_
(foreach=True, one _foreach_norm and one _foreach_mul_ element per tensor on
DirectML) on the same parameters.
"""


def add_parser(sub):
    from dml_optim.optimizers.registry import NAMES as OPTIMIZER_NAMES

    p = sub.add_parser("audit", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", required=True, choices=OPTIMIZER_NAMES, help="which optimizer to audit")
    p.add_argument("--model", metavar="MODEL", default="tiny-mlp",
                   help="a built-in model name or an inventory JSON path (default: tiny-mlp)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="ops listed per optimizer (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random parameters and gradients")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.add_argument("--state-bits", type=int, choices=(8, 4), default=None, dest="state_bits",
                   help="audit our step with 8-bit or 4-bit optimizer state (the torch.optim column stays FP32)")
    p.add_argument("--clip", action="store_true",
                   help="audit clip_grad_norm_(max_norm=1.0) instead of the step, ours vs torch.nn.utils'")
    p.add_argument("--training", action="store_true",
                   help="audit one training iteration of the main job's model (its forward and backward, then the "
                        "step) instead of a step over --model's shapes; on the stand-in DirectML device "
                        "(DML_OPTIM_STANDIN=1) the stand-in's own count of CPU fallbacks is printed beside the table's")
    p.set_defaults(run=run)
    return p


def _shapes(model: str) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    from dml_optim.inventory import resolve_model

    try:
        inv = resolve_model(model)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None
    if not inv.parameters:
        raise UsageError(f"--model: {model!r} lists no parameters")
    return inv.name, list(inv.parameters)


def _params(shapes, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).mul_(0.02))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    return params


def _audit(kind: str, name: str, shapes, seed: int, clip: bool = False, state_bits: int | None = None):
    import torch

    import dml_optim
    from dml_optim.audit import audit_call, audit_step
    from dml_optim.backends.eager import laid_out_as
    from dml_optim.optimizers.registry import build, torch_equivalent

    params = _params(shapes, seed)
    # ours: the eager op chain DirectML runs ("auto" may compile large buffers on CPU/CUDA, which the audit refuses),
    # its scratch laid out as on DirectML (chunks where a full-size scratch would pass the bound)
    opt = (build(name, params, backend="eager", state_bits=state_bits) if kind == "ours"
           else torch_equivalent(name, params, foreach=True))
    with laid_out_as("privateuseone"):
        opt.step()  # warm-up: states and scratch allocated, step counters past their first value
        if not clip:
            report = audit_step(opt)
        elif kind == "ours":
            report = audit_call(opt, lambda: dml_optim.clip_grad_norm_(opt, 1.0))
            report.optimizer = "dml_optim.clip_grad_norm_"
        else:
            report = audit_call(opt, lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))
            report.optimizer = "torch.nn.utils.clip_grad_norm_"
    opt = params = None  # noqa: F841 - released before the next optimizer is built
    gc.collect()
    return report


#: From this many parameters on, the audit takes seconds (resnet50: ~10 s on 2 cores) and shows progress.
_PROGRESS_MIN_PARAMETERS = 1_000_000


def _row(label: str, a, b) -> str:
    return f"  {label:<34} {str(a):>16} {str(b):>22}"


def _per(report, n: int) -> str:
    return "-" if isinstance(report, _NoTwin) else f"{report.per_param(n):.2f}"


def _training(kind: str, name: str, seed: int, state_bits: int | None) -> dict:
    """One training iteration of the main job's MLP (forward, loss, backward; then the step), after one warm-up
    iteration, recorded on :func:`dml_optim.devices.device` (the stand-in under ``DML_OPTIM_STANDIN=1``):
    ``{"forward_backward": report, "step": report, "device": str, "standin": counts or None}``."""
    import torch

    from dml_optim.audit import audit_call, audit_step
    from dml_optim.backends.eager import laid_out_as
    from dml_optim.devices import device as best_device, fallback_counter
    from dml_optim.job import toy
    from dml_optim.optimizers.registry import build, torch_equivalent

    dev = best_device()
    model = toy.make_model(seed, toy.HIDDEN, device=dev)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, toy.NUM_FEATURES, generator=g).to(dev)
    y = torch.randint(0, toy.NUM_CLASSES, (128,), generator=g).to(dev)
    params = list(model.parameters())
    opt = (build(name, params, backend="eager", state_bits=state_bits) if kind == "ours"
           else torch_equivalent(name, params, foreach=True))

    def forward_backward():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    with laid_out_as("privateuseone"):
        forward_backward()
        opt.step()  # (warm-up: states allocated)
        counting = fallback_counter(dev)
        fb = audit_call(opt, forward_backward)
        fb.optimizer = f"forward + backward ({opt.__class__.__module__.split('.')[0]}.{type(opt).__name__})"
        step = audit_step(opt)
        counted = counting() if counting is not None else None
    return {"forward_backward": fb, "step": step, "device": str(dev), "standin": counted}


def _kinds(name: str) -> tuple[str, ...]:
    """``("ours", "torch")``, or ``("ours",)`` for an optimizer torch.optim has no twin of (Lion)."""
    from dml_optim.optimizers.registry import spec

    return ("ours", "torch") if spec(name).torch.exists else ("ours",)


class _NoTwin:
    """The torch column of an optimizer without a torch.optim twin: every figure a dash."""

    def __init__(self, name: str):
        self.optimizer = f"(no torch.optim {name})"

    def __getattr__(self, name):
        return "-"



def _run_training(args) -> int:
    runs = {kind: _training(kind, args.optimizer, args.seed, args.state_bits) for kind in _kinds(args.optimizer)}
    if args.json:
        print(json.dumps({"model": "the main job's MLP", "optimizer": args.optimizer, "state_bits": args.state_bits,
                          "audited": "training iteration", "device": runs["ours"]["device"],
                          **{kind: {"forward_backward": r["forward_backward"].to_dict(), "step": r["step"].to_dict(),
                                    "standin_fallbacks": r["standin"]} for kind, r in runs.items()}}, indent=2))
        return 0
    ours = runs["ours"]
    theirs = runs.get("torch") or {"step": _NoTwin(args.optimizer), "forward_backward": _NoTwin(args.optimizer),
                                   "standin": None}
    print(f"dml-optim audit --training: {args.optimizer} on the main job's MLP, on {ours['device']}; per training "
          "iteration (forward, backward, step), as torch-directml 0.2.5 would run it (one warm-up iteration first):")
    print(_row("", ours["step"].optimizer, theirs["step"].optimizer))
    for phase, label in (("forward_backward", "forward+backward"), ("step", "step")):
        a, b = ours[phase], theirs[phase]
        print(_row(f"{label}: aten ops", a.total_ops, b.total_ops))
        print(_row(f"{label}: CPU fallbacks", a.fallback_ops, b.fallback_ops))
        print(_row(f"{label}: host syncs", a.host_syncs, b.host_syncs))
    if ours["standin"] is not None:
        total = [sum(r["standin"].values()) if r["standin"] is not None else "-" for r in (ours, theirs)]
        print(_row("CPU fallbacks the stand-in ran", total[0], total[1]))
    for kind, r in runs.items():
        for phase in ("forward_backward", "step"):
            for op, n in r[phase].fallbacks:
                print(f"  {r['step'].optimizer if phase == 'step' else 'forward + backward'}: fallback {op} x{n}")
        if r["standin"]:
            print(f"  {r['step'].optimizer}, counted by the stand-in: "
                  + ", ".join(f"{op} x{n}" for op, n in sorted(r["standin"].items())))
    return 0


def run(args) -> int:
    from dml_optim.console import Progress

    if args.top < 0:
        raise UsageError(f"--top: must be >= 0, got {args.top}")
    if args.training:
        if args.clip:
            raise UsageError("--training: audits the step of a training iteration; --clip audits clipping alone")
        return _run_training(args)
    model, shapes = _shapes(args.model)
    numel = sum(math.prod(s) for _, s in shapes)
    stream = sys.stderr if args.json else sys.stdout  # with --json, stdout carries only the JSON
    slow = numel >= _PROGRESS_MIN_PARAMETERS
    if slow or not args.json:
        bits = f", {args.state_bits}-bit state" if args.state_bits else ""
        print(f"dml-optim audit: {args.optimizer}{bits} on {model} ({len(shapes)} tensors, {numel:,} parameters; "
              f"float32 on cpu, ~{4 * numel / 2**30:.2f} GiB per copy)", file=stream, flush=True)
    kinds = _kinds(args.optimizer)
    progress = Progress("audit", len(kinds), stream=stream, unit="optimizer") if slow else None
    reports = []
    for kind in kinds:
        reports.append(_audit(kind, args.optimizer, shapes, args.seed, args.clip, args.state_bits))
        if progress is not None:
            progress.update(len(reports), f"{reports[-1].optimizer}: {reports[-1].total_ops} ops")
    if progress is not None:
        progress.close()
    ours, theirs = reports[0], (reports[1] if len(reports) > 1 else None)
    if args.json:
        print(json.dumps({"model": model, "tensors": len(shapes), "parameters": numel,
                          "optimizer": args.optimizer, "state_bits": args.state_bits,
                          "audited": "clip_grad_norm_" if args.clip else "step", "ours": ours.to_dict(),
                          "torch": None if theirs is None else theirs.to_dict()}, indent=2))
        return 0
    if theirs is None:
        theirs = _NoTwin(args.optimizer)
    what = "per clip_grad_norm_ call" if args.clip else "per step"
    print(f"{what}, as torch-directml 0.2.5 would run it (one warm-up step first):")
    print(_row("", ours.optimizer, theirs.optimizer))
    print(_row("aten ops dispatched", ours.total_ops, theirs.total_ops))
    print(_row("flat buffers / tensors", ours.flat_buffers, theirs.flat_buffers))
    print(_row("CPU fallbacks on DirectML (calls)", ours.fallback_ops, theirs.fallback_ops))
    print(_row("host syncs", ours.host_syncs, theirs.host_syncs))
    print(_row("CPU step-counter reads (no sync)", ours.cpu_step_reads, theirs.cpu_step_reads))
    print(_row("allocations", ours.allocations, theirs.allocations))
    print(_row("allocated during the step (B/param)", _per(ours, ours.allocated_bytes),
               _per(theirs, theirs.allocated_bytes)))
    print(_row("scratch kept between steps (B/param)", _per(ours, ours.scratch_bytes),
               _per(theirs, theirs.scratch_bytes)))
    print(_row("bytes moved per parameter", _per(ours, ours.bytes_moved), _per(theirs, theirs.bytes_moved)))
    print(_row("  incl. fallback round trips", _per(ours, ours.bytes_with_fallbacks),
               _per(theirs, theirs.bytes_with_fallbacks)))
    print(_row("  least any step moves", _per(ours, ours.least_bytes), _per(theirs, theirs.least_bytes)))
    print(_row("every op native on DirectML", "yes" if ours.all_native else "no",
               "-" if isinstance(theirs, _NoTwin) else "yes" if theirs.all_native else "no"))
    for report in reports:
        print()
        print(f"top ops of {report.optimizer}:")
        print("  count  op                               DirectML resolution")
        for op, n, how in report.ops[: args.top]:
            print(f"  {n:>5}  {op:<32} {how}")
        if len(report.ops) > args.top:
            print(f"  ... {len(report.ops) - args.top} more")
        for op, n in report.fallbacks:
            print(f"  fallback: {op} x{n} (copied to the CPU and back each step)")
        if report.fallback_bus_bytes:
            print(f"  the fallbacks' {report.per_param(report.fallback_bus_bytes):.2f} bytes per parameter cross the "
                  "bus as well as the device's memory: counted twice")
    return 0
