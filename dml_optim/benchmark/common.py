"""What every benchmark row shares: the text of a failed measurement, and a clean device between rows."""

from __future__ import annotations

import gc

import torch

__all__ = ["error_text", "free"]


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
