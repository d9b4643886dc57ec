"""Plain-language findings of a ``compare`` report, each computed from its numbers.

:func:`findings` reads a :class:`~dml_optim.precision.report.Report` and
states, per stream: the configurations ranked by their final error; what FP32
master weights and Kahan compensation keep that plain FP16/BF16 loses (and at
what memory); whether stochastic rounding tracks the reference closer than
plain FP16/BF16, and where Kahan compensation (2 bytes per parameter more)
is still closer; a BF16 low-bit configuration against its FP16 twin (DirectML,
which has no BF16, runs the FP16 one); and, per configuration, the causes the metrics point to: an
epsilon that is 0 in the arithmetic dtype, a second moment flushed to zero,
updates lost to rounding, gradients that underflowed on storage.  Each
sentence quotes the numbers it rests on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dml_optim.optimizers import registry
from dml_optim.precision.configs import Config
from dml_optim.core.quant import BLOCK, format_for
from dml_optim.precision.metrics import smallest_subnormal
from dml_optim.precision.optimizers import epsilon_name, second_moment
from dml_optim.precision.report import Report, Result, fmt

__all__ = ["findings"]


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32", torch.float64: "FP64"}[dtype]


def _finite_error(result: Result | None) -> bool:
    return result is not None and math.isfinite(result.metrics["final_rel_error"])


def findings(report: Report, numel: dict[str, int]) -> list[str]:
    """Plain-language findings, each computed from the numbers of ``report`` (``numel``: parameters per stream)."""
    out: list[str] = []
    by = {(r.config, r.stream): r for r in report.results}
    configs = {c.name: c for c in report.configs}
    for stream in report.streams:
        rows = [r for r in report.results if r.stream == stream["name"]]
        if rows:
            out += _summary_findings(report, stream, rows, by)
        out += [_kahan_finding(r, configs[r.config], by) for r in rows
                if configs[r.config].kahan and not configs[r.config].state_bits]
        out += [_stochastic_finding(r, configs[r.config], by) for r in rows
                if configs[r.config].stochastic and not configs[r.config].state_bits]
        out += [_low_bit_finding(report, r, configs[r.config], by) for r in rows if configs[r.config].state_bits]
        underflow: dict[torch.dtype, tuple[float, list[str]]] = {}
        for r in rows:
            cfg, m = configs[r.config], r.metrics
            where = f"`{r.config}` ({r.stream} stream)"
            if m["first_nonfinite_step"] is not None:
                out.append(_nonfinite_finding(report, where, r, cfg, numel[r.stream], by))
            if m["flushed_second_moment_fraction"]:
                out.append(_flush_finding(report, where, m, cfg))
            if (cfg.param_dtype != torch.float32 and not cfg.carries_small_updates and not cfg.stochastic
                    and m["lost_update_fraction"] >= 0.01):
                out.append(_lost_finding(where, m["lost_update_fraction"], cfg, by.get(("fp16-master", r.stream))))
            if m["grad_underflow_fraction"] >= 0.0001:
                underflow.setdefault(cfg.param_dtype, (m["grad_underflow_fraction"], []))[1].append(f"`{r.config}`")
        for dtype, (fraction, names) in underflow.items():
            out.append(f"{stream['name']} stream: {_pct(fraction)} of gradient entries became 0 when stored in "
                       f"{_dtype_name(dtype)} (|g| below {smallest_subnormal(dtype) / 2:.3g}) in {', '.join(names)}; "
                       "loss scaling (dml_optim.training.amp.DynamicLossScaler) shifts small gradients into range.")
    seen = set()
    for s in report.skipped:
        if s["config"] not in seen:
            seen.add(s["config"])
            out.append(f"`{s['config']}` skipped: {s['reason']}")
    return out


def _summary_findings(report: Report, stream: dict[str, Any], rows: list[Result], by) -> list[str]:
    name = stream["name"]
    key = lambda r: (not math.isfinite(r.metrics["final_rel_error"]), r.metrics["final_rel_error"])
    ranked = sorted(rows, key=key)
    parts = ", ".join(f"`{r.config}` {fmt(r.metrics['final_rel_error'])}" for r in ranked)
    out = [f"{name} stream, relative error after {report.steps} steps (||x - x_ref|| / ||x_ref||), best first: {parts}."]
    if stream.get("reference_loss") is not None:
        losses = ", ".join(f"`{r.config}` {fmt(r.metrics['final_loss'])}" for r in rows)
        out.append(f"{name} stream, final training loss on the built-in data: reference {fmt(stream['reference_loss'])}, {losses}.")
    half = [r for r in ranked if r.config != "fp32" and math.isfinite(r.metrics["final_rel_error"])]
    if half:
        best = half[0]
        out.append(f"{name} stream: the most faithful reduced-precision configuration is `{best.config}` "
                   f"(relative error {fmt(best.metrics['final_rel_error'])}, max {best.metrics['max_ulp']} ULP from the "
                   "reference rounded to its storage dtype).")
    master = by.get(("fp16-master", name))
    if _finite_error(master):
        mm = master.metrics
        text = (f"{name} stream: `fp16-master`'s FP16 parameters did not change in {_pct(mm['lost_update_fraction'])} "
                "of the updates, but its FP32 master copy accumulated those small steps, so they are not lost")
        if mm["final_rel_error"] <= 2.0**-10:
            text += (f": its error stays at the level of FP16 rounding of the parameters ({fmt(mm['final_rel_error'])}; "
                     "half an FP16 ULP is 2^-11 ≈ 4.9e-4 relative).")
        else:
            text += (f"; its remaining error ({fmt(mm['final_rel_error'])}) is above FP16 rounding of the parameters: "
                     "the gradients are stored in FP16 (each rounded to 11 bits"
                     + (f", {_pct(mm['grad_underflow_fraction'])} of them to 0" if mm["grad_underflow_fraction"] else "")
                     + ") before the FP32 update sees them.")
        out.append(text)
    return out


def _low_bit_finding(report: Report, r: Result, cfg: Config, by) -> str:
    """A quantized-state configuration against the same storage of parameters with full-precision states."""
    m = r.metrics
    bits = cfg.state_bits
    where = f"`{r.config}` ({r.stream} stream)"
    if not math.isfinite(m["final_rel_error"]):
        return f"{where}: parameters became NaN or inf (first at step {m['first_nonfinite_step']})."
    per_state = bits / 8 + 4 / BLOCK[bits]
    states = len(registry.get(report.optimizer).state_names)
    text = (f"{where}: states stored in {bits} bits per value (blocks of {BLOCK[bits]} sharing one FP32 scale: "
            f"{states * per_state:.3g} bytes per parameter for {states} state{'s' * (states > 1)}, instead of "
            f"{4 * states} in FP32) end at relative error {fmt(m['final_rel_error'])}")
    full = by.get((_full_state_twin(r.config, cfg), r.stream))
    if _finite_error(full):
        text += f", against {fmt(full.metrics['final_rel_error'])} for `{full.config}` (the same with FP32 states)"
    if m["final_loss"] is not None and _finite_error(full):
        text += f"; final training loss {fmt(m['final_loss'])} (`{full.config}` {fmt(full.metrics['final_loss'])})"
    if cfg.stochastic:
        kahan = [o for c in report.configs if c.kahan and c.state_bits == bits
                 for o in [by.get((c.name, r.stream))] if _finite_error(o)]
        for o in kahan:
            k, own = o.metrics["final_rel_error"], m["final_rel_error"]
            dtype = next(c for c in report.configs if c.name == o.config).param_dtype
            size = torch.finfo(dtype).bits // 8
            if k < own / 1.1:
                versus = f"{own / k:.3g} times less error"
            elif k <= own * 1.1:
                versus = f"within 10% of it ({k / own:.3f} times its error): the states' quantization dominates both"
            else:
                versus = f"{k / own:.3g} times more error"
            text += (f"; `{o.config}` ({_dtype_name(dtype)} parameters with the same {bits}-bit states and a "
                     f"{size}-byte Kahan compensation buffer per parameter instead of stochastic rounding) ends at "
                     f"{fmt(k)}, {versus}")
        if cfg.param_dtype == torch.bfloat16:  # DirectML has no bfloat16: its lean configuration is the FP16 twin
            twin = by.get((f"fp16-sr-{bits}bit", r.stream))
            if _finite_error(twin):
                text += (f"; BF16 does not run on DirectML (it has none): `{twin.config}`, the same in FP16 (DirectML's "
                         f"lean configuration), ends at {fmt(twin.metrics['final_rel_error'])}")
    spans = (f"the first moment's {_code_words(format_for(bits, True))}, "
             f"the second moment's {_code_words(format_for(bits, False))}")
    return text + (f". Each value is rounded to the nearest of its code's {2**bits} levels relative to "
                   f"the largest value of its block ({spans}), so a block holding values of very different sizes "
                   "stores its small values coarsely: the quantization error, not the arithmetic, is what separates "
                   "this configuration from FP32.")


def _full_state_twin(name: str, cfg: Config) -> str:
    """The configuration that differs from the quantized-state ``cfg`` only by its FP32 states."""
    if cfg.kahan or cfg.stochastic:
        return name.removesuffix(f"-{cfg.state_bits}bit")  # fp16-kahan-8bit -> fp16-kahan, bf16-sr-4bit -> bf16-sr
    return "fp32"


def _code_words(f) -> str:
    """What the levels of the quantized state format ``f`` are, in words."""
    if f.kind == "linear":
        return f"{2**f.bits} evenly spaced levels 1/{2**f.bits} apart"
    decades = f"{f.decades} decade{'s' * (f.decades != 1)} below its block's largest value"
    if f.kind == "asinh":
        return f"asinh-companded code, linear near 0 and logarithmic down to {decades}"
    if f.kind == "pow":
        return f"power code (levels (k/{f.magnitudes})^{1 / f.param:g}), whose smallest level is {decades}"
    if f.kind == "root":
        sign = "signed " if f.signed else ""
        return f"{sign}fourth-root code (levels (k/{f.magnitudes})^4), whose smallest nonzero level is {decades}"
    return f"dynamic-exponent code spanning {decades}"


def _kahan_finding(r: Result, cfg: Config, by) -> str:
    """Kahan against FP32, FP32 master weights and the plain low-precision configuration of its dtype."""
    m = r.metrics
    size = torch.finfo(cfg.param_dtype).bits // 8
    where = f"`{r.config}` ({r.stream} stream)"
    if not math.isfinite(m["final_rel_error"]):
        return f"{where}: parameters became NaN or inf (first at step {m['first_nonfinite_step']})."
    text = (f"{where}: {_dtype_name(cfg.param_dtype)} parameters plus a {size}-byte compensation buffer per parameter "
            f"(FP32 master weights take 4) end at relative error {fmt(m['final_rel_error'])}")
    others = [(name, by.get((name, r.stream))) for name in ("fp32", "fp16-master")]
    others = [(name, o) for name, o in others if _finite_error(o)]
    if others:
        text += ", against " + " and ".join(f"`{name}`'s {fmt(o.metrics['final_rel_error'])}" for name, o in others)
    master = by.get(("fp16-master", r.stream))
    if _finite_error(master) and master.metrics["final_rel_error"] > 0:
        ratio = m["final_rel_error"] / master.metrics["final_rel_error"]
        text += f" ({ratio:.2f} times `fp16-master`'s)"
    if m["final_loss"] is not None:
        losses = [(name, o.metrics["final_loss"]) for name, o in others]
        text += (f"; final training loss {fmt(m['final_loss'])}"
                 + "".join(f", `{name}` {fmt(loss)}" for name, loss in losses))
    text += (f". Its parameters did not change in {_pct(m['lost_update_fraction'])} of the updates; the compensation "
             "buffer carried what rounding dropped into the next steps, so those updates are not lost")
    plain = by.get((r.config.removesuffix("-kahan"), r.stream))  # the same dtype without compensation
    if plain is not None and math.isfinite(plain.metrics["final_rel_error"]):
        text += (f" (plain `{plain.config}` on the same stream ends at {fmt(plain.metrics['final_rel_error'])}, "
                 f"{_pct(plain.metrics['lost_update_fraction'])} of its updates lost)")
    return text + "."


def _stochastic_finding(r: Result, cfg: Config, by) -> str:
    """Stochastic rounding against the plain configuration of its dtype (round to nearest) and against Kahan
    compensation of the same dtype (a buffer of the parameters' size), from the measured errors."""
    m = r.metrics
    dtype = _dtype_name(cfg.param_dtype)
    size = torch.finfo(cfg.param_dtype).bits // 8
    where = f"`{r.config}` ({r.stream} stream)"
    if not math.isfinite(m["final_rel_error"]):
        return f"{where}: parameters became NaN or inf (first at step {m['first_nonfinite_step']})."
    err = m["final_rel_error"]
    text = (f"{where}: {dtype} parameters written by stochastic rounding (FP32 arithmetic, each result rounded up or "
            f"down with probabilities that make it exact on average; no compensation buffer) end at relative error "
            f"{fmt(err)}")
    base = r.config.removesuffix("-sr")
    plain, kahan = by.get((base, r.stream)), by.get((f"{base}-kahan", r.stream))
    if _finite_error(plain):
        p = plain.metrics["final_rel_error"]
        if err < p:
            text += (f": closer to the reference than plain `{plain.config}` ({fmt(p)}: {p / err:.3g} times as much "
                     f"error; {_below_since(r.curve, plain.curve)}), "
                     f"which lost {_pct(plain.metrics['lost_update_fraction'])} of its updates to round-to-nearest")
        else:
            text += f": not closer to the reference than plain `{plain.config}` ({fmt(p)}) on this stream"
    elif plain is not None:
        text += f" (plain `{plain.config}`: NaN or inf from step {plain.metrics['first_nonfinite_step']})"
    text += (f". Its parameters did not change in {_pct(m['lost_update_fraction'])} of the updates, but a step "
             "below half an ULP still moves the parameter by one ULP with the probability of its size, so small "
             "updates are kept on average instead of dropped")
    if _finite_error(kahan):
        k = kahan.metrics["final_rel_error"]
        steps = len(r.curve)
        closer = sum(1 for a, b in zip(kahan.curve, r.curve) if a < b)
        if k < err:
            text += (f". `{kahan.config}` is still closer ({fmt(k)}: {err / k:.3g} times less error), at the cost of "
                     f"a {size}-byte compensation buffer per parameter that stochastic rounding does not keep: Kahan "
                     "carries each rounding error into the next step, where stochastic rounding's errors only cancel "
                     f"on average and add up as a random walk (Kahan's error was the smaller at {closer} of the "
                     f"{steps} steps)")
        else:
            text += (f". It is as close as `{kahan.config}` or closer ({fmt(k)}) without Kahan's {size}-byte "
                     f"compensation buffer per parameter (Kahan's error was the smaller at {closer} of the {steps} "
                     "steps)")
    if m["final_loss"] is not None:
        losses = [(o.config, o.metrics["final_loss"]) for o in (plain, kahan) if _finite_error(o)]
        text += (f"; final training loss {fmt(m['final_loss'])}"
                 + "".join(f", `{name}` {fmt(loss)}" for name, loss in losses))
    return text + "."


def _below_since(curve: list[float], other: list[float]) -> str:
    """From which step ``curve`` stays below ``other`` (both end with ``curve`` below), in words."""
    below = [a < b for a, b in zip(curve, other)]
    if all(below):
        return f"below it at every one of the {len(below)} steps"
    since = len(below) - below[::-1].index(False) + 1  # the step after the last one not below
    return f"below it from step {since} of {len(below)} on"


def _nonfinite_finding(report: Report, where: str, r: Result, cfg: Config, numel: int, by) -> str:
    m = r.metrics
    bad = (m["nan_count"] + m["inf_count"]) / numel
    cdtype = cfg.arithmetic_dtype
    eps_name = epsilon_name(report.optimizer)
    eps = report.hyperparameters[eps_name] if eps_name else None
    if eps and float(torch.tensor(eps, dtype=cdtype)) == 0.0:
        fixed = by.get(("fp16-fp32compute", r.stream))
        alt = (f" (`fp16-fp32compute` on the same stream: {fixed.metrics['nan_count']} NaN)"
               if fixed is not None and cdtype == torch.float16 else "")
        return (f"{where}: {eps_name} {eps:g} is 0 in {_dtype_name(cdtype)} (smallest subnormal "
                f"{smallest_subnormal(cdtype):.3g}), so an element whose gradient and state are 0 computes 0/0 and an "
                f"element whose second moment underflowed divides by 0: {_pct(bad)} of parameters were NaN or inf at "
                f"the end, first at step {m['first_nonfinite_step']}. Use {eps_name} >= 1e-4 with "
                f"{_dtype_name(cdtype)} arithmetic, or FP32 arithmetic{alt}.")
    return (f"{where}: {_pct(bad)} of parameters were NaN or inf at the end, first at step "
            f"{m['first_nonfinite_step']} (overflow or 0/0 in {_dtype_name(cdtype)} arithmetic).")


def _flush_finding(report: Report, where: str, m: dict[str, Any], cfg: Config) -> str:
    state, decay = second_moment(report.optimizer)
    state_dtype, grad_dtype = cfg.stored_state_dtype, cfg.param_dtype
    flushed = m["flushed_second_moment_fraction"]
    coef = 1.0 - report.hyperparameters[decay] if decay else 1.0
    half = smallest_subnormal(state_dtype) / 2
    threshold = math.sqrt(half / coef)
    if threshold < smallest_subnormal(grad_dtype) / 2:
        # the state could hold these values: the zeros come from gradients that underflowed on storage
        return (f"{where}: {_pct(flushed)} of second-moment entries ({state}) are 0 where the reference's are not, "
                f"although the state is {_dtype_name(state_dtype)}: their gradients were always below "
                f"{smallest_subnormal(grad_dtype) / 2:.3g} and became 0 when stored in {_dtype_name(grad_dtype)} "
                "(see grad underflow); loss scaling keeps them.")
    term = f"(1 - {decay})·g² = {coef:g}·g²" if decay else "g²"
    effect = ("the parameter then moves by lr·m/epsilon instead of lr·m/sqrt(v)" if decay
              else "the parameter then moves by lr·g/epsilon instead of lr·g/sqrt(sum)")
    return (f"{where}: {_pct(flushed)} of second-moment entries ({state}) flushed to zero: {term} is below "
            f"{half:.3g} (half {_dtype_name(state_dtype)}'s smallest subnormal) for every |g| below {threshold:.2g}, "
            f"so it rounds to 0 and {effect}. FP32 arithmetic does not help while the state is stored in "
            f"{_dtype_name(state_dtype)}: keep the states in FP32 (`fp16-master`, `fp16-kahan`, or "
            "state_dtype=torch.float32).")


def _lost_finding(where: str, lost: float, cfg: Config, master: Result | None) -> str:
    ulp_one = torch.finfo(cfg.param_dtype).eps
    text = (f"{where}: {_pct(lost)} of updates were lost to rounding: the step was below half an ULP of the parameter "
            f"(the ULP of 1.0 is {ulp_one:.3g} in {_dtype_name(cfg.param_dtype)}), so the parameter stayed put while "
            "the reference moved.")
    if _finite_error(master):
        return text + (f" Use FP32 master weights (master_weights=True) or Kahan compensation (kahan=True): "
                       f"`fp16-master` ends at relative error {fmt(master.metrics['final_rel_error'])} on the same stream.")
    return text + " Use FP32 master weights (master_weights=True) or Kahan compensation (kahan=True)."
