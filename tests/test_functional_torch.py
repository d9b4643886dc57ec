"""The ``torch.optim`` equivalences of docs/design.md §2, used as independent oracles.

Each test runs ``dml_optim.core.functional`` and a ``torch.optim`` optimizer side by
side for 25 steps on the same random gradients, in float64, and compares the
parameters (and, where torch keeps the same quantity, the state) after every
step.
"""

from __future__ import annotations

import pytest
import torch

from dml_optim.core import functional as F
from tolerances import TOL

STEPS = 25
SHAPES = [(3, 4), (5,), ()]  # several tensors, a 0-d one included
# float64 on both sides, same formula up to operation order: the table's float64 entry.
# Largest relative difference observed over the 25 steps: 5.6e-14 (Adam), 6.9e-15
# (Momentum), 0 (Adagrad).
FLOAT64 = TOL[torch.float64]


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _gradients(seed: int):
    """An endless stream of random gradient lists (one tensor per shape)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _torch_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


def _assert_close(ours, theirs, what):
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, **FLOAT64, msg=lambda m, i=i: f"{what}[{i}]: {m}")


@pytest.mark.parametrize(
    ("lr", "lr_decay", "eps", "weight_decay"),
    [(0.1, 0.0, 1e-10, 0.0), (0.05, 0.01, 1e-3, 0.1), (1.0, 0.5, 0.0, 0.0)],
)
def test_adagrad_equals_torch_adagrad(lr, lr_decay, eps, weight_decay):
    """ONNX Adagrad with T counted from 0 = torch.optim.Adagrad(lr, lr_decay, eps, weight_decay)."""
    X = _params(0)
    H = [torch.zeros_like(x) for x in X]
    params = [x.clone().requires_grad_(True) for x in X]
    opt = torch.optim.Adagrad(params, lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay)
    for T, G in zip(range(STEPS), _gradients(1)):
        out = F.adagrad(lr, T, *X, *G, *H, decay_factor=lr_decay, epsilon=eps, norm_coefficient=weight_decay)
        X, H = list(out[: len(X)]), list(out[len(X) :])
        _torch_step(opt, params, G)
        _assert_close(X, [p.detach() for p in params], f"step {T} X")
        _assert_close(H, [opt.state[p]["sum"] for p in params], f"step {T} H")


@pytest.mark.parametrize(("alpha", "beta", "weight_decay"), [(0.9, 1.0, 0.0), (0.9, 0.7, 0.01), (0.5, 0.1, 0.1)])
def test_momentum_standard_equals_torch_sgd(alpha, beta, weight_decay):
    """ONNX Momentum standard (T from 0) = SGD(momentum=alpha, dampening=1 - beta, weight_decay)."""
    lr = 0.05
    X = _params(2)
    V = [torch.zeros_like(x) for x in X]
    params = [x.clone().requires_grad_(True) for x in X]
    opt = torch.optim.SGD(params, lr=lr, momentum=alpha, dampening=1 - beta, weight_decay=weight_decay)
    for T, G in zip(range(STEPS), _gradients(3)):
        out = F.momentum(lr, T, *X, *G, *V, alpha=alpha, beta=beta, mode="standard", norm_coefficient=weight_decay)
        X, V = list(out[: len(X)]), list(out[len(X) :])
        _torch_step(opt, params, G)
        _assert_close(X, [p.detach() for p in params], f"step {T} X")
        _assert_close(V, [opt.state[p]["momentum_buffer"] for p in params], f"step {T} V")


@pytest.mark.parametrize(("alpha", "weight_decay"), [(0.9, 0.0), (0.6, 0.05)])
def test_momentum_nesterov_with_beta_1_equals_torch_sgd_nesterov(alpha, weight_decay):
    """ONNX Momentum nesterov with beta = 1 = SGD(momentum=alpha, nesterov=True, dampening=0)."""
    lr = 0.05
    X = _params(4)
    V = [torch.zeros_like(x) for x in X]
    params = [x.clone().requires_grad_(True) for x in X]
    opt = torch.optim.SGD(params, lr=lr, momentum=alpha, dampening=0, nesterov=True, weight_decay=weight_decay)
    for T, G in zip(range(STEPS), _gradients(5)):
        out = F.momentum(lr, T, *X, *G, *V, alpha=alpha, beta=1.0, mode="nesterov", norm_coefficient=weight_decay)
        X, V = list(out[: len(X)]), list(out[len(X) :])
        _torch_step(opt, params, G)
        _assert_close(X, [p.detach() for p in params], f"step {T} X")
        _assert_close(V, [opt.state[p]["momentum_buffer"] for p in params], f"step {T} V")


def _run_adam_pair(lr, alpha, beta, epsilon, *, steps=STEPS, torch_eps=None):
    """Yield (ours, torch's) parameters after each step: ONNX Adam with T from 1 vs torch.optim.Adam."""
    X = _params(6)
    V = [torch.zeros_like(x) for x in X]
    H = [torch.zeros_like(x) for x in X]
    params = [x.clone().requires_grad_(True) for x in X]
    opt = torch.optim.Adam(params, lr=lr, betas=(alpha, beta), eps=epsilon if torch_eps is None else torch_eps)
    for step, G in zip(range(steps), _gradients(7)):
        T = step + 1
        out = F.adam(lr, T, *X, *G, *V, *H, alpha=alpha, beta=beta, epsilon=epsilon)
        n = len(X)
        X, V, H = list(out[:n]), list(out[n : 2 * n]), list(out[2 * n :])
        _torch_step(opt, params, G)
        yield T, X, V, H, params, opt


@pytest.mark.parametrize(("lr", "alpha", "beta"), [(1e-2, 0.9, 0.999), (0.1, 0.5, 0.9)])
def test_adam_with_zero_epsilon_equals_torch_adam(lr, alpha, beta):
    """ONNX Adam (T from 1, norm coefficients 0) = torch.optim.Adam when epsilon == 0."""
    for T, X, V, H, params, opt in _run_adam_pair(lr, alpha, beta, 0.0):
        _assert_close(X, [p.detach() for p in params], f"step {T} X")
        _assert_close(V, [opt.state[p]["exp_avg"] for p in params], f"step {T} V")
        _assert_close(H, [opt.state[p]["exp_avg_sq"] for p in params], f"step {T} H")


def test_dml_adam_with_zero_epsilon_equals_torch_adam():
    """DirectML ADAM_OPTIMIZER (T from 1) = torch.optim.Adam when Epsilon == 0."""
    lr, beta1, beta2 = 1e-2, 0.9, 0.999
    x = _params(8)[0]
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    p = x.clone().requires_grad_(True)
    opt = torch.optim.Adam([p], lr=lr, betas=(beta1, beta2), eps=0.0)
    for step, (g, *_) in zip(range(STEPS), _gradients(9)):
        x, m, v = F.dml_adam(x, m, v, g, step + 1, learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=0.0)
        _torch_step(opt, [p], [g])
        _assert_close([x, m, v], [p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]], f"step {step}")


def test_adam_with_nonzero_epsilon_differs_from_torch_adam():
    """The epsilon placement (docs/design.md §2): ONNX/DML add epsilon to the *uncorrected* sqrt(H),
    torch.optim.Adam to the bias-corrected sqrt(H / (1 - beta**T)).  With epsilon = 1e-3 the
    parameters differ far beyond rounding, while the moments (which epsilon does not touch) agree."""
    lr, alpha, beta, eps = 1e-2, 0.9, 0.999, 1e-3
    worst = 0.0
    for T, X, V, H, params, opt in _run_adam_pair(lr, alpha, beta, eps):
        _assert_close(V, [opt.state[p]["exp_avg"] for p in params], f"step {T} V")
        _assert_close(H, [opt.state[p]["exp_avg_sq"] for p in params], f"step {T} H")
        for x, p in zip(X, params):
            worst = max(worst, ((x - p.detach()).abs() / p.detach().abs().clamp_min(1e-12)).max().item())
    # observed: 1.1e-2 (rounding alone stays below 1e-13, see FLOAT64)
    assert worst > 1e-3, f"expected the epsilon placement to show, largest relative difference {worst:.3g}"


def test_adam_epsilon_is_torch_epsilon_times_sqrt_bias_correction():
    """One step makes the placement exact: ONNX epsilon_hat = torch eps * sqrt(1 - beta**T)
    (here T = 1).  This pins down *where* epsilon goes, not only that the two differ."""
    lr, alpha, beta, eps = 1e-2, 0.9, 0.999, 1e-3
    eps_hat = eps * (1 - beta**1) ** 0.5
    ((T, X, V, H, params, opt),) = _run_adam_pair(lr, alpha, beta, eps_hat, steps=1, torch_eps=eps)
    _assert_close(X, [p.detach() for p in params], "step 1 X")
    ((T, X, V, H, params, opt),) = _run_adam_pair(lr, alpha, beta, eps, steps=1, torch_eps=eps)
    with pytest.raises(AssertionError):
        _assert_close(X, [p.detach() for p in params], "step 1 X, same epsilon")
