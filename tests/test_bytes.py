"""The audit's byte counter (issue 34, item 1) against steps whose traffic is computed here by hand.

The rule (dml_optim/audit.py): per op that does work, each distinct tensor it
reads and each tensor it writes; an in-place op's ``self`` both, an ``out=``
argument written only, a returned tensor written.
"""

from __future__ import annotations

import pytest
import torch

import dml_optim
from dml_optim.audit import audit_call, audit_step, op_bytes

N = 4096 * 3 + 100  # (not a whole number of anything)


def _param(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    p.grad = torch.randn(n, generator=g)
    return p


def test_the_counting_rule_on_single_ops():
    n = 1000
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    add_out = torch.ops.aten.add.out
    assert op_bytes(add_out, (a, a), {"out": out}, out) == (4 * n, 4 * n)  # a read once; out= written only
    assert op_bytes(torch.ops.aten.add_.Tensor, (a, b), {}, a) == (8 * n, 4 * n)  # in place: self read and written
    c = a * b
    assert op_bytes(torch.ops.aten.mul.Tensor, (a, b), {}, c) == (8 * n, 4 * n)  # a new tensor: written
    m = torch.amax(a.view(-1, 10), 1)
    assert op_bytes(torch.ops.aten.amax.default, (a.view(-1, 10), [1]), {}, m) == (4 * n, 4 * n // 10)
    assert op_bytes(torch.ops.aten.addcmul_.default, (a, b, b), {"value": 2.0}, a) == (8 * n, 4 * n)
    u8 = torch.empty(n, dtype=torch.uint8)
    assert op_bytes(torch.ops.aten.copy_.default, (u8, a), {}, u8) == (5 * n, n)  # (copy_ is in place)


def test_a_hand_computed_step():
    """``fn`` below moves, by hand: mul_ 8n, add.out 8n (a read once, out written), addcmul_ 8n + 4n,
    a new tensor a * b 12n: 40n bytes (24n read, 16n written), and allocates one tensor of 4n."""
    p = _param()
    opt = dml_optim.SGD([p], lr=0.1, backend="eager")
    a, b, out = torch.randn(N), torch.randn(N), torch.empty(N)

    def fn():
        a.mul_(2.0)
        torch.add(a, a, out=out)
        a.addcmul_(b, b, value=0.5)
        return a * b

    report = audit_call(opt, fn)
    assert report.total_ops == 4
    assert (report.bytes_read, report.bytes_written) == (24 * N, 16 * N)
    assert report.bytes_moved == 40 * N and report.fallback_bus_bytes == 0
    assert report.allocations == 1 and report.allocated_bytes == 4 * N


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_fp32_eager_adamw_step_moves_what_its_ops_say(weight_decay):
    """AdamW's eager rule, per element: x *= decay (8; not with weight_decay 0), m *= beta1 (8),
    m += (1 - beta1) g (12), v *= beta2 (8), v += (1 - beta2) g g (12: g read once),
    sqrt(v, out=s) (8), s += eps (8), x += -step m / s (16): 80 (72) bytes; the least any step moves
    is 28 (x, m, v read and written, g read)."""
    p = _param()
    opt = dml_optim.AdamW([p], lr=1e-3, weight_decay=weight_decay, backend="eager")
    opt.step()
    report = audit_step(opt)
    expected = 80 if weight_decay else 72
    assert report.bytes_moved == expected * N, report.format()
    assert report.least_bytes == 28 * N
    assert report.scratch_bytes == 4 * N  # the full-size scratch of sqrt(v) + eps
    assert report.per_param(report.bytes_moved) == expected


def test_torch_optim_fallbacks_count_twice():
    """torch.optim.AdamW (foreach) lerps the first moment: lerp_ falls back on DirectML, its 12 bytes per
    element (m, g read, m written) cross the bus too."""
    p = _param()
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()
    report = audit_step(opt)
    assert [op for op, _ in report.fallbacks] == ["aten::lerp_.Scalar"]
    assert report.fallback_bus_bytes == 12 * N
    assert report.bytes_with_fallbacks == report.bytes_moved + 12 * N
    assert report.least_bytes == 28 * N and report.scratch_bytes == 0
    d = report.to_dict()
    assert d["bytes_with_fallbacks_per_param"] == pytest.approx(d["bytes_moved_per_param"] + 12)


def test_the_fp32_eager_step_keeps_its_scratch_within_the_bound_on_directml(monkeypatch):
    """On :data:`~dml_optim.backends.eager.PLAIN_CHUNK_DEVICES` (DirectML; the CPU here, patched in) a buffer
    whose full-size scratch would be over the bound runs its rule in chunks: the bound lowered to N bytes,
    AdamW's one scratch tensor (4 bytes per element) makes 4 chunks of 8 ops, the same bytes moved as one
    call, nothing allocated, and the very same parameters and states."""
    from dml_optim.backends import eager

    def run():
        p = _param()
        opt = dml_optim.AdamW([p], lr=1e-3, backend="eager")
        opt.step()
        return p, opt, audit_step(opt)

    p_full, opt_full, full = run()
    monkeypatch.setattr(eager, "PLAIN_CHUNK_DEVICES", ("cpu",))
    monkeypatch.setattr(eager, "MIN_SCRATCH", N)
    p, opt, chunked = run()
    assert chunked.scratch_bytes <= N < full.scratch_bytes == 4 * N
    assert chunked.total_ops == 4 * full.total_ops == 32, chunked.format()
    assert chunked.bytes_moved == full.bytes_moved == 80 * N
    assert chunked.allocations == 0 and chunked.fallback_ops == 0 and chunked.host_syncs == 0
    assert torch.equal(p.detach(), p_full.detach())
    (a,), (b,) = opt.flat_buffers(), opt_full.flat_buffers()
    assert all(torch.equal(a.states[k], b.states[k]) for k in b.states)
