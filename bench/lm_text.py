"""A small byte-level language model on real text: held-out loss of low-bit AdamW against FP32 AdamW.

The text is Python's own standard library source (a fixed list of modules read
from this interpreter's ``stdlib``: real, varied text, shipped with every
Python, nothing downloaded); the last tenth is held out.  The model is a
2-layer causal transformer over bytes (d=64, 4 heads, context 64, about
0.11M parameters, every matrix >= 4096 elements so its states are quantized;
small enough for a 2-core CPU).  Every optimizer trains the same initial model
on the same batches (``--steps``, default 400, batch 16) per seed; the held-out loss is
the mean cross-entropy (nats per byte) over fixed held-out windows.

Candidates: ``torch.optim.AdamW`` (FP32, the reference), ``dml_optim.AdamW`` FP32,
``state_bits=8`` and ``4`` (each backend given by ``--backend``), and where
installed bitsandbytes ``AdamW8bit`` and torchao ``AdamW8bit``/``AdamW4bit``.

    .venv/bin/python bench/lm_text.py --seeds 0 1 --out bench/results/lm-text-<date>.json

``--codebook dml-optim-blockwise-2`` makes dml_optim's low-bit states in an earlier codebook, to compare
codebooks on the same batches (the JSON records the codebook).

Bars (issue 34): 8-bit within 0.25% and 4-bit within 0.75% of FP32's held-out
loss (mean over seeds).  This is a bench row, not a timed test.

``--preset lean`` (issue 49): the lean configurations beside FP32 AdamW (torch's and ours) on the same
batches, the model d=128, batch 32, 400 steps, lr 3e-3 with a linear warm-up over the first 10% and a cosine
decay to 10%, 2 seeds, the FP32 rows with global-norm clipping at 1.0 after backward (as issue 49 measured them):
float16 parameters with stochastic rounding, 8-bit or 4-bit state, the step inside backward and dynamic loss
scaling inside it (what DirectML runs), and the same in bfloat16 (not on DirectML: it has no bfloat16) and in
float16 without loss scaling, for reference; each lean row unclipped and "clipped by the previous norm" (at
``--clip``, inside backward: ``step_in_backward(opt, max_norm=..., clip_by="previous_norm")``, each backward's
gradients clipped by the previous backward's total norm, the first not clipped).  Bars: float16 8-bit within
1.0% of FP32's held-out loss, 4-bit within 1.5%.

    .venv/bin/python bench/lm_text.py --preset lean --out bench/results/lm-text-lean-<date>.json

Diagnostic rows, run only when named with ``--only``: the float16 8-bit configuration clipped by the current
norm after backward (``scaler.unscale_``, ``dml_optim.clip_grad_norm_``, ``scaler.step``: what the staleness
costs), FP32 clipped by the previous norm inside backward (the staleness alone) and float16 with 32-bit state
clipped by the previous norm (the 8-bit state's share).  Each clipped run records its gradient norms: the first,
the mean and the fraction of steps above ``--clip``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

MODULES = ["argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py", "collections/__init__.py",
           "pathlib.py", "subprocess.py", "tarfile.py", "zipfile.py", "datetime.py", "enum.py", "ast.py",
           "textwrap.py", "logging/__init__.py", "email/message.py", "http/client.py", "json/decoder.py",
           "unittest/case.py", "string.py", "difflib.py", "pprint.py", "shutil.py", "tempfile.py"]
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def corpus() -> tuple[torch.Tensor, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, used = [], []
    for name in MODULES:
        path = root / name
        if path.is_file():
            parts.append(path.read_bytes())
            used.append(name)
    data = b"\n".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), used


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, d=64, heads=4, layers=2, ctx=64):  # noqa: D107
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.emb(idx) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


#: The lean configurations (issue 49): name -> (parameter dtype, state bits, loss scaling, clipping).  Clipping:
#: None, "previous" (inside backward, by the previous backward's norm) or "after" (after backward, by the current
#: norm: the step is then not inside backward).  Parameters below float32 round stochastically.
LEAN = {"dml_optim fp16 SR 8-bit in-backward scaled": (torch.float16, 8, True, None),
        "dml_optim fp16 SR 4-bit in-backward scaled": (torch.float16, 4, True, None),
        "dml_optim fp16 SR 8-bit in-backward unscaled": (torch.float16, 8, False, None),
        "dml_optim bf16 SR 8-bit in-backward (not on DirectML)": (torch.bfloat16, 8, False, None),
        "dml_optim bf16 SR 4-bit in-backward (not on DirectML)": (torch.bfloat16, 4, False, None),
        "dml_optim fp16 SR 8-bit in-backward scaled, clipped by the previous norm": (torch.float16, 8, True, "previous"),
        "dml_optim fp16 SR 4-bit in-backward scaled, clipped by the previous norm": (torch.float16, 4, True, "previous"),
        "dml_optim bf16 SR 8-bit in-backward, clipped by the previous norm (not on DirectML)":
            (torch.bfloat16, 8, False, "previous"),
        "dml_optim bf16 SR 4-bit in-backward, clipped by the previous norm (not on DirectML)":
            (torch.bfloat16, 4, False, "previous")}
#: Diagnostic rows (``--only``): where the clipped float16 8-bit row's distance from FP32 comes from.
DIAGNOSTIC = {"diagnostic: dml_optim fp16 SR 8-bit scaled, clipped by the current norm after backward":
                  (torch.float16, 8, True, "after"),
              "diagnostic: dml_optim FP32 in-backward, clipped by the previous norm": (torch.float32, None, False, "previous"),
              "diagnostic: dml_optim fp16 SR 32-bit state in-backward scaled, clipped by the previous norm":
                  (torch.float16, None, True, "previous")}
LEAN_AND_DIAGNOSTIC = {**LEAN, **DIAGNOSTIC}


def build(name: str, params, backend: str):
    if name == "torch AdamW (FP32)":
        return torch.optim.AdamW(params, **HYPER)
    if name in LEAN_AND_DIAGNOSTIC:
        import dml_optim

        # (an epsilon float16 holds: 1e-8 is below its smallest subnormal, 6e-8; the state is float32 anyway)
        dtype, bits = LEAN_AND_DIAGNOSTIC[name][:2]
        rounding = "stochastic" if dtype != torch.float32 else "nearest"
        return dml_optim.AdamW(params, state_bits=bits, backend=backend, rounding=rounding, **HYPER)
    if name.startswith("dml_optim"):
        import dml_optim

        bits = None if "FP32" in name else int(name.split()[1].split("-")[0])
        return dml_optim.AdamW(params, state_bits=bits, backend=backend, **HYPER)
    if name == "bitsandbytes AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **HYPER)
    from torchao.optim import AdamW4bit, AdamW8bit

    return (AdamW8bit if "8bit" in name else AdamW4bit)(params, **HYPER)


CANDIDATES = ["torch AdamW (FP32)", "dml_optim FP32", "dml_optim 8-bit", "dml_optim 4-bit", "bitsandbytes AdamW8bit",
              "torchao AdamW8bit", "torchao AdamW4bit"]
_PACKAGE = {"bitsandbytes AdamW8bit": "bitsandbytes", "torchao AdamW8bit": "torchao", "torchao AdamW4bit": "torchao"}


def dml_optim_clip(opt, max_norm: float) -> torch.Tensor:
    import dml_optim

    return dml_optim.clip_grad_norm_(opt, max_norm)


def schedule(kind: str, steps: int):
    """The lr multiplier per step: constant, or a linear warm-up over the first 10% then a cosine decay to 10%."""
    if kind == "constant":
        return lambda i: 1.0
    warm = max(1, steps // 10)
    return lambda i: (i + 1) / warm if i < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, steps - warm)))


def run(name: str, seed: int, data: torch.Tensor, split: int, steps: int, batch: int, ctx: int, backend: str,
        d: int = 64, sched: str = "constant", clip: float | None = None):
    torch.manual_seed(seed)
    model = ByteLM(d=d, ctx=ctx)
    lean = name in LEAN_AND_DIAGNOSTIC
    dtype, _, scaled, clipping = LEAN_AND_DIAGNOSTIC.get(name, (torch.float32, None, False, None))
    model.to(dtype)
    opt = build(name, model.parameters(), backend)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(sched, steps))
    scaler = inside = None
    norms = []  # the gradient norms of a clipped run (unscaled, before clipping)
    if lean:
        import dml_optim

        scaler = dml_optim.DynamicLossScaler() if scaled else None
        if clipping == "previous":
            inside = dml_optim.step_in_backward(opt, scaler=scaler, max_norm=clip, clip_by="previous_norm")
        elif clipping is None:
            inside = dml_optim.step_in_backward(opt, scaler=scaler)
    gen = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, split - ctx - 1, (steps, batch), generator=gen)
    hold = torch.arange(split, data.numel() - ctx - 1, ctx)[:256]
    skipped = 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        s = starts[i]
        x = torch.stack([data[j : j + ctx] for j in s.tolist()])
        y = torch.stack([data[j + 1 : j + ctx + 1] for j in s.tolist()])
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inside is not None and inside.total_norm is not None:
            norms.append(inside.total_norm.item())
        if scaler is not None:
            if inside is None:  # (clipped after backward, by the current norm: unscaled first)
                scaler.unscale_(opt)
                norms.append(dml_optim_clip(opt, clip).item())
            skipped += float(scaler.step(opt))  # (inside backward: the runs this backward skipped, already stepped)
            scaler.update()
        elif inside is None:
            if clip is not None:  # (global-norm clipping by the current norm: every gradient at once, after backward)
                if name.startswith("dml_optim"):
                    norms.append(dml_optim_clip(opt, clip).item())
                else:
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
        lr_sched.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        total = 0.0
        for chunk in hold.split(64):
            x = torch.stack([data[j : j + ctx] for j in chunk.tolist()])
            y = torch.stack([data[j + 1 : j + ctx + 1] for j in chunk.tolist()])
            total += F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
        held = total / (hold.numel() * ctx)
    out = {"held_out_loss": held, "train_loss": loss.item(), "seconds": seconds}
    if norms and clip is not None:
        out.update(grad_norm_first=norms[0], grad_norm_mean=sum(norms) / len(norms),
                   steps_above_clip=sum(n > clip for n in norms) / len(norms))
    if scaler is not None:
        out.update(skipped_runs=skipped, final_scale=scaler.get_scale())
    return out


def _machine() -> str:
    from dml_optim.benchmark.machine import cpu_summary

    return cpu_summary()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--d", type=int, default=64, help="the model's width (default 64)")
    ap.add_argument("--schedule", choices=("constant", "warmup-cosine"), default="constant")
    ap.add_argument("--clip", type=float, default=None,
                    help="global-norm clipping: the rows that step after backward by the current norm, the lean rows "
                         "named 'clipped by the previous norm' inside backward by the previous backward's norm; "
                         "--preset lean: 1.0, as issue 49 measured FP32")
    ap.add_argument("--preset", choices=("lean",), default=None,
                    help="lean: issue 49's row (d=128, batch 32, 400 steps, warm-up and cosine, 2 seeds; FP32 and the "
                         "lean configurations); explicit options still win")
    ap.add_argument("--backend", default="eager", help="dml_optim's backend (default eager: what DirectML runs)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="candidates to run (default: all installed; --preset lean: FP32 and the lean rows), by name: "
                         + "; ".join(repr(n) for n in [*CANDIDATES, *LEAN_AND_DIAGNOSTIC]))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine two threads spin against other work)")
    ap.add_argument("--codebook", default=None,
                    help="the codebook dml_optim's low-bit states are made in (default: the active one, "
                         "dml_optim.core.quant.active_codebook(); an earlier one to compare on the same batches)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.preset == "lean":
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, attr, value in (("--d", "d", 128), ("--batch", "batch", 32), ("--steps", "steps", 400),
                                  ("--schedule", "schedule", "warmup-cosine"), ("--clip", "clip", 1.0)):
            if flag not in given:
                setattr(args, attr, value)
        if args.only is None:
            args.only = ["torch AdamW (FP32)", "dml_optim FP32", *LEAN]
    clipped = [n for n in args.only or () if LEAN_AND_DIAGNOSTIC.get(n, (None,) * 4)[3] is not None]
    if clipped and args.clip is None:
        ap.error(f"{clipped[0]!r} clips: give --clip")
    unknown = [n for n in args.only or () if n not in CANDIDATES and n not in LEAN_AND_DIAGNOSTIC]
    if unknown:
        ap.error(f"--only: unknown candidate {unknown[0]!r}")
    torch.set_num_threads(args.threads)
    from dml_optim.core import quant

    if args.codebook is not None:
        if args.codebook not in quant.CODEBOOKS:
            ap.error(f"--codebook: unknown codebook {args.codebook!r} (known: {', '.join(quant.CODEBOOKS)})")
        quant.use_codebook(args.codebook).__enter__()  # (for the whole run)
    data, used = corpus()
    split = int(data.numel() * 0.9)
    print(f"text: {len(used)} stdlib modules, {data.numel():,} bytes ({split:,} train, {data.numel() - split:,} held out)",
          flush=True)
    rows = []
    for name in args.only or CANDIDATES:
        package = _PACKAGE.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            rows.append({"candidate": name, "available": False, "reason": f"{package} not installed"})
            continue
        runs = []
        for seed in args.seeds:
            r = run(name, seed, data, split, args.steps, args.batch, args.ctx, args.backend, args.d, args.schedule,
                    args.clip)
            runs.append(r)
            print(f"  {name:24} seed {seed}: held-out {r['held_out_loss']:.5f}  ({r['seconds']:.1f} s)", flush=True)
        rows.append({"candidate": name, "available": True, "runs": runs,
                     "held_out_loss": sum(r["held_out_loss"] for r in runs) / len(runs)})
    ref = next(r["held_out_loss"] for r in rows if r["candidate"] == "torch AdamW (FP32)")
    for r in rows:
        if r.get("available"):
            r["vs_fp32_pct"] = 100 * (r["held_out_loss"] / ref - 1)
            print(f"{r['candidate']:24} {r['held_out_loss']:.5f}  {r['vs_fp32_pct']:+.3f}% vs FP32")
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(["bench/lm_text.py"] + (argv or sys.argv[1:])),
              "torch": torch.__version__, "text_modules": used, "bytes": data.numel(), "steps": args.steps,
              "batch": args.batch, "ctx": args.ctx, "d": args.d, "schedule": args.schedule, "clip": args.clip,
              "seeds": args.seeds,
              "hyper": {k: list(v) if isinstance(v, tuple) else v for k, v in HYPER.items()},
              "backend": args.backend, "codebook": quant.active_codebook(),
              "bars_pct": ({"fp16 8-bit": 1.0, "fp16 4-bit": 1.5} if args.preset == "lean" else {"8-bit": 0.25, "4-bit": 0.75}),
              "machine": _machine(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
