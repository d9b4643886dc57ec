"""``python -m dml_optim.standin``: builds the stand-in DirectML device ahead of time (CI).

Prints the device and the build folder; exit status 1 with one line saying why when unavailable."""

from __future__ import annotations

import sys


def main() -> int:
    from dml_optim import standin

    ok, why = standin.available(load=True)
    if not ok:
        print(f"dml_optim.standin unavailable: {why}")
        return 1
    print(f"device: {standin.device()}")
    print(f"cache: {standin.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
