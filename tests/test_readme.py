"""The README and the user documentation it links to: a Quick start of exactly two commands (the second
is the one CI runs), with the torch choice before them; every Python block of the README runs as
written (the site's: tests/test_docs_examples.py, with the same rules); the facts they state hold,
each checked on the page where it now lives (docs/, the site's pages).

Python blocks: every ```python block is run, as written, in its own interpreter
(on the CPU, with a timeout), so a new section's blocks are picked up without
editing this file.  A block that is deliberately partial is preceded by an
HTML comment naming why, on the line right before its fence::

    <!-- not-run: needs two processes (torchrun) -->

A ``# -> TEXT`` comment at the end of a line states what the block prints
there; the printed lines must equal those, in order.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TEST_COMMAND_FILE = ROOT / ".ci" / "test-command"
CI_RUN = ROOT / ".ci" / "run"


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next level-1 or level-2 heading outside a code fence."""
    body, inside, fenced = [], False, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = not fenced and re.match(r"#{1,2}\s", line)
        if heading and inside:
            break
        if inside:
            body.append(line)
        if heading and line[2:].strip() == title and line.startswith("## "):
            inside = True
    assert inside, f"README.md has no '## {title}' section"
    return "\n".join(body) + "\n"


def _commands(section: str) -> list[str]:
    """Non-empty, non-comment lines of the fenced code blocks in ``section``."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.M | re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _ci_test_command() -> str:
    lines = [line for line in TEST_COMMAND_FILE.read_text().splitlines() if line.startswith("TEST_COMMAND:")]
    assert len(lines) == 1, f"{TEST_COMMAND_FILE} must have exactly one TEST_COMMAND line"
    return lines[0].split(":", 1)[1].strip()


def test_section_parser_on_a_sample():
    sample = "# T\n## Quick start\ntext\n```bash\na && b\n```\n```bash\n# comment\nc\n```\n## Next\n```bash\nd\n```\n"
    assert _commands(_section(sample, "Quick start")) == ["a && b", "c"]


def test_quick_start_has_exactly_two_commands():
    commands = _commands(_section(README.read_text(), "Quick start"))
    assert len(commands) == 2, commands


def test_first_command_installs_and_runs_the_main_job():
    first = _commands(_section(README.read_text(), "Quick start"))[0]
    assert first.startswith("pip install ")
    assert first.endswith("dml-optim train")


def test_second_command_is_the_ci_test_command():
    second = _commands(_section(README.read_text(), "Quick start"))[1]
    assert second == _ci_test_command()
    assert second == 'pip install -e ".[test]" && python -m pytest'


def test_ci_run_executes_the_test_command_file():
    script = CI_RUN.read_text()
    # .ci/run extracts TEST_COMMAND from .ci/test-command and runs it with bash -c
    assignment = next((line for line in script.splitlines() if line.startswith("test_command=")), None)
    assert assignment is not None, ".ci/run has no 'test_command=' line"
    assert ".ci/test-command" in assignment
    assert re.search(r'^bash -c "\$test_command"\s*$', script, flags=re.M), ".ci/run does not run $test_command"
    if shutil.which("bash") is None:
        pytest.skip("bash is not available to evaluate .ci/run's extraction line")
    extracted = subprocess.run(["bash", "-c", f'{assignment}\nprintf %s "$test_command"'],
                               cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert extracted.returncode == 0, extracted.stderr
    assert extracted.stdout == _ci_test_command()


def _page(name: str) -> str:
    """The text of the site's page ``docs/<name>``."""
    return (DOCS / name).read_text()


def test_readme_links_to_files_that_exist_or_are_generated():
    text = README.read_text()
    generated = {"docs/divergence.png", "docs/compare-report.md"}  # written by `dml-optim compare` (another task)
    for target in re.findall(r"\]\(((?!https?://|#)[^)]+)\)", text):
        assert (ROOT / target.split("#")[0]).exists() or target in generated, f"README links to missing {target}"
    # the README links into every part of the site (the site's own links: `mkdocs build --strict`)
    for page in ("docs/index.md", "docs/install.md", "docs/cli.md", "docs/api.md", "docs/performance.md",
                 "docs/limitations.md", "docs/contributing.md"):
        assert f"]({page})" in text, page
    for page, path in (("guide/distributed.md", "examples/ddp_train.py"),
                       ("directml.md", "dml_optim/data/shapes/descriptors/valid-minimal.json"),
                       ("directml.md", "dml_optim/data/shapes/descriptors/many-violations.json")):
        assert path in _page(page) and (ROOT / path).exists(), path
    # models are named (`--model resnet50`), not paths into a checkout's old shapes/ folder
    for path in (README, *DOCS.rglob("*.md")):
        assert not re.search(r"(?<!data/)shapes/(models|descriptors)/", path.read_text()), path


def test_swap_example_runs():
    # the README's "Replace torch.optim.Adam" snippet, executed as written (on the best device here)
    section = _section(README.read_text(), "Replace `torch.optim.Adam`")
    code = re.search(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    assert code, "no python block in the 'Replace torch.optim.Adam' section"
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    opt = namespace["opt"]
    assert type(opt).__name__ == "AdamW" and opt.state_dict()["state"][0]["step"].item() == 10


def test_readme_states_the_epsilon_placement_and_cites_the_directml_issues():
    text = README.read_text()
    for issue in ("604", "626", "675"):
        assert f"https://github.com/microsoft/DirectML/issues/{issue}" in text
    assert "equal only when epsilon = 0" in _page("guide/optimizers.md")
    directml = _page("directml.md")
    assert "torch==2.4.1" in directml and "WSL" in directml and "LD_LIBRARY_PATH" in directml
    assert "torch==2.4.1" in _page("install.md") and "WSL" in _page("install.md")
    assert "HYPOTHESIS_PROFILE=fuzz python -m pytest tests -k fuzz" in _page("contributing.md")


# ----------------------------------------------------------------------------
# Quick start: the torch choice comes before the first command (issue item 3)
# ----------------------------------------------------------------------------

def test_quick_start_states_the_torch_choice_before_the_first_command():
    section = _section(README.read_text(), "Quick start")
    before = section[:section.index("```")]
    for needle in ("Windows", "CPU-only", "torch-directml", "Linux", "CUDA",
                   "pip install torch --index-url https://download.pytorch.org/whl/cpu"):
        assert needle in before, f"the Quick start names {needle!r} only after its first command (or not at all)"


# ----------------------------------------------------------------------------
# every ```python block runs as written
# ----------------------------------------------------------------------------

_FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(\S.*?)\s*-->\s*$")
#: ``<!-- needs torch>=2.6: why -->``: the block runs where torch is that new, and is skipped with ``why`` elsewhere.
_NEEDS_TORCH = re.compile(r"<!--\s*needs torch>=(\d+)\.(\d+):\s*(\S.*?)\s*-->\s*$")
#: Deliberately partial blocks are the exception: keep them few.
MAX_NOT_RUN = 2


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line number, code, not-run reason or None)`` of every ```python block of ``text``."""
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = _NOT_RUN.search(before)
        needs = _NEEDS_TORCH.search(before)
        if needs and _torch_version() < (int(needs.group(1)), int(needs.group(2))):
            reason = needs.expand(rf"needs torch>=\1.\2 ({needs.group(3)}); this is torch {torch.__version__}")
        else:
            reason = reason.group(1) if reason else None
        blocks.append((line, match.group(1), reason))
    return blocks


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def expected_output(code: str) -> list[str]:
    """The ``# -> TEXT`` comments of ``code``, in order."""
    return [m.group(1).strip() for m in re.finditer(r"#\s*->\s*(.*)$", code, flags=re.M)]


def test_block_parser_on_a_sample():
    sample = ("text\n```python\nprint(1)  # -> 1\n```\n<!-- not-run: needs a GPU -->\n```python\nx\n```\n"
              "```bash\nls\n```\n")
    assert python_blocks(sample) == [(2, "print(1)  # -> 1\n", None), (6, "x\n", "needs a GPU")]
    gated = "<!-- needs torch>=99.0: a future API -->\n```python\ny\n```\n<!-- needs torch>=1.0: any -->\n```python\nz\n```\n"
    (_, _, far), (_, _, met) = python_blocks(gated)
    assert far.startswith("needs torch>=99.0 (a future API); this is torch ") and met is None
    assert expected_output("print(1)  # -> 1\nprint(2)\n") == ["1"]


_BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_and_few_partial_ones():
    assert len(_BLOCKS) >= 1  # the drop-in snippet; the guide's examples are the site's (tests/test_docs_examples.py)
    assert sum(reason is not None and not reason.startswith("needs torch>=") for *_, reason in _BLOCKS) <= MAX_NOT_RUN


def run_block(where: str, code: str, reason: str | None, tmp_path: Path) -> None:
    """Run ``code`` (the block at ``where``, e.g. ``README.md:12``) as a script in its own interpreter on the CPU;
    its output must be what its ``# -> TEXT`` comments say.  Skips, with the reason, a block marked not to run."""
    if reason is not None:
        pytest.skip(f"{where} is marked not-run: {reason}")
    script = tmp_path / (re.sub(r"\W+", "_", where) + ".py")
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # on the CPU, whatever the machine has
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-3000:]}"
    expected = expected_output(code)
    if expected:
        assert proc.stdout.splitlines() == expected, f"{where} printed {proc.stdout!r}"


@pytest.mark.parametrize("line,code,reason", _BLOCKS, ids=[f"README.md:{line}" for line, *_ in _BLOCKS])
def test_python_block_runs_as_written(line, code, reason, tmp_path):
    run_block(f"README.md:{line}", code, reason, tmp_path)


# ----------------------------------------------------------------------------
# facts the documentation states (issue item 8), on the pages where they live
# ----------------------------------------------------------------------------

def test_loss_scaling_says_the_model_must_be_fp16():
    section = _page("guide/loss-scaling.md")
    assert "master_weights=True` needs FP16" in section
    code = _FENCE.search(section).group(1)
    assert "float16" in code and "master_weights=True" in code and "import dml_optim" in code


def test_audit_step_snippet_takes_a_warm_up_step_first():
    section = _page("guide/audit.md")
    assert "one-time" in section
    code = _FENCE.search(section).group(1)
    first, steady = expected_output(code)  # the first step's counts, then a steady step's
    assert first != "7 0" and steady == "7 0 0 0"


def test_hyperparameter_passing_is_described_as_it_is():
    import dml_optim

    text = " ".join(_page("guide/replacing-torch-optim.md").split())  # sentences, whatever the line breaks
    assert all("must be passed by keyword" not in p.read_text() for p in (README, *DOCS.rglob("*.md")))
    assert "`lr` may be passed by position" in text and "every other hyperparameter is keyword-only" in text
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for cls in (dml_optim.Adam, dml_optim.DmlAdam, dml_optim.Momentum):
        params = inspect.signature(cls).parameters.values()
        assert [p.name for p in params if p.kind in positional] == ["params", "lr"], cls
    assert "`AdamW`, `SGD` and `Adagrad` take torch's signatures, positional order" in text
    for cls in (dml_optim.AdamW, dml_optim.SGD, dml_optim.Adagrad):  # torch's positional order
        twin = getattr(torch.optim, cls.__name__)
        theirs = [p.name for p in inspect.signature(twin).parameters.values() if p.kind in positional]
        ours = [p.name for p in inspect.signature(cls).parameters.values() if p.kind in positional]
        assert ours == theirs, cls
    weight = torch.nn.Parameter(torch.zeros(2))
    assert dml_optim.Adam([weight], 1e-3).param_groups[0]["lr"] == 1e-3
    with pytest.raises(TypeError):
        dml_optim.Adam([weight], 1e-3, 0.9)


def test_mixed_precision_op_counts_are_the_measured_ones():
    from dml_optim.optimizers.registry import NAMES as OPTIMIZERS
    from dml_optim.job.train import TrainConfig, train

    limitations = _page("limitations.md")
    low, high = map(int, re.search(r"about (\d+) to (\d+) ops per flat buffer", limitations).groups())
    ops = {name: train(TrainConfig(optimizer=name, dtype="mixed", steps=3), device="cpu").audit["total_ops"]
           for name in OPTIMIZERS}
    assert min(ops.values()) == low and max(ops.values()) == high, ops


def test_ci_runs_a_second_torch_and_fails_on_an_empty_run():
    """Issue 22, item 7: CI runs the suite on the local 2.13 wheel and on the newest torch pip resolves;
    every pytest run goes through ``check``, which fails on pytest's exit 5 (no test ran) and on failures."""
    script = CI_RUN.read_text()
    assert "pip install -q --upgrade torch" in script  # the newest release (2.14.x today)
    runs = [line for line in script.splitlines() if re.search(r"(bash -c \"\$test_command\"|-m pytest)", line)
            and not line.lstrip().startswith(("#", "echo"))]
    assert len(runs) == 3, runs  # the README's command; the newest torch without `slow`; its Trainer tests
    assert script.count('check "$status"') == len(runs)  # every run is checked
    if shutil.which("bash") is None:
        pytest.skip("bash is not available to run .ci/run's check function")
    check = script[script.index("check() {"):script.index("\n}\n") + 3]
    for status, expected in ((0, 0), (5, 1), (1, 1), (2, 2)):
        got = subprocess.run(["bash", "-c", f"set -e\n{check}\ncheck {status} probe"], capture_output=True, text=True)
        assert got.returncode == expected, (status, got.stderr)
    assert (ROOT / ".ci" / "nightly").exists()  # torch 2.4.1 with torch-directml: the nightly-style job
