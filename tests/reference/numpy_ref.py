"""Literal float64 NumPy transcriptions of the update rules in docs/design.md §2.

Each function takes the spec's inputs (``R``, ``T`` as numbers or 0-d arrays;
tensors as lists of arrays, one entry per optimized tensor) and returns new
float64 arrays; nothing passed in is modified.  The body of every function is
the spec's text, one line per spec line, applied to each tensor in turn
("with several tensors ... the same formula applies to each").  Deliberately
not structured like ``dml_optim.core.functional``: no fused ops, no coefficient
helpers, no in-place updates.

Sources: ONNX operator docs for ``ai.onnx.preview.training`` ``Adagrad-1``,
``Momentum-1``, ``Adam-1``; Microsoft Learn ``DML_ADAM_OPTIMIZER_OPERATOR_DESC``;
the algorithm box of the ``torch.optim.AdamW`` documentation (Loshchilov & Hutter); Algorithm 2 ("Lion
Optimizer (ours)") of Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["onnx_adagrad", "onnx_momentum", "onnx_adam", "dml_adam", "torch_adamw", "torch_sgd", "torch_adagrad",
           "lion"]


def _f64(a) -> np.ndarray:
    return np.array(a, dtype=np.float64)  # a copy: the caller's arrays stay untouched


def _t(T) -> int:
    T = np.asarray(T)
    if T.size != 1 or not np.issubdtype(T.dtype, np.integer):
        raise TypeError(f"T must be an integer scalar, got {T!r}")
    return int(T.reshape(()))


def onnx_adagrad(
    R,
    T,
    X: Sequence[np.ndarray],
    G: Sequence[np.ndarray],
    H: Sequence[np.ndarray],
    *,
    decay_factor: float = 0.0,
    epsilon: float = 0.0,
    norm_coefficient: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """ONNX ``Adagrad-1``: returns ``(X_new list, H_new list)``."""
    R = np.float64(R)
    T = _t(T)
    X_news, H_news = [], []
    for X_i, G_i, H_i in zip(X, G, H, strict=True):
        X_i, G_i, H_i = _f64(X_i), _f64(G_i), _f64(H_i)
        # r = R / (1 + T * decay_factor)
        r = R / (1 + T * np.float64(decay_factor))
        # G_reg = norm_coefficient * X + G
        G_reg = np.float64(norm_coefficient) * X_i + G_i
        # H_new = H + G_reg * G_reg
        H_new = H_i + G_reg * G_reg
        # X_new = X - r * G_reg / (sqrt(H_new) + epsilon)
        X_new = X_i - r * G_reg / (np.sqrt(H_new) + np.float64(epsilon))
        X_news.append(X_new)
        H_news.append(H_new)
    return X_news, H_news


def onnx_momentum(
    R,
    T,
    X: Sequence[np.ndarray],
    G: Sequence[np.ndarray],
    V: Sequence[np.ndarray],
    *,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """ONNX ``Momentum-1`` (``mode`` ``'standard'`` or ``'nesterov'``): returns ``(X_new list, V_new list)``."""
    if mode not in ("standard", "nesterov"):
        raise ValueError(f"mode must be 'standard' or 'nesterov', got {mode!r}")
    R = np.float64(R)
    T = _t(T)
    alpha, beta = np.float64(alpha), np.float64(beta)
    X_news, V_news = [], []
    for X_i, G_i, V_i in zip(X, G, V, strict=True):
        X_i, G_i, V_i = _f64(X_i), _f64(G_i), _f64(V_i)
        # G_reg = norm_coefficient * X + G
        G_reg = np.float64(norm_coefficient) * X_i + G_i
        # beta_adj = beta if T > 0 else 1
        beta_adj = beta if T > 0 else np.float64(1)
        # V_new = alpha * V + beta_adj * G_reg
        V_new = alpha * V_i + beta_adj * G_reg
        if mode == "standard":
            # standard: X_new = X - R * V_new
            X_new = X_i - R * V_new
        else:
            # nesterov: X_new = X - R * (G_reg + alpha * V_new)
            X_new = X_i - R * (G_reg + alpha * V_new)
        X_news.append(X_new)
        V_news.append(V_new)
    return X_news, V_news


def onnx_adam(
    R,
    T,
    X: Sequence[np.ndarray],
    G: Sequence[np.ndarray],
    V: Sequence[np.ndarray],
    H: Sequence[np.ndarray],
    *,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """ONNX ``Adam-1``: returns ``(X_final list, V_new list, H_new list)``."""
    R = np.float64(R)
    T = _t(T)
    alpha, beta = np.float64(alpha), np.float64(beta)
    X_finals, V_news, H_news = [], [], []
    for X_i, G_i, V_i, H_i in zip(X, G, V, H, strict=True):
        X_i, G_i, V_i, H_i = _f64(X_i), _f64(G_i), _f64(V_i), _f64(H_i)
        # G_reg = norm_coefficient * X + G
        G_reg = np.float64(norm_coefficient) * X_i + G_i
        # V_new = alpha * V + (1 - alpha) * G_reg
        V_new = alpha * V_i + (1 - alpha) * G_reg
        # H_new = beta * H + (1 - beta) * G_reg * G_reg
        H_new = beta * H_i + (1 - beta) * G_reg * G_reg
        # H_sqrt = sqrt(H_new) + epsilon
        H_sqrt = np.sqrt(H_new) + np.float64(epsilon)
        # R_adj = R * sqrt(1 - beta**T) / (1 - alpha**T) if T > 0 else R
        if T > 0:
            with np.errstate(divide="ignore", invalid="ignore"):  # alpha == 1: x/0, as the spec says
                R_adj = R * np.sqrt(1 - beta**T) / (1 - alpha**T)
        else:
            R_adj = R
        # X_new = X - R_adj * V_new / H_sqrt
        X_new = X_i - R_adj * V_new / H_sqrt
        # X_final = (1 - norm_coefficient_post) * X_new
        X_final = (1 - np.float64(norm_coefficient_post)) * X_new
        X_finals.append(X_final)
        V_news.append(V_new)
        H_news.append(H_new)
    return X_finals, V_news, H_news


def dml_adam(
    X: np.ndarray,
    M: np.ndarray,
    V: np.ndarray,
    G: np.ndarray,
    T,
    *,
    learning_rate: float,
    beta1: float,
    beta2: float,
    epsilon: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DirectML ``DML_OPERATOR_ADAM_OPTIMIZER`` on one tensor: returns ``(X, M, V)``.

    The operator has exactly one parameter tensor, so this takes arrays, not
    lists.  At ``T = 0`` ``Alpha`` is ``0/0``: the result is NaN, as the
    formula says (no rule is invented for it).
    """
    X, M, V, G = _f64(X), _f64(M), _f64(V), _f64(G)
    T = _t(T)
    Beta1, Beta2 = np.float64(beta1), np.float64(beta2)
    LearningRate, Epsilon = np.float64(learning_rate), np.float64(epsilon)
    # M = Beta1 * M + (1 - Beta1) * G
    M = Beta1 * M + (1 - Beta1) * G
    # V = Beta2 * V + (1 - Beta2) * G * G
    V = Beta2 * V + (1 - Beta2) * G * G
    # Alpha = sqrt(1 - Beta2**T) / (1 - Beta1**T)
    with np.errstate(divide="ignore", invalid="ignore"):  # T == 0: 0/0 = NaN, faithfully
        Alpha = np.sqrt(1 - Beta2**T) / (1 - Beta1**T)
    # X = X - LearningRate * Alpha * M / (sqrt(V) + Epsilon)
    X = X - LearningRate * Alpha * M / (np.sqrt(V) + Epsilon)
    return X, M, V


def torch_adamw(
    X: np.ndarray,
    G: np.ndarray,
    M: np.ndarray,
    V: np.ndarray,
    V_max: np.ndarray | None,
    t,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``torch.optim.AdamW`` on one tensor at step ``t`` (from 1): returns ``(X, M, V, V_max)``.

    The documented algorithm, one line per line of its box; ``V_max`` is used
    (and returned) only with ``amsgrad``.
    """
    X, G, M, V = _f64(X), _f64(G), _f64(M), _f64(V)
    t = _t(t)
    lr, beta1, beta2 = np.float64(lr), np.float64(beta1), np.float64(beta2)
    eps, weight_decay = np.float64(eps), np.float64(weight_decay)
    # if maximize: g_t = -grad else g_t = grad
    g = -G if maximize else G
    # theta_t = theta_{t-1} - gamma * lambda * theta_{t-1}
    X = X - lr * weight_decay * X
    # m_t = beta1 * m_{t-1} + (1 - beta1) * g_t
    M = beta1 * M + (1 - beta1) * g
    # v_t = beta2 * v_{t-1} + (1 - beta2) * g_t**2
    V = beta2 * V + (1 - beta2) * g * g
    # m_hat = m_t / (1 - beta1**t)
    m_hat = M / (1 - beta1**t)
    if amsgrad:
        # v_max_t = max(v_max_{t-1}, v_t); v_hat = v_max_t / (1 - beta2**t)
        V_max = np.maximum(_f64(V_max), V)
        v_hat = V_max / (1 - beta2**t)
    else:
        # v_hat = v_t / (1 - beta2**t)
        v_hat = V / (1 - beta2**t)
    # theta_t = theta_t - gamma * m_hat / (sqrt(v_hat) + epsilon)
    X = X - lr * m_hat / (np.sqrt(v_hat) + eps)
    return X, M, V, (V_max if amsgrad else None)


def torch_sgd(
    X: np.ndarray,
    G: np.ndarray,
    B: np.ndarray | None,
    t,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``torch.optim.SGD`` on one tensor at step ``t`` (from 1): returns ``(X, B)``.

    The documented algorithm, one line per line of its box (``B`` is the
    momentum buffer, None without momentum).
    """
    X, G = _f64(X), _f64(G)
    t = _t(t)
    lr, momentum, dampening, weight_decay = map(np.float64, (lr, momentum, dampening, weight_decay))
    # if maximize: g_t = -g_t  (the documented box negates g_t before the weight decay)
    g = -G if maximize else G
    # if lambda != 0: g_t = g_t + lambda * theta_{t-1}
    g = g + weight_decay * X
    if momentum != 0:
        # if t > 1: b_t = mu * b_{t-1} + (1 - tau) * g_t  else: b_t = g_t
        B = momentum * _f64(B) + (1 - dampening) * g if t > 1 else g
        # if nesterov: g_t = g_t + mu * b_t  else: g_t = b_t
        g = g + momentum * B if nesterov else B
    else:
        B = None
    # theta_t = theta_{t-1} - gamma * g_t
    return X - lr * g, B


def torch_adagrad(
    X: np.ndarray,
    G: np.ndarray,
    S: np.ndarray,
    t,
    *,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``torch.optim.Adagrad`` on one tensor at step ``t`` (from 1): returns ``(X, S)``.

    The documented algorithm, one line per line of its box; ``S`` (the
    ``sum`` state) starts at ``initial_accumulator_value``, the caller's.
    """
    X, G, S = _f64(X), _f64(G), _f64(S)
    t = _t(t)
    lr, lr_decay, weight_decay, eps = map(np.float64, (lr, lr_decay, weight_decay, eps))
    # if maximize: g_t = -g_t
    g = -G if maximize else G
    # gamma~ = gamma / (1 + (t - 1) * eta)
    clr = lr / (1 + (t - 1) * lr_decay)
    # if lambda != 0: g_t = g_t + lambda * theta_{t-1}
    g = g + weight_decay * X
    # state_sum_t = state_sum_{t-1} + g_t^2
    S = S + g * g
    # theta_t = theta_{t-1} - gamma~ * g_t / (sqrt(state_sum_t) + epsilon)
    return X - clr * g / (np.sqrt(S) + eps), S


def lion(
    X: np.ndarray,
    G: np.ndarray,
    M: np.ndarray,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Lion (Chen et al. 2023, Algorithm 2) on one tensor: returns ``(X, M)``.

    The paper's lines, with its ``interp`` written out; the update does not depend on the step count.
    ``maximize`` (not in the paper) negates the gradient, as torch.optim's optimizers do.
    """
    X, G, M = _f64(X), _f64(G), _f64(M)
    lr, beta1, beta2, weight_decay = np.float64(lr), np.float64(beta1), np.float64(beta2), np.float64(weight_decay)
    g = -G if maximize else G
    # c_t = beta1 * m_{t-1} + (1 - beta1) * g_t
    c = beta1 * M + (1 - beta1) * g
    # theta_t = theta_{t-1} - eta_t * (sign(c_t) + lambda * theta_{t-1})
    X = X - lr * (np.sign(c) + weight_decay * X)
    # m_t = beta2 * m_{t-1} + (1 - beta2) * g_t
    M = beta2 * M + (1 - beta2) * g
    return X, M
