"""How a flat buffer's rule runs: ``eager`` (DirectML's path), ``compiled`` (``torch.compile``) and ``fused``
(torch's own CPU kernels), and the one place that chooses between them (:mod:`~dml_optim.backends.choose`).

May import: core.
"""
