"""What every benchmark row shares: the text of a failed measurement, a clean device between rows, and cheap
garbage collection between repetitions."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

__all__ = ["error_text", "free", "young_garbage_only"]


def error_text(exc: BaseException) -> str:
    """``"Type: first line of the message"``: how a row records a failure and the run goes on."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def free(device: torch.device) -> None:
    """Collect garbage and return cached device memory, so the next row starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def young_garbage_only() -> Iterator[None]:
    """Inside, ``gc.collect()`` looks only at objects made inside (the older ones are frozen, ``gc.freeze``): a
    row that collects between repetitions pays milliseconds, not the whole heap's scan (a quarter of a second
    in a process that imported dynamo, e.g. the test suite)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
