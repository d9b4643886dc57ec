"""What the multi-process tests (tests/test_distributed.py, tests/test_fsdp.py) share: a free port for the
rendezvous and the reason, if any, why a gloo process group cannot be made here."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_missing() -> str | None:
    """Why a gloo process group cannot be made with this torch build, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    return None
