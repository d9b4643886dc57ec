"""``dml-optim validate``: check DirectML ADAM_OPTIMIZER descriptors (docs/design.md §3).

A thin layer over :func:`dml_optim.dml.validate.validate`: read descriptor
JSON files (or a model inventory, whose descriptors are built with
:func:`dml_optim.dml.tensor_desc.adam_descriptor`), print one line per
violation and a verdict, and exit 0 (valid, warnings allowed), 1 (a
violation) or 2 (malformed input: one line on stderr, never a traceback).
With several files the exit status is the worst of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dml_optim.commands import UsageError
from dml_optim.dml.builder import adam_descriptor, split_for_dml
from dml_optim.dml.desc import ELEMENT_SIZES, MAX_ELEMENTS, MalformedDescriptor, canonical_feature_level
from dml_optim.dml.desc_json import load, loads
from dml_optim.dml.validate import Report, Violation, validate

HELP = "check DirectML ADAM_OPTIMIZER descriptors (JSON) or a model's optimizer descriptors"

DESCRIPTION = """\
Check DML_ADAM_OPTIMIZER_OPERATOR_DESC descriptors, with their tensor descs and
bindings, against DirectML's rules, and list every violation by rule id.

Each violation is printed as 'severity field rule: message', followed by one
verdict line per file. Exit status: 0 valid (warnings allowed), 1 at least one
error, 2 malformed input (a value the C structs cannot hold, not JSON, a
missing tensor, an unreadable file). With several files, the worst status.

With --model, builds the descriptors the optimizers would use for a model (a
built-in name such as gpt2 or resnet50, or the path of an inventory JSON
file): one in-place ADAM_OPTIMIZER per parameter tensor, and one per chunk (<= 2^32 - 1 elements) of the flat
whole-model buffer; validates them all and prints a summary.
"""

EPILOG = """\
examples:
  dml-optim validate my-desc.json
  dml-optim validate my-desc.json --feature-level 4_0 --json
  cat my-desc.json | dml-optim validate -
  dml-optim validate --model gpt2 --dtype float16
  dml-optim validate --model my-model.json

example descriptors, one per rule, are installed with the package: 'dml-optim
info' prints their folder (README.md there explains them).

descriptor JSON (field names as in directml.h):
  {"feature_level": "3_0", "LearningRate": 0.001, "Beta1": 0.9, "Beta2": 0.999,
   "Epsilon": 1e-8,
   "InputParametersTensor": {"DataType": "FLOAT32", "Sizes": [1, 1, 1, 1024]},
   ... the other seven tensors ...,
   "Bindings": {"InputParametersTensor": {"Buffer": "w", "Offset": 0, "Size": 4096}},
   "TrainingStepValue": 1}
"""

_DTYPES = {"float32": "FLOAT32", "float16": "FLOAT16"}
_PROG = "dml-optim validate"


def add_parser(sub):
    p = sub.add_parser(
        "validate",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="descriptor JSON file ('-' reads standard input)")
    p.add_argument("--model", metavar="MODEL",
                   help="a built-in model name (resnet50, gpt2, ...) or an inventory JSON path, instead of FILEs")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="with --model: the parameter dtype (default float32)")
    p.add_argument(
        "--epsilon", type=float, help="with --model: the Epsilon attribute (default 1e-8)"
    )
    p.add_argument(
        "--feature-level",
        metavar="L",
        help="DirectML feature level to check against (3_0 ... 6_4); overrides the files' feature_level",
    )
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    level = _feature_level_arg(args.feature_level)
    if args.model is not None:
        if args.files:
            raise UsageError("give either FILEs or --model, not both")
        epsilon = 1e-8 if args.epsilon is None else args.epsilon
        return _run_model(args.model, _DTYPES[args.dtype or "float32"], epsilon, level or "3_0", args.json)
    if args.dtype is not None or args.epsilon is not None:
        raise UsageError("--dtype and --epsilon apply only with --model")
    if not args.files:
        raise UsageError("give at least one descriptor FILE, or --model MODEL")
    return _run_files(args.files, level, args.json)


def _feature_level_arg(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return canonical_feature_level(value, "--feature-level")
    except MalformedDescriptor as exc:
        raise UsageError(str(exc)) from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _error(message: str) -> None:
    print(f"{_PROG}: error: {_one_line(message)}", file=sys.stderr)


def _status(report: Report) -> int:
    return 0 if report.valid else 1


def _counts(errors: int, warnings: int) -> str:
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"


def _verdict(name: str, report: Report) -> str:
    word = "valid" if report.valid else "INVALID"
    counts = _counts(len(report.errors), len(report.warnings))
    return f"{name}: {word} at feature level {report.feature_level} ({counts})"


# ---------------------------------------------------------------------------
# Descriptor files
# ---------------------------------------------------------------------------


def _check_file(path: str, level: str | None) -> Report:
    """The report for one file; MalformedDescriptor for unreadable or malformed input."""
    desc = loads(sys.stdin.read()) if path == "-" else load(path)
    return validate(desc, level)


def _run_files(paths: list[str], level: str | None, as_json: bool) -> int:
    worst = 0
    results: list[dict[str, Any]] = []
    for path in paths:
        name = "<stdin>" if path == "-" else path
        try:
            report = _check_file(path, level)
        except MalformedDescriptor as exc:
            _error(f"{name}: malformed descriptor: {exc}")
            results.append({"file": name, "valid": False, "malformed": _one_line(str(exc))})
            worst = 2
            continue
        worst = max(worst, _status(report))
        results.append({"file": name, **report.to_dict()})
        if not as_json:
            for violation in report.violations:
                print(violation)
            print(_verdict(name, report))
    if as_json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    return worst


# ---------------------------------------------------------------------------
# --model
# ---------------------------------------------------------------------------


@dataclass
class _Tally:
    """Violations of a family of descriptors (per-parameter, or flat chunks)."""

    descriptors: int = 0
    errors: int = 0
    warnings: int = 0
    violations: list[tuple[str, Violation]] = field(default_factory=list)

    def add(self, label: str, report: Report) -> None:
        self.descriptors += 1
        self.errors += len(report.errors)
        self.warnings += len(report.warnings)
        self.violations.extend((label, v) for v in report.violations)

    def add_error(self, label: str, violation: Violation) -> None:
        self.descriptors += 1
        self.errors += 1
        self.violations.append((label, violation))


def _load_model(model: str):
    from dml_optim.inventory import resolve_model

    try:
        return resolve_model(model)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def _hyper(epsilon: float, level: str) -> dict[str, Any]:
    return dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=epsilon, training_step=1, feature_level=level)


def _per_parameter(inventory, data_type: str, hyper: dict[str, Any], level: str) -> _Tally:
    tally = _Tally()
    for name, shape in inventory.parameters:
        roles = ("parameters", "first_moment", "second_moment", "gradient", "training_step")
        buffers = {role: f"{name}.{role}" for role in roles}
        try:
            desc = adam_descriptor(shape, data_type, buffer_names=buffers, **hyper)
        except MalformedDescriptor as exc:  # a size above UINT32: the C struct cannot hold it
            tally.add_error(name, Violation(name, "element-count", "error", f"{name} {list(shape)}: {exc}"))
            continue
        tally.add(name, validate(desc, level))
    return tally


def _flat(numel: int, data_type: str, hyper: dict[str, Any], level: str) -> tuple[list[int], _Tally]:
    tally = _Tally()
    chunks = split_for_dml(numel)
    start = 0
    for i, chunk in enumerate(chunks):
        desc = adam_descriptor(chunk, data_type, element_offset=start, **hyper)
        tally.add(f"flat[{i}]", validate(desc, level))
        start += chunk
    return chunks, tally


def _run_model(model: str, data_type: str, epsilon: float, level: str, as_json: bool) -> int:
    inventory = _load_model(model)
    hyper = _hyper(epsilon, level)
    per_param = _per_parameter(inventory, data_type, hyper, level)
    numel = sum(math.prod(shape) for _, shape in inventory.parameters)
    chunks, flat = _flat(numel, data_type, hyper, level)
    summary = _model_summary(inventory, data_type, level, epsilon, numel, chunks, per_param, flat)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_model(summary, per_param, flat)
    return 0 if summary["valid"] else 1


def _model_summary(inventory, data_type, level, epsilon, numel, chunks, per_param, flat) -> dict[str, Any]:
    esize = ELEMENT_SIZES[data_type]
    largest = max(inventory.parameters, key=lambda p: math.prod(p[1]), default=("", ()))
    violations = [
        {"descriptor": f"per-parameter:{label}", **v.to_dict()} for label, v in per_param.violations
    ] + [{"descriptor": label, **v.to_dict()} for label, v in flat.violations]
    return {
        "model": inventory.name,
        "source": inventory.source,
        "data_type": data_type,
        "feature_level": level,
        "epsilon": epsilon,
        "tensors": len(inventory.parameters),
        "elements": numel,
        "bytes_per_buffer": numel * esize,
        "largest_tensor": {"name": largest[0], "elements": math.prod(largest[1]) if largest[0] else 0},
        "per_parameter": {"descriptors": per_param.descriptors, "errors": per_param.errors,
                          "warnings": per_param.warnings},
        "flat": {"chunks": chunks, "max_chunk_elements": MAX_ELEMENTS, "descriptors": flat.descriptors,
                 "errors": flat.errors, "warnings": flat.warnings},
        "valid": per_param.errors == 0 and flat.errors == 0,
        "violations": violations,
    }


def _print_model(s: dict[str, Any], per_param: _Tally, flat: _Tally) -> None:
    bpb = s["bytes_per_buffer"]
    print(f"model {s['model']}: {s['source']}")
    print(f"  {s['tensors']} parameter tensors, {s['elements']:,} elements, {s['data_type']}, "
          f"feature level {s['feature_level']}, Epsilon {s['epsilon']!r}")
    pp = s["per_parameter"]
    print(f"  per parameter: {pp['descriptors']} in-place ADAM_OPTIMIZER descriptors, largest "
          f"{s['largest_tensor']['name']} ({s['largest_tensor']['elements']:,} elements); "
          f"{_counts(pp['errors'], pp['warnings'])}")
    fl = s["flat"]
    chunks = ", ".join(f"{c:,}" for c in fl["chunks"]) or "none"
    print(f"  flat buffer: {len(fl['chunks'])} chunk(s) of at most {MAX_ELEMENTS:,} elements "
          f"({chunks}); {bpb:,} bytes per buffer (parameters, first moment, "
          f"second moment, gradient: {4 * bpb:,} bytes) + a 4-byte UINT32 step; "
          f"{_counts(fl['errors'], fl['warnings'])}")
    for line in _grouped_violations(per_param, flat):
        print(line)
    total = _counts(pp["errors"] + fl["errors"], pp["warnings"] + fl["warnings"])
    print(f"{s['model']}: {'valid' if s['valid'] else 'INVALID'} at feature level {s['feature_level']} ({total})")


def _grouped_violations(per_param: _Tally, flat: _Tally) -> list[str]:
    """One line per distinct (violation, family), with how many descriptors it hit."""
    lines = []
    for family, tally in (("per-parameter", per_param), ("flat", flat)):
        counts = Counter(str(v) for _, v in tally.violations)
        first = {}
        for label, v in tally.violations:
            first.setdefault(str(v), label)
        for text, n in counts.items():
            lines.append(f"{text} [{family}: {n} descriptor{'s' * (n != 1)}, first {first[text]}]")
    return lines
