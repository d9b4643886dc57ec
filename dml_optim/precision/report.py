"""What ``compare`` measured, as a report: the results, a table, Markdown, JSON and the divergence plot.

:class:`Result` is one configuration on one stream (its metrics and its
per-step error curve); :class:`Report` holds every result with the setup,
the findings (:mod:`dml_optim.precision.findings`) and notes, and renders
them: a fixed-width table, Markdown (``report.md``), strict JSON
(``report.json``: inf and NaN as strings) and the plot (``divergence.png``,
needs matplotlib).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dml_optim.precision.configs import CONFIGS, Config
from dml_optim.precision.metrics import DEFINITIONS, METRICS

__all__ = ["Result", "Report", "fmt"]


@dataclass
class Result:
    """One configuration on one stream: its metrics and its per-step error curve."""

    config: str
    stream: str
    metrics: dict[str, Any]
    curve: list[float]


def fmt(value, kind: str = "g") -> str:
    """A metric as the reports print it: 3 significant digits (``kind="%"``: a percentage), ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf"
        if kind == "%":
            return f"{100 * value:.3g}%"
        return f"{value:.3g}"
    return str(value)


def _json_value(value):
    """JSON has no inf/NaN: they are written as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


_COLUMNS = (
    ("config", "config", None), ("stream", "stream", None),
    ("max rel err", "max_rel_error", "g"), ("median rel err", "median_rel_error", "g"),
    ("final ‖Δ‖/‖x‖", "final_rel_error", "g"), ("max ULP", "max_ulp", "g"),
    ("NaN", "nan_count", "g"), ("Inf", "inf_count", "g"), ("first non-finite", "first_nonfinite_step", "g"),
    ("lost updates", "lost_update_fraction", "%"), ("flushed 2nd moment", "flushed_second_moment_fraction", "%"),
    ("grad underflow", "grad_underflow_fraction", "%"), ("final loss", "final_loss", "g"),
)


@dataclass
class Report:
    """Everything ``compare`` measured, with plain-language findings."""

    optimizer: str
    hyperparameters: dict[str, Any]
    workload: str
    seed: int
    steps: int
    streams: list[dict[str, Any]]
    configs: list[Config]
    results: list[Result]
    #: What the configurations are measured against (:func:`~dml_optim.precision.optimizers.reference_description`).
    reference: str
    skipped: list[dict[str, str]] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: dict[str, Any] | None = None
    #: The ``dml-optim compare`` command line that reproduces the numbers (set by the command), or None.
    command: str | None = None

    def rows(self) -> list[list[str]]:
        return [[fmt(r.config if key == "config" else r.stream if key == "stream" else r.metrics[key], kind)
                 for _, key, kind in _COLUMNS] for r in self.results]

    def table(self) -> str:
        """A fixed-width text table, one row per configuration and stream."""
        header = [title for title, _, _ in _COLUMNS]
        rows = self.rows()
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (inf/NaN as strings)."""
        return _json_value({
            "optimizer": self.optimizer,
            "command": self.command,
            "hyperparameters": self.hyperparameters,
            "workload": self.workload,
            "seed": self.seed,
            "steps": self.steps,
            "reference": self.reference,
            "streams": self.streams,
            "configs": [{"name": c.name, "param_dtype": c.param_dtype, "state_dtype": c.state_dtype,
                         "compute_dtype": c.compute_dtype, "master_weights": c.master_weights,
                         "kahan": c.kahan, "state_bits": c.state_bits, "rounding": c.rounding,
                         "description": c.description} for c in self.configs],
            "metrics": list(METRICS),
            "definitions": DEFINITIONS,
            "results": [{"config": r.config, "stream": r.stream, "metrics": r.metrics, "rel_error_per_step": r.curve}
                        for r in self.results],
            "skipped": self.skipped,
            "findings": self.findings,
            "notes": self.notes,
            "plot": self.plot,
        })

    def to_markdown(self) -> str:
        """The report as Markdown: setup, table, findings, definitions."""
        hyper = ", ".join(f"{k}={v}" for k, v in self.hyperparameters.items())
        out = [f"# dml-optim compare: {self.optimizer} on {self.workload}", "",
               f"Optimizer `{self.optimizer}` ({hyper}); {self.steps} steps; seed {self.seed}; reference: {self.reference}, "
               "fed the identical gradient stream.", ""]
        if self.command:
            out += [f"Command: `{self.command}`", ""]
        out += ["Streams:", ""]
        out += [f"- `{s['name']}`: {s['description']}" + (f" (reference final loss {fmt(s['reference_loss'])})" if s.get("reference_loss") is not None else "") for s in self.streams]
        out += ["", "Configurations:", ""] + [f"- `{c.name}`: {c.description}" for c in self.configs]
        header = [title for title, _, _ in _COLUMNS]
        out += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in self.rows()]
        if self.skipped:
            out += ["", "Skipped:", ""] + [f"- `{s['config']}` ({s['stream']}): {s['reason']}" for s in self.skipped]
        out += ["", "## Findings", ""] + [f"- {f}" for f in self.findings]
        if self.plot:
            out += ["", f"![relative error per step]({self.plot['path']})"]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        out += ["", "## Definitions", ""] + [f"- `{k}`: {v}" for k, v in DEFINITIONS.items()]
        return "\n".join(out) + "\n"

    def save_plot(self, path: str | Path) -> int:
        """Write the divergence plot (needs matplotlib); returns the number of lines drawn."""
        try:
            from matplotlib import colormaps
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("the divergence plot needs matplotlib: pip install 'dml-optim[plot]'") from exc
        fig = Figure(figsize=(13, max(6.0, 0.2 * len(self.results) + 1)))  # room for the legend
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        styles = {"recorded": "-", "synthetic": "--", "gaussian": ":"}
        palette = colormaps["tab20"]  # 20 distinct colours (the default cycle repeats after 10)
        colors = {name: palette(i % palette.N) for i, name in enumerate(CONFIGS)}
        # later configurations drawn thinner, so one that overlaps an earlier one (fp16-kahan on fp16-master) shows both
        last = max(len(CONFIGS) - 1, 1)
        widths = {name: 2.8 - 2.2 * i / last for i, name in enumerate(CONFIGS)}
        for r in self.results:
            y = [v if math.isfinite(v) and v > 0 else math.nan for v in r.curve]
            label = f"{r.config} · {r.stream}"
            if r.metrics["first_nonfinite_step"] is not None:
                label += f" (NaN/inf from step {r.metrics['first_nonfinite_step']})"
            ax.plot(range(1, len(y) + 1), y, styles.get(r.stream, "-."), color=colors.get(r.config), label=label,
                    linewidth=widths.get(r.config, 1.2))
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("relative error vs float64 reference  ‖x − x_ref‖₂ / ‖x_ref‖₂")
        ax.set_title(f"{self.optimizer} on {self.workload}: divergence from the float64 reference (seed {self.seed})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return len(ax.lines)
