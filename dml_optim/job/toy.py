"""The built-in toy problem: a deterministic dataset and a small MLP.

The dataset is generated in-process (no download): ``NUM_CLASSES`` interleaved
noisy spiral arms in a 2-D latent plane, lifted to ``NUM_FEATURES`` dimensions
by a fixed random nonlinear map, plus isotropic noise.  A linear classifier
cannot separate the arms (each arm winds around the origin); a small MLP can.

Everything is drawn from a CPU :class:`torch.Generator` seeded by ``seed``, so
the same seed gives bit-identical data and weights on every machine; tensors
are moved to ``device``/``dtype`` afterwards.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "NUM_CLASSES", "NUM_FEATURES", "N_TRAIN", "N_TEST", "HIDDEN",
    "make_dataset", "make_model", "accuracy", "chance_level",
]

#: Number of classes (spiral arms).  Chance level is ``1 / NUM_CLASSES``.
NUM_CLASSES = 10
#: Input dimension of the lifted data.
NUM_FEATURES = 32
#: Default sizes of the training and held-out sets.
N_TRAIN = 8192
N_TEST = 2048
#: Default width of the MLP's hidden layers.
HIDDEN = 128

_LATENT = 2          # the spiral plane
_T_MIN = 0.25        # arms start at this radius (the centre, where arms meet, is left out)
_TURNS = 0.75        # how far each arm winds (in full turns) from the centre outwards
_LATENT_NOISE = 0.02  # Gaussian noise on the latent points (radius is at most 1)
_FEATURE_NOISE = 0.05  # Gaussian noise added after the lift


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _spiral(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` latent points ``(n, 2)`` and their labels, balanced over the arms (shuffled).

    Arm ``k``, position ``t ~ U(_T_MIN, 1)``: radius ``t``, angle
    ``2*pi*k/NUM_CLASSES + 2*pi*_TURNS*t``, then Gaussian noise.
    """
    labels = (torch.arange(n) % NUM_CLASSES)[torch.randperm(n, generator=gen)]
    t = _T_MIN + (1 - _T_MIN) * torch.rand(n, generator=gen, dtype=torch.float64)
    angle = 2 * math.pi * labels.double() / NUM_CLASSES + 2 * math.pi * _TURNS * t
    z = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    z = z + _LATENT_NOISE * torch.randn(n, _LATENT, generator=gen, dtype=torch.float64)
    return z, labels


def _lift_map(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, b, W)`` of the fixed random nonlinear map ``z -> tanh(z A + b) W`` (``R^2 -> R^NUM_FEATURES``)."""
    a = 2.0 * torch.randn(_LATENT, NUM_FEATURES, generator=gen, dtype=torch.float64)
    b = 0.5 * torch.randn(NUM_FEATURES, generator=gen, dtype=torch.float64)
    w = torch.randn(NUM_FEATURES, NUM_FEATURES, generator=gen, dtype=torch.float64) / math.sqrt(NUM_FEATURES)
    return a, b, w


def _points(n: int, lift: tuple[torch.Tensor, torch.Tensor, torch.Tensor], gen: torch.Generator):
    """``n`` lifted, noisy points (float64) and their labels (balanced: each class ``n // NUM_CLASSES`` or one more)."""
    a, b, w = lift
    z, y = _spiral(n, gen)
    x = torch.tanh(z @ a + b) @ w
    return x + _FEATURE_NOISE * torch.randn(x.shape, generator=gen, dtype=torch.float64), y


def make_dataset(
    seed: int = 0,
    n_train: int = N_TRAIN,
    n_test: int = N_TEST,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of the built-in classification task.

    ``x`` has shape ``(n, NUM_FEATURES)`` and ``dtype``; ``y`` is int64 in
    ``[0, NUM_CLASSES)``, balanced within each split (every class has
    ``n // NUM_CLASSES`` or one more points).  Features are standardised with the training set's
    mean and standard deviation.  Deterministic in ``seed`` (generated in
    float64 on the CPU, then cast and moved).
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    gen = torch.Generator().manual_seed(int(seed))
    lift = _lift_map(gen)
    x_train, y_train = _points(n_train, lift, gen)
    x_test, y_test = _points(n_test, lift, gen)
    x, y = torch.cat([x_train, x_test]), torch.cat([y_train, y_test])
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-12)
    x = (x - mean) / std
    x = x.to(device=device, dtype=dtype)
    y = y.to(device=device)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_model(
    seed: int = 0,
    hidden: int = HIDDEN,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A small MLP ``NUM_FEATURES -> hidden -> hidden -> NUM_CLASSES`` with ReLU.

    Initialised with torch's default ``nn.Linear`` scheme from ``seed`` inside
    :func:`torch.random.fork_rng`, so the same seed gives the same weights and
    the global CPU RNG state is left untouched.
    """
    _check_count("hidden", hidden)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 4096) -> float:
    """Fraction of ``x`` whose arg-max logit equals ``y`` (model put in eval mode and restored)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, x.shape[0], batch_size):
        correct += int((model(x[i:i + batch_size]).argmax(dim=1) == y[i:i + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, x.shape[0])


def chance_level() -> float:
    """Accuracy of guessing (the classes are balanced): ``1 / NUM_CLASSES``."""
    return 1.0 / NUM_CLASSES
