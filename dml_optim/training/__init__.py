"""Training helpers around an optimizer: dynamic loss scaling (:mod:`~dml_optim.training.amp`),
gradient clipping over the flat buffers (:mod:`~dml_optim.training.clip`) and ``torch.distributed`` helpers
(:mod:`~dml_optim.training.distributed`).

May import: core, dml, backends, optimizers.
"""
