"""Every ```python block of the documentation site's pages (``docs/**/*.md``) runs as written.

The blocks are collected from the pages when the tests are collected, not copied here, so a new
example runs without editing this file.  The rules are the README's (tests/test_readme.py): each block
runs in its own interpreter on the CPU; a ``# -> TEXT`` comment states what that line prints; a block
that must not run is preceded, on the line right before its fence, by ``<!-- not-run: why -->`` (a
fragment of a multi-process script, ...) or ``<!-- needs torch>=X.Y: why -->``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_readme import python_blocks, run_block

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [(f"docs/{page.relative_to(DOCS).as_posix()}:{line}", code, reason)
          for page in PAGES for line, code, reason in python_blocks(page.read_text(encoding="utf-8"))]
#: Fragments marked not-run are the exception: today the distributed page's pieces of a torchrun script.
MAX_NOT_RUN = 6


def test_the_pages_have_examples_and_few_fragments():
    where = {w.split(":")[0] for w, *_ in BLOCKS}
    assert "docs/index.md" in where
    # every optimizer page has a runnable example
    for page in sorted((DOCS / "optimizers").glob("*.md")):
        assert any(w.startswith(f"docs/optimizers/{page.name}:") and r is None for w, _, r in BLOCKS), page.name
    fragments = [w for w, _, r in BLOCKS if r is not None and not r.startswith("needs torch>=")]
    assert len(fragments) <= MAX_NOT_RUN, fragments


@pytest.mark.parametrize("where,code,reason", BLOCKS, ids=[w for w, *_ in BLOCKS])
def test_docs_python_block_runs_as_written(where, code, reason, tmp_path):
    run_block(where, code, reason, tmp_path)
