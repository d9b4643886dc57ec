"""The one per-dtype tolerance table (docs/design.md §6, item 5).

Use ``assert_close(actual, expected)`` or ``TOL[dtype]``.  Every override
carries a comment with the error actually observed.
"""

import torch

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-2, atol=1e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=1e-2),
}

#: torch.optim.Adam vs our Adam with epsilon=0 over 50 float32 steps: the two
#: compute the bias correction in a different order (observed max 4e-7 relative).
TORCH_ADAM_FLOAT32 = dict(rtol=2e-5, atol=2e-6)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **override) -> None:
    """``actual`` equals ``expected`` to the tolerance of ``expected``'s dtype, ``expected`` rounded to ``actual``'s."""
    tol = dict(TOL[expected.dtype], **override)
    torch.testing.assert_close(actual, expected.to(actual.dtype), **tol)


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor, **override) -> None:
    """``actual`` equals a (float64) reference to the tolerance of ``actual``'s own dtype: a float32 or
    float16 result is held to float32's or float16's, the reference rounded to that dtype."""
    tol = dict(TOL[actual.dtype], **override)
    torch.testing.assert_close(actual, reference.to(actual.dtype), **tol)
