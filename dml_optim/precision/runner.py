"""Running the precision configurations in lockstep: the harness behind ``dml-optim compare``.

:func:`compare` feeds one identical gradient stream (:mod:`~dml_optim.precision.streams`)
through every configuration (:mod:`~dml_optim.precision.configs`) of one
optimizer and through a float64 reference, step by step, measures how far
each configuration drifts (:mod:`~dml_optim.precision.metrics`) and returns a
:class:`~dml_optim.precision.report.Report` with plain-language findings
(:mod:`~dml_optim.precision.findings`).  :func:`run_stream` is one stream of
that: each configuration's optimizer writes its gradient straight into its
flat gradient buffer, so a configuration sees the stream rounded to its
storage dtype, exactly as autograd would store it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from dml_optim.optimizers import FlatOptimizer, registry
from dml_optim.precision.configs import CONFIGS, REFERENCE, Config
from dml_optim.precision.findings import findings
from dml_optim.precision.metrics import (
    CHUNK, chunks, flushed_entries, lost_updates, relative_error, squared_norm, ulp_distance,
)
from dml_optim.precision.optimizers import (
    make_optimizer, reference_description, reference_optimizer, resolved_hyperparameters, second_moment,
)
from dml_optim.precision.report import Report, Result
from dml_optim.precision.streams import (
    STREAMS, Stream, default_steps, gaussian_stream, recorded_stream, synthetic_stream, workload_params,
)

__all__ = ["compare", "run_stream"]


class _Run:
    """One optimizer fed the stream, with what the metrics accumulate over the steps.

    The parameters, gradients and states are read as one flat vector in the
    stream's order: the optimizer's own flat buffer when it has one without
    padding (no copy), else the concatenation of the parameters (quantized
    states put parameters of 4096 elements or more in a buffer of their own,
    with padding: ``state_bits``).
    """

    def __init__(self, config: Config, opt: FlatOptimizer):
        opt.attach_grads()  # every p.grad becomes a view of a flat gradient buffer
        self.config, self.opt = config, opt
        self.params = [p for group in opt.param_groups for p in group["params"]]
        infos = opt.flat_buffers()
        self._flat = len(infos) == 1 and infos[0].numel == sum(p.numel() for p in self.params)
        self.prev = self.data().clone()
        self.curve: list[float] = []
        self.lost = self.moved = self.underflow = 0
        self.first_nonfinite: int | None = None

    def data(self) -> torch.Tensor:
        """The parameters, flat, in the stream's order (a view of the buffer when it is one)."""
        if self._flat:
            return self.opt.flat_buffers()[0].data
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_grad(self, g: torch.Tensor) -> None:
        """Write the stream's flat gradient (rounded to each gradient's dtype, as autograd stores it)."""
        if self._flat:
            self.opt.flat_buffers()[0].grad.copy_(g)
            return
        a = 0
        for p in self.params:
            p.grad.copy_(g[a : a + p.numel()].view(p.shape))
            a += p.numel()

    def grad(self) -> torch.Tensor:
        if self._flat:
            return self.opt.flat_buffers()[0].grad
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def state(self, name: str) -> torch.Tensor:
        """A state's values, flat in the stream's order (quantized states decoded)."""
        if self._flat:
            s = self.opt.flat_buffers()[0].states[name]
            if isinstance(s, torch.Tensor):
                return s
        return torch.cat([self.opt.state[p][name].reshape(-1) for p in self.params])


def run_stream(optimizer: str, stream: Stream, configs: Sequence[Config], *,
               hyperparameters: dict[str, Any] | None = None, progress: Callable[[int], None] | None = None,
               seed: int = 0) -> tuple[list[Result], list[dict[str, str]], float | None]:
    """Feed ``stream`` through each configuration and the float64 reference.

    Returns ``(results, skipped, reference_loss)``; a configuration the optimizer refuses
    (its constructor raises TypeError/ValueError) is skipped with the reason.
    ``progress``: called as ``progress(t)`` after step ``t``, or None.
    ``seed``: the stochastic rounders' seed (``rounding="stochastic"`` seeds each optimizer's generator
    from ``torch.initial_seed()``): the run sets it inside :func:`torch.random.fork_rng`, so the same
    ``seed`` gives the same numbers and the caller's random state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _run_stream(optimizer, stream, configs, hyperparameters, progress)


def _run_stream(optimizer: str, stream: Stream, configs: Sequence[Config], hyperparameters: dict[str, Any] | None,
                progress: Callable[[int], None] | None) -> tuple[list[Result], list[dict[str, str]], float | None]:
    ref = _Run(REFERENCE, reference_optimizer(optimizer, stream.params(torch.float64), hyperparameters))
    runs, skipped = [], []
    for config in configs:
        try:
            opt = make_optimizer(optimizer, stream.params(config.param_dtype), config, hyperparameters)
        except (TypeError, ValueError) as exc:
            skipped.append({"config": config.name, "stream": stream.name, "reason": str(exc)})
            continue
        runs.append(_Run(config, opt))
    for t in range(1, stream.steps + 1):
        g = stream.grad(t)
        nonzero = g != 0
        ref.set_grad(g)
        ref.opt.step()
        r = ref.data()
        ref_sq = squared_norm(r)
        for run in runs:
            _step_run(run, g, nonzero, r, ref.prev, ref_sq, t)
        ref.prev.copy_(r)
        if progress is not None:
            progress(t)
    results = [Result(run.config.name, stream.name, _final_metrics(optimizer, run, ref, stream), run.curve) for run in runs]
    ref_loss = stream.loss(ref.data().float()) if stream.loss is not None else None
    return results, skipped, ref_loss


def _step_run(run: _Run, g: torch.Tensor, nonzero: torch.Tensor, r: torch.Tensor, r_prev: torch.Tensor, ref_sq: float, t: int) -> None:
    run.set_grad(g)
    run.underflow += int((nonzero & (run.grad() == 0)).sum())
    run.opt.step()
    x = run.data()
    for s in chunks(x.numel()):
        lost, moved = lost_updates(run.prev[s], x[s], r_prev[s], r[s])
        run.lost += lost
        run.moved += moved
    if run.first_nonfinite is None and not bool(torch.isfinite(x).all()):
        run.first_nonfinite = t
    run.curve.append(math.sqrt(squared_norm(x, r)) / math.sqrt(ref_sq) if ref_sq > 0 else math.nan)
    run.prev.copy_(x)


def _final_metrics(optimizer: str, run: _Run, ref: _Run, stream: Stream) -> dict[str, Any]:
    x, r = run.data(), ref.data()
    n = x.numel()
    rel = torch.empty(n, dtype=torch.float32)
    max_ulp = 0
    for s in chunks(n):
        rel[s] = relative_error(x[s], r[s])
        ulp = ulp_distance(x[s], r[s])
        max_ulp = max(max_ulp, int(ulp.max()) if ulp.numel() else 0)
    state_name, _ = second_moment(optimizer)
    flushed = None
    if state_name is not None:
        f, nz = flushed_entries(run.state(state_name), ref.state(state_name))
        flushed = f / nz if nz else 0.0
    total_grads = stream.steps * n
    return {
        "max_rel_error": float(rel.max()),
        "median_rel_error": float(rel.median()),
        "final_rel_error": run.curve[-1] if run.curve else 0.0,
        "max_ulp": max_ulp,
        "nan_count": int(x.isnan().sum()),
        "inf_count": int(x.isinf().sum()),
        "first_nonfinite_step": run.first_nonfinite,
        "lost_update_fraction": run.lost / run.moved if run.moved else 0.0,
        "flushed_second_moment_fraction": flushed,
        "grad_underflow_fraction": run.underflow / total_grads if total_grads else 0.0,
        "final_loss": stream.loss(x.float()) if stream.loss is not None else None,
    }


def compare(
    optimizer: str = "adam",
    steps: int | None = None,
    workload: str = "mlp",
    seed: int = 0,
    streams: Sequence[str] | None = None,
    configs: Sequence[str] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Run every configuration and the float64 reference on identical gradient streams.

    Args:
        optimizer: a registry name (:data:`dml_optim.optimizers.registry.NAMES`).
        steps: steps per stream (default :func:`default_steps` of the workload's size).
        workload: ``"mlp"`` (the built-in model) or a model for
            :func:`dml_optim.inventory.resolve_model` (a built-in name such as
            ``gpt2``, or the path of an inventory JSON file).
        seed: seeds the model, the data, the streams and the stochastic rounding.
        streams: default ``("recorded", "synthetic")`` for ``mlp`` and
            ``("gaussian", "synthetic")`` for an inventory (which has no model
            to record gradients from).
        configs: names from :data:`CONFIGS` (default: all).
        hyperparameters: overrides of the optimizer's hyperparameters (its own names).
        progress: called as ``progress(done, total)`` after every step of every
            stream (``total`` is steps times streams); None: silent.
    """
    registry.get(optimizer)  # ValueError listing the names
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    streams = tuple(streams) if streams is not None else (("recorded", "synthetic") if workload == "mlp" else ("gaussian", "synthetic"))
    for s in streams:
        if s not in STREAMS:
            raise ValueError(f"streams: unknown stream {s!r} (choose from {', '.join(STREAMS)})")
    if "recorded" in streams and workload != "mlp":
        raise ValueError("streams: 'recorded' needs the built-in model (workload 'mlp'); an inventory has shapes only")
    names = list(configs) if configs is not None else list(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"configs: unknown configuration {name!r} (choose from {', '.join(CONFIGS)})")
    hyper = resolved_hyperparameters(optimizer, hyperparameters)
    init, shapes, wname = workload_params(workload, seed)
    steps = default_steps(init.numel()) if steps is None else steps
    threads = torch.get_num_threads()
    if init.numel() < CHUNK:
        # small buffers gain nothing from intra-op threads, and on a loaded
        # machine the thread hand-offs cost 10-100x the op (measured: 14 ms vs 0.16 ms)
        torch.set_num_threads(1)
    try:
        report = _compare(optimizer, steps, workload, seed, streams, names, hyper, hyperparameters, init, shapes, wname, progress)
    finally:
        torch.set_num_threads(threads)
    return report


def _compare(optimizer: str, steps: int, workload: str, seed: int, streams: tuple[str, ...], names: list[str],
             hyper: dict[str, Any], hyperparameters: dict[str, Any] | None, init: torch.Tensor,
             shapes: list[tuple[int, ...]], wname: str, progress: Callable[[int, int], None] | None) -> Report:
    """:func:`compare` after validation: run each stream, then build the report."""
    results, skipped, stream_info, numel = [], [], [], {}
    for i, name in enumerate(streams):
        if name == "recorded":
            stream = recorded_stream(optimizer, steps, seed, hyperparameters)
        elif name == "synthetic":
            stream = synthetic_stream(init, shapes, steps, seed)
        else:
            stream = gaussian_stream(init, shapes, steps, seed)

        def step_done(t: int, before: int = i * steps) -> None:
            progress(before + t, steps * len(streams))

        res, skip, ref_loss = run_stream(optimizer, stream, [CONFIGS[n] for n in names],
                                         hyperparameters=hyperparameters, seed=seed,
                                         progress=None if progress is None else step_done)
        results += res
        skipped += skip
        numel[name] = stream.init.numel()
        stream_info.append({"name": name, "description": stream.description, "parameters": stream.init.numel(),
                            "reference_loss": ref_loss})
    report = Report(optimizer, hyper, wname, seed, steps, stream_info, [CONFIGS[n] for n in names], results,
                    reference_description(optimizer), skipped)
    report.notes.append("Arithmetic in FP16/BF16 rounds every op's result to that dtype (as DirectML does); "
                        "on the CPU each op computes internally in FP32 first, so one op's result is correctly rounded.")
    report.findings = findings(report, numel)
    return report

