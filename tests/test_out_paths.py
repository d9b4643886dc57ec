"""``--out``: a path the command cannot write is a usage error (one line, status 2) before any work.

``compare --out`` names a folder and ``bench --out`` a file; a path through an
existing file is refused before anything is measured (``tests/test_cli.py``
holds the other usage errors of every command).
"""

import pytest

from dml_optim.cli import main


@pytest.mark.parametrize("argv", [
    ["compare", "--steps", "2", "--out", "{file}"],
    ["bench", "--quick", "--out", "{file}/sub/result.json"],
])
def test_an_unusable_out_path_is_a_usage_error_before_any_work(tmp_path, capsys, argv):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main([a.replace("{file}", str(blocker)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--out" in err[0]
