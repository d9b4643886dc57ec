"""Shared helpers of the descriptor/validator tests (test_tensor_desc, test_validate, ...).

The base descriptor is written out literally (not built by the code under
test): FLOAT32, Sizes [1, 1, 1, 1024] (4096 bytes), feature level 3_0, every
output bound in place over its input, gradient and step in their own buffers.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO / "dml_optim" / "data" / "shapes" / "descriptors"
MODELS_DIR = REPO / "dml_optim" / "data" / "shapes" / "models"

TENSORS = (
    "InputParametersTensor",
    "InputFirstMomentTensor",
    "InputSecondMomentTensor",
    "GradientTensor",
    "TrainingStepTensor",
    "OutputParametersTensor",
    "OutputFirstMomentTensor",
    "OutputSecondMomentTensor",
)
DATA_TENSORS = tuple(t for t in TENSORS if t != "TrainingStepTensor")
OUTPUTS = TENSORS[5:]
BUFFERS = {
    "InputParametersTensor": "weights",
    "OutputParametersTensor": "weights",
    "InputFirstMomentTensor": "m",
    "OutputFirstMomentTensor": "m",
    "InputSecondMomentTensor": "v",
    "OutputSecondMomentTensor": "v",
    "GradientTensor": "grad",
    "TrainingStepTensor": "step",
}

#: docs/design.md §3's rule table, copied by hand.
DESIGN_RULES = {
    "dimension-count": "error",
    "sizes-length": "error",
    "strides-length": "error",
    "zero-size": "error",
    "element-count": "error",
    "data-type": "error",
    "same-data-type": "error",
    "same-sizes": "error",
    "step-scalar": "error",
    "total-size": "error",
    "alignment": "error",
    "flags": "error",
    "hyperparameter": "error",
    "binding-size": "error",
    "binding-offset-alignment": "error",
    "alias": "error",
    "output-overlap": "error",
    "training-step-range": "error",
    "training-step-zero": "warning",
    "epsilon-underflow": "warning",
}


def base_dict(data_type: str = "FLOAT32", numel: int = 1024, *, bindings: bool = True) -> dict[str, Any]:
    """A valid descriptor as a JSON object (packed, 4-d, in place, step 1)."""
    esize = {"FLOAT32": 4, "FLOAT16": 2}[data_type]
    nbytes = (numel * esize + 3) // 4 * 4
    d: dict[str, Any] = {
        "operator": "ADAM_OPTIMIZER",
        "feature_level": "3_0",
        "LearningRate": 0.001,
        "Beta1": 0.9,
        "Beta2": 0.999,
        "Epsilon": 1e-8 if data_type == "FLOAT32" else 1e-4,
    }
    for name in TENSORS:
        if name == "TrainingStepTensor":
            d[name] = {"DataType": "UINT32", "Sizes": [1, 1, 1, 1], "TotalTensorSizeInBytes": 4}
        else:
            d[name] = {"DataType": data_type, "Sizes": [1, 1, 1, numel], "TotalTensorSizeInBytes": nbytes}
    if bindings:
        d["Bindings"] = {
            name: {"Buffer": BUFFERS[name], "Offset": 0, "Size": d[name]["TotalTensorSizeInBytes"]}
            for name in TENSORS
        }
    d["TrainingStepValue"] = 1
    return d


def mutated(d: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``d`` with dotted-path changes: ``mutated(d, **{"GradientTensor.Flags": 2})``."""
    out = copy.deepcopy(d)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = out
        for key in parents:
            node = node[key]
        node[last] = value
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``dml-optim *argv`` in-process: (exit status, stdout, stderr)."""
    from dml_optim.cli import main

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse --help / usage errors
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return rc, out, err


_EXPECT_RE = re.compile(r'"expect"\s*:\s*(\{[^{}]*\})', re.S)


def corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.json"))


def read_expect(path: Path) -> dict[str, Any]:
    """A corpus file's ``expect`` object (read textually when the file is not JSON on purpose)."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)["expect"]
    except ValueError:
        match = _EXPECT_RE.search(text)
        if match is None:
            raise AssertionError(f"{path.name}: no expect object") from None
        return json.loads(match.group(1))
