"""What the long-running commands print while they work, and where they write files.

:class:`Progress` is the one progress display of ``train``, ``audit``,
``compare`` and ``bench``.  On a terminal whose width is known it is a tqdm
bar.  Everywhere else (a pipe, a log file, a pseudo-terminal with no width
set, as under ``script`` or some CI runners) it prints a plain line each time
another 10% of the work is done, and after the last unit, so progress shows in
logs too.  Commands print their header (device, configuration) before they
create a :class:`Progress`, and flush it, so the header always comes first.

:data:`DEFAULT_OUTPUT_DIR` is the folder, relative to the working directory,
that commands write their files to unless ``--out`` says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

__all__ = ["DEFAULT_OUTPUT_DIR", "Progress", "terminal_width"]

#: Where ``compare`` and ``bench`` write their files by default (``.gitignore`` lists it).
DEFAULT_OUTPUT_DIR = Path("dml-optim-out")


def terminal_width(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it is not a terminal or the width is unknown.

    A pseudo-terminal nobody has sized reports 0 columns; then ``COLUMNS``
    decides, if it is set.
    """
    try:
        if not stream.isatty():
            return 0
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no fileno (a StringIO), a closed stream
        return 0
    if columns > 0:
        return columns
    env = os.environ.get("COLUMNS", "")
    return int(env) if env.isdigit() else 0


class Progress:
    """Progress of ``total`` units of work, reported with :meth:`update` (the number done so far).

    Args:
        label: what is running, printed at the start of each line or bar.
        total: the number of units (>= 1).
        stream: where to print (standard output, or standard error when
            standard output carries JSON).
        unit: the name of one unit, e.g. ``"step"``.

    :attr:`every` says how often a caller that cannot afford to report every
    unit (reading a loss costs a host sync) should call :meth:`update`: 1% of
    the units under a bar, 10% for plain lines.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO, unit: str = "step"):
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"Progress: total must be a positive integer, got {total!r}")
        self.label, self.total, self.stream, self.unit = label, total, stream, unit
        self._printed = 0
        width = terminal_width(stream)
        self.bar = None
        if width:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit=unit, file=stream, ncols=width, leave=True)
        self.every = max(1, total // 100) if self.bar is not None else max(1, total // 10)

    def update(self, done: int, note: str = "") -> None:
        """``done`` units of ``total`` are finished; ``note`` (e.g. the current loss) is shown beside."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            return
        if done < self.total and done - self._printed < self.every:
            return
        self._printed = done
        line = f"{self.label}: {self.unit} {done}/{self.total} ({100 * done // self.total}%)"
        print(f"{line}  {note}" if note else line, file=self.stream, flush=True)

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without breaking the bar."""
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar (plain lines need no ending)."""
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
