"""Training helpers around an optimizer: dynamic loss scaling (:mod:`~dml_optim.training.amp`),
gradient clipping over the flat buffers (:mod:`~dml_optim.training.clip`), ``torch.distributed`` helpers
(:mod:`~dml_optim.training.distributed`) and the step inside backward (:mod:`~dml_optim.training.backward`).

May import: core, dml, backends, optimizers.
"""
