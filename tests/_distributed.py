"""What the multi-process tests (tests/test_distributed.py, tests/test_fsdp.py) share: a free port for the
rendezvous, the reason, if any, why a gloo process group cannot be made here, and the launch of the
workers with the check of their exit codes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


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


def run_job(script: str, world: int, out: Path, timeout_s: float, what: str) -> Path:
    """Run ``script --worker RANK WORLD PORT OUT`` as ``world`` processes on a free loopback port
    (once more if another process took the port in between); fail the test with every rank's log
    unless each exited 0 and wrote ``OUT/done.rankN``.  Returns ``out``."""
    codes, logs = _launch(script, world, out, timeout_s, what)
    if codes != [0] * world and any("address already in use" in log.lower() for log in logs):
        codes, logs = _launch(script, world, out, timeout_s, what)
    ok = codes == [0] * world and all((out / f"done.rank{r}").exists() for r in range(world))
    assert ok, "worker failed:\n" + "\n".join(
        f"--- rank {r} (exit {c})\n{log[-4000:]}" for r, (c, log) in enumerate(zip(codes, logs)))
    return out


def _launch(script: str, world: int, out: Path, timeout_s: float, what: str) -> tuple[list[int], list[str]]:
    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    port = free_port()
    logs = [out / f"worker{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:  # a file, not a pipe: a full pipe would block a rank
            procs.append(subprocess.Popen([sys.executable, script, "--worker", str(r), str(world), str(port), str(out)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {what} job did not finish in {timeout_s} s")
    return [p.returncode for p in procs], [log.read_text() for log in logs]
