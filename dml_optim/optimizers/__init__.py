"""The optimizers: one module per class; :mod:`~dml_optim.optimizers.registry` lists them.

The base class (torch.optim's contract) lives in :mod:`~dml_optim.optimizers.base`.

May import: core, dml, backends.
"""

from dml_optim.optimizers.adagrad import Adagrad
from dml_optim.optimizers.adam import Adam
from dml_optim.optimizers.adamw import AdamW
from dml_optim.optimizers.base import BufferInfo, FlatOptimizer
from dml_optim.optimizers.dml_adam import DmlAdam
from dml_optim.optimizers.momentum import Momentum
from dml_optim.optimizers.sgd import SGD

__all__ = ["Adam", "AdamW", "Adagrad", "Momentum", "SGD", "DmlAdam", "FlatOptimizer", "BufferInfo"]
