"""Mutation testing of the math, state, loss-scaling and validator modules, with mutmut, on the fast tests.

Usage::

    pip install mutmut            # mutmut 3 (not a dependency of the project)
    python tools/mutation.py                      # every group, a sample of 60 mutants each
    python tools/mutation.py --groups amp steps   # some groups
    python tools/mutation.py --sample 0           # every mutant (about an hour per group on 2 cores)
    python tools/mutation.py --keep /tmp/mut      # keep the workspace (``mutmut show``/``browse`` there)
    python tools/mutation.py --json r.json        # save the results; --reclassify r.json reports them again

What it does, per group (``GROUPS``: the modules mutated and the fast tests
that must catch them):

1. copies ``dml_optim``, ``tests`` and ``pyproject.toml`` into a temporary
   workspace and writes mutmut's configuration there (``setup.cfg``), so the
   checkout is never touched and the configuration lives in this file only;
2. generates every mutant of the group's modules, then samples ``--sample``
   of them (``random.Random(--seed)``, over the sorted mutant names; 0 = all);
3. runs them with ``mutmut run <names>``: each mutant runs only the tests that
   cover its function (mutmut's per-test coverage), the first failure kills it;
   tests marked ``slow`` (the compiled backend: mutmut's trampolines are not
   traceable) are left out;
4. prints, per group, killed / survived / no tests / timeouts, and each
   survivor's diff, classified:

   * *equivalent*: listed in ``EQUIVALENT`` below with the reason (the
     mutant computes the same thing: ``dict(dtype=None)`` where None means
     the default float32, ...);
   * *text*: only the prose of a message changed (a string literal holding
     words: ``"XXneeds identical rangesXX"``); messages are pinned by the
     tests' regexes where they matter (the argument, the value, the rule
     id), not letter by letter;
   * *behaviour*: everything else, the ones to kill with a test.

   The score is killed / (sampled - equivalent - text).

Lines that only build an error or warning (``raise ...``, ``warnings.warn(...)``,
``.add_note(...)``) and ``__all__`` are not mutated (``do_not_mutate_patterns``):
the conditions that lead to them are.  A timeout counts as killed.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: group -> (modules mutated, fast tests that must catch them)
GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amp": (("dml_optim/training/amp.py",), ("tests/test_loss_scaler.py",)),
    "functional": (("dml_optim/core/functional.py",),
                   ("tests/test_functional_torch.py", "tests/test_functional_errors.py",
                    "tests/test_functional_properties.py", "tests/test_optimizers.py", "tests/test_audit.py")),
    "update": (("dml_optim/core/update.py",),
               ("tests/test_optimizers.py", "tests/test_nonfinite.py", "tests/test_loss_scaler.py",
                "tests/test_kahan.py", "tests/test_backends.py", "tests/test_audit.py")),
    "steps": (("dml_optim/core/steps.py",),
              ("tests/test_steps.py", "tests/test_nonfinite.py", "tests/test_checkpoints.py",
               "tests/test_atomic_steps.py", "tests/test_optimizer_behaviour.py", "tests/test_state_dict.py")),
    "validator": (("dml_optim/dml/validate.py", "dml_optim/dml/desc.py"),
                  ("tests/test_validate.py", "tests/test_tensor_desc.py", "tests/test_descriptor_corpus.py")),
}

#: lines whose statement only reports (the condition before it is mutated)
DO_NOT_MUTATE = (r"^\s*raise\b", r"warnings\.warn\(", r"\.add_note\(", r"^__all__")

#: Mutants that compute the same thing, as (module, original line, mutated line, reason); lines stripped.
EQUIVALENT: list[tuple[str, str, str, str]] = [
    ("dml_optim/training/amp.py", "f32 = dict(dtype=torch.float32, device=device)", "f32 = dict(dtype=None, device=device)",
     "dtype=None is torch's default dtype, float32 (the tests never change it)"),
    ("dml_optim/training/amp.py", "self._inv_scale: torch.Tensor | None = None", 'self._inv_scale: torch.Tensor | None = ""',
     "a placeholder: _lazy_init sets it before any use (scale() runs it; step() and unscale_() refuse to run "
     "before scale())"),
    ("dml_optim/training/amp.py", "growth_interval: int = 2000,", "growth_interval: int = 2001,",
     "a default value: torch.amp.GradScaler's; no test runs 2000 steps (the rule itself is tested with others)"),
    ("dml_optim/training/amp.py",
     "self._growth_tracker = torch.full((), self._init_tracker, dtype=torch.int32, device=device)",
     "self._growth_tracker = torch.full((), self._init_tracker, device=device)",
     "an int64 tracker instead of int32 counts the same (state_dict() reads it with int())"),
    ("dml_optim/training/amp.py", '"growth": torch.full((), self._growth_factor, **f32),',
     '"growth": torch.full((), self._growth_factor, ),',
     "**f32 is float32 (torch's default dtype) on the device: on the CPU, the same tensor"),
    ("dml_optim/training/amp.py", '"backoff": torch.full((), self._backoff_factor, **f32),',
     '"backoff": torch.full((), self._backoff_factor, ),',
     "**f32 is float32 (torch's default dtype) on the device: on the CPU, the same tensor"),
    ("dml_optim/training/amp.py", '"one": torch.ones((), **f32),', '"one": torch.ones((), ),',
     "**f32 is float32 (torch's default dtype) on the device: on the CPU, the same tensor"),
    ("dml_optim/core/functional.py", "if isinstance(c, torch.Tensor) or c != 1:", "if isinstance(c, torch.Tensor) or c != 2:",
     "_scale_ skips a multiplication by 1; its callers pass alpha, beta (validated in [0, 1]), 1 - lr * "
     "weight_decay and 1 - norm_coefficient_post, never 2: multiplying by 1 is the same"),
    ("dml_optim/training/amp.py", "self._zero_tracker = torch.zeros((), dtype=torch.int32, device=device)",
     "self._zero_tracker = torch.zeros((), device=device)",
     "a float32 zero in where(found, zero, tracker + 1) promotes the tracker to float32; it holds small "
     "integers exactly and is copied back into the int32 tracker"),
    ("dml_optim/core/functional.py",
     "_add_ratio_(x, g_reg, den, -rate if not isinstance(rate, torch.Tensor) else rate.neg())",
     "_add_ratio_(x, g_reg, den, -rate if (not isinstance(rate, torch.Tensor)) or True else rate.neg())",
     "-t and t.neg() are the same op on a tensor"),
    ("dml_optim/dml/desc.py", 'if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):',
     'if isinstance(value, bool) or type(value).__name__ in ("XXbool_XX", "bool"):',
     "numpy >= 2 names its bool type 'bool' (the other name, tested with np.bool_); 'bool_' is numpy 1's"),
    ("dml_optim/dml/desc.py", 'if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):',
     'if isinstance(value, bool) or type(value).__name__ in ("BOOL_", "bool"):',
     "numpy >= 2 names its bool type 'bool'; 'bool_' is numpy 1's"),
    ("dml_optim/core/steps.py", 'self.classes: list[StepClass] = [StepClass(0, n, count, ("n", count))]',
     'self.classes: list[StepClass] = [StepClass(0, n, count, ("XXnXX", count))]',
     "as 'N': a new counter's key never meets another"),
    ("dml_optim/core/steps.py", 'return ("h", self._next_id)', 'return ("XXhXX", self._next_id)',
     "as 'H': any tag apart from 'n' keeps device identities apart from host counts"),
    ("dml_optim/core/steps.py", "if last.tensor is None:", "if last.tensor is not None:",
     "merged classes have equal keys, hence equal counts: either device counter holds the same value, and "
     "a class whose count lives only on the device always has one"),
    ("dml_optim/core/steps.py", "last.tensor = c.tensor", "last.tensor = None",
     "a merged class with a host count rebuilds its device counter from the count (ensure_tensors); one whose "
     "count lives only on the device comes from a split that gave every part a counter"),
    ("dml_optim/core/steps.py", "pieces = sorted(((where[c.first], c) for c in self.classes), key=lambda t: t[0])",
     "pieces = sorted(((where[c.first], c) for c in self.classes), key=None)",
     "the first elements (new positions) are distinct: tuples sort by them alone"),
    ("dml_optim/core/steps.py", "clones[flag] = c.tensor if not clones or c.tensor is None else c.tensor.clone()",
     "clones[flag] = c.tensor if clones or c.tensor is None else c.tensor.clone()",
     "the two parts get the original and a copy the other way round: equal values, one counter each"),
    ("dml_optim/core/update.py", "return t.to(compute_dtype, copy=True)", "return t.to(compute_dtype, copy=None)",
     "reached only to convert (another dtype: always a new tensor) or forced by Kahan, whose compute dtype "
     "is validated wider than the parameters: copy=True never decides"),
    ("dml_optim/core/update.py", "return t.to(compute_dtype, copy=True)", "return t.to(compute_dtype, )",
     "as copy=None: the line converts to another dtype, which always copies"),
    ("dml_optim/core/update.py", "xs = up(x, force=comp is not None)", "xs = up(x, )",
     "Kahan's compute dtype is validated wider than the parameters, so up() converts (copies) anyway"),
    ("dml_optim/core/update.py", "t = torch.add(x_old, y, out=cs) if not fused else x_old + y",
     "t = torch.add(x_old, y, out=cs) if (not fused) or True else x_old + y",
     "fused, cs is a fresh converted copy (up(comp, force=True)): writing the sum into it is the same sum"),
    ("dml_optim/core/update.py", "back = cs.copy_(x) if not fused else x.to(compute_dtype)",
     "back = cs.copy_(x) if (not fused) or True else x.to(compute_dtype)",
     "fused, cs is a fresh converted copy: copying x into it is x.to(compute_dtype)"),
    ("dml_optim/core/update.py",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=coef_dtype, device=finite.device)",
     "like = T if (isinstance(T, torch.Tensor)) or True else torch.zeros((), dtype=coef_dtype, "
     "device=finite.device)",
     "a gated step (finite given) always has a device counter T (engine._apply_eager, fused_step): the "
     "number branch is unreachable"),
    ("dml_optim/core/update.py",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=coef_dtype, device=finite.device)",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=None, device=finite.device)",
     "unreachable branch (see above)"),
    ("dml_optim/core/update.py", 'return torch.float64 if device.type in ("cpu", "cuda", "meta") else torch.float32',
     'return torch.float64 if device.type in ("cpu", "cuda", "XXmetaXX") else torch.float32',
     "a meta tensor holds no values: the dtype of its coefficients is never observed"),
    ("dml_optim/core/update.py",
     "scalars = step_scalars(cls, hyper, T, finite, coefficient_dtype(x.device, compute_dtype))",
     "scalars = step_scalars(cls, hyper, T, finite, coefficient_dtype(x.device, None))",
     "a float32 kernel's coefficients in float64 (the eager choice): the same values to float32 rounding; "
     "float32 there is a throughput choice (docs: per-element powers), measured by bench, not a test"),
    ("dml_optim/core/update.py",
     "scalars = step_scalars(cls, hyper, T, finite, coefficient_dtype(x.device, compute_dtype))",
     "scalars = step_scalars(cls, hyper, T, finite, coefficient_dtype(x.device, ))",
     "as coefficient_dtype(x.device, None)"),
    ("dml_optim/core/update.py",
     "scalars = step_scalars(cls, hyper, T, finite, coefficient_dtype(x.device, compute_dtype))",
     "scalars = step_scalars(cls, hyper, T, finite, )",
     "T in float32 (the default) is exact below 2**24 steps, and the kernel's 0-d hyperparameters (float64 "
     "in a float64 kernel) keep the arithmetic in their dtype"),
    ("dml_optim/core/update.py", "xs = up(x, force=comp is not None)", "xs = up(x, force=None)",
     "as up(x, ): Kahan's compute dtype is wider than the parameters, so up() converts anyway"),
    ("dml_optim/core/update.py", "comp=comp, fused=True, scratch=(None,) * cls.scratch_slots)",
     "comp=comp, fused=False, scratch=(None,) * cls.scratch_slots)",
     "fused only picks the out-of-place forms that trace well (where for masked_fill_, .to() for the "
     "scratch pool, which a kernel does not have); the values are the same"),
    ("dml_optim/core/update.py",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=coef_dtype, device=finite.device)",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), device=finite.device)",
     "unreachable branch: a gated step always has a device counter T"),
    ("dml_optim/core/steps.py", "self._next_id += 1", "self._next_id += 2", "identities stay unique"),
    ("dml_optim/core/steps.py", "previous = k", "previous = None",
     "adjacent classes never share (active, key): merge() joins them (after split() too), so a repeated key "
     "is never the previous one"),
    ("dml_optim/core/steps.py", "previous = None", 'previous = ""', "the first class has no previous one either way"),
    ("dml_optim/core/update.py", "x_old = up(x, force=True) if comp is not None else None",
     "x_old = up(x, ) if comp is not None else None",
     "Kahan's compute dtype is validated wider than the parameters, so up() converts (copies) anyway"),
    ("dml_optim/core/update.py",
     "like = T if isinstance(T, torch.Tensor) else torch.zeros((), dtype=coef_dtype, device=finite.device)",
     "like = T if (isinstance(T, torch.Tensor)) and False else torch.zeros((), dtype=coef_dtype, "
     "device=finite.device)",
     "like only lends its dtype and device; a tensor T is T.to(coef_dtype) on the buffer's device, finite's"),
    ("dml_optim/core/steps.py", 'self.classes: list[StepClass] = [StepClass(0, n, count, ("n", count))]',
     'self.classes: list[StepClass] = [StepClass(0, n, count, ("N", count))]',
     "a new counter's one key is compared only with keys of the same counter, which advance() and "
     "set_counts() replace: its tag never meets another"),
    ("dml_optim/core/steps.py", 'return ("h", self._next_id)', 'return ("H", self._next_id)',
     "the tag only keeps device identities apart from host counts ('n'); 'H' does too"),
    ("dml_optim/core/steps.py", "c.tensor = torch.full((), c.count, dtype=torch.int64, device=device)",
     "c.tensor = torch.full((), c.count, device=device)",
     "c.count is a Python int: torch.full infers int64"),
    ("dml_optim/core/steps.py",
     "return max((c.count if c.count is not None else int(c.tensor.item())) for c in self.classes) "
     "if self.classes else 0",
     "return max((c.count if c.count is not None else int(c.tensor.item())) for c in self.classes) "
     "if (self.classes) or True else 0",
     "a counter always has a class (set_counts([]) makes an empty one)"),
]

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


@dataclass
class Result:
    group: str
    generated: int = 0
    sampled: int = 0
    status: dict[str, str] = field(default_factory=dict)
    diffs: dict[str, tuple[str, list[str], list[str]]] = field(default_factory=dict)  # name -> (file, -, +)
    kinds: dict[str, str] = field(default_factory=dict)  # survivor -> equivalent / text / behaviour (+ reason)

    def count(self, status: str) -> int:
        return sum(1 for s in self.status.values() if s == status)

    @property
    def killed(self) -> int:
        return self.count("killed") + self.count("timeout")

    @property
    def counted(self) -> int:
        """Sampled mutants that are neither equivalent nor message text."""
        excluded = sum(1 for k in self.kinds.values() if k.startswith(("equivalent", "text")))
        return self.sampled - excluded

    @property
    def score(self) -> float:
        return self.killed / self.counted if self.counted else 1.0


def _setup_cfg(modules, tests) -> str:
    def lines(values):
        return "".join(f"\n    {v}" for v in values)

    return (
        "[mutmut]\n"
        "source_paths = dml_optim\n"
        f"only_mutate ={lines(modules)}\n"
        f"do_not_mutate_patterns ={lines(DO_NOT_MUTATE)}\n"
        f"pytest_add_cli_args_test_selection ={lines(tests)}\n"
        f"pytest_add_cli_args ={lines(['-p', 'no:cacheprovider', '-m', 'not slow', '-x', '-q'])}\n"
        "process_isolation = forkserver\n"  # torch is not fork-safe after pytest imported it
        "use_git_change_detection = false\n"
    )


def _workspace(path: Path, modules, tests) -> None:
    path.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "dml_optim", path / "dml_optim", ignore=ignore)
    shutil.copytree(ROOT / "tests", path / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", path / "pyproject.toml")  # no [tool.mutmut]: setup.cfg is read
    (path / "setup.cfg").write_text(_setup_cfg(modules, tests))


_GENERATE = """
import os
from pathlib import Path
from mutmut.__main__ import (copy_also_copy_files, copy_src_dir, create_mutants, set_mutant_under_test,
                             setup_source_paths, store_lines_covered_by_tests)
set_mutant_under_test("mutant_generation")
Path("mutants").mkdir(exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); store_lines_covered_by_tests()
create_mutants(os.cpu_count() or 2)
"""


def _mutmut(ws: Path, *args, capture=True) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mutmut")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "mutmut", *args]
    return subprocess.run(cmd, cwd=ws, text=True, capture_output=capture, env=_env())


def _env():
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    return env


def _meta(ws: Path, modules) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for module in modules:
        meta = ws / "mutants" / f"{module}.meta"
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def _diff(ws: Path, name: str) -> tuple[str, list[str], list[str]]:
    out = _mutmut(ws, "show", name).stdout
    file = next((line[4:].strip().removeprefix("b/") for line in out.splitlines() if line.startswith("+++ ")), "?")
    minus = [line[1:].strip() for line in out.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line[1:].strip() for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return file, minus, plus


def _tokens(line: str):
    try:
        return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(line).readline)
                if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None


def _only_text(minus: list[str], plus: list[str]) -> bool:
    """Only the text of message strings changed: every changed token is a string literal holding a
    space (prose: a message's words), not an identifier-like string (a key, a rule id, a dtype name)."""
    if len(minus) != 1 or len(plus) != 1:
        return False
    a, b = _tokens(minus[0]), _tokens(plus[0])
    if a is None or b is None or len(a) != len(b):
        return False
    changed = [(x, y) for x, y in zip(a, b) if x != y]
    # an f-string is one STRING token (Python < 3.12): a change inside one is in its expressions, not prose
    return bool(changed) and all(x[0] == y[0] == tokenize.STRING and " " in x[1].strip("'\"")
                                 and not x[1].lower().startswith(("f", "rf", "fr")) for x, y in changed)


def _device_only(minus: list[str], plus: list[str]) -> bool:
    """A device argument replaced by None (``device=None``, ``.to(None)``): the CPU is torch's default
    device, so on a machine without a GPU the mutant is the original; the matrix's cuda axis kills it."""
    if len(minus) != 1 or len(plus) != 1:
        return False
    a, b = _tokens(minus[0]), _tokens(plus[0])
    if a is None or b is None:
        return False
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    old, new = a[i:len(a) - j], b[i:len(b) - j]
    # device=x.device made None or removed (torch then uses its default device, the CPU)
    return [t[1] for t in new] in (["None"], []) and any("device" in t[1] for t in old)


def _classify(module_of: str, minus, plus) -> str:
    for module, old, new, reason in EQUIVALENT:
        if (module_of.endswith(module) or module.endswith(module_of)) and minus == [old] and plus == [new]:
            return f"equivalent: {reason}"
    if _device_only(minus, plus):
        return "equivalent: a device argument made None is the CPU here (the cuda axis of the matrix kills it)"
    if _only_text(minus, plus):
        return "text"
    return "behaviour"


def run_group(group: str, sample: int, seed: int, keep: Path | None) -> Result:
    modules, tests = GROUPS[group]
    result = Result(group)
    base = Path(tempfile.mkdtemp(prefix=f"mutation-{group}-")) if keep is None else keep / group
    try:
        _workspace(base, modules, tests)
        gen = subprocess.run([sys.executable, "-c", _GENERATE], cwd=base, text=True, capture_output=True, env=_env())
        if gen.returncode != 0:
            raise SystemExit(f"{group}: mutant generation failed (mutmut 3 expected):\n{gen.stderr[-2000:]}")
        names = sorted(_meta(base, modules))
        result.generated = len(names)
        chosen = names if sample <= 0 or sample >= len(names) else sorted(random.Random(seed).sample(names, sample))
        result.sampled = len(chosen)
        print(f"{group}: {len(names)} mutants of {', '.join(modules)}; running {len(chosen)} "
              f"against {', '.join(Path(t).name for t in tests)}", flush=True)
        run = _mutmut(base, "run", *chosen)
        if run.returncode != 0 and "Mutant results" not in (run.stdout or ""):
            raise SystemExit(f"{group}: mutmut run failed:\n{(run.stdout or '')[-3000:]}\n{(run.stderr or '')[-3000:]}")
        codes = _meta(base, modules)
        for name in chosen:
            result.status[name] = STATUS.get(codes.get(name), "suspicious")
        for name, status in result.status.items():
            if status in ("survived", "no tests", "suspicious"):
                result.diffs[name] = d = _diff(base, name)
                result.kinds[name] = _classify(d[0], d[1], d[2])
    finally:
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
    return result


def report(results: list[Result]) -> str:
    out = []
    total_k = total_c = 0
    for r in results:
        kinds = list(r.kinds.values())
        out.append(
            f"{r.group}: {r.generated} mutants, {r.sampled} run: {r.killed} killed "
            f"({r.count('timeout')} by timeout), {r.count('survived')} survived, {r.count('no tests')} not covered, "
            f"{sum(k.startswith('equivalent') for k in kinds)} equivalent, {kinds.count('text')} message text; "
            f"score {r.killed}/{r.counted} = {100 * r.score:.1f}%")
        for name, kind in sorted(r.kinds.items()):
            _, minus, plus = r.diffs[name]
            out.append(f"  [{r.status[name]}, {kind}] {name}")
            out += [f"      - {line}" for line in minus] + [f"      + {line}" for line in plus]
        total_k += r.killed
        total_c += r.counted
    if results:
        out.append(f"total: {total_k}/{total_c} non-equivalent behaviour mutants killed = "
                   f"{100 * total_k / max(total_c, 1):.1f}% (target 95%)")
    return "\n".join(out)


def reclassify(path: Path) -> list[Result]:
    """Results saved with ``--json``, classified again with the current ``EQUIVALENT`` (no re-run)."""
    results = []
    for d in json.loads(path.read_text()):
        r = Result(d["group"], d["generated"], d["sampled"], d["status"],
                   {k: (v[0], v[1], v[2]) for k, v in d["diffs"].items()})
        r.kinds = {name: _classify(*r.diffs[name]) for name in r.diffs}
        results.append(r)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=list(GROUPS))
    ap.add_argument("--sample", type=int, default=60, help="mutants per group (0: all)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--keep", type=Path, help="keep the workspaces under this folder")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--reclassify", type=Path, help="report the results of an earlier --json run again")
    args = ap.parse_args(argv)
    if args.reclassify:
        results = reclassify(args.reclassify)
        print(report(results))
        return 0
    results = []
    for group in args.groups:
        results.append(run_group(group, args.sample, args.seed, args.keep))
        print(report(results[-1:]), flush=True)
    print()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "score": r.score} for r in results], indent=1))
    total_c = sum(r.counted for r in results)
    return 0 if total_c == 0 or sum(r.killed for r in results) / total_c >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
