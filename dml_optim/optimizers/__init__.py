"""The optimizers: one module per class; :mod:`~dml_optim.optimizers.registry` lists them.

The base class (torch.optim's contract) lives in :mod:`~dml_optim.optimizers.base`, with its parts:
:mod:`~dml_optim.optimizers.layout` (groups to buffers), :mod:`~dml_optim.optimizers.engine` (plan, commit,
repeat through :mod:`dml_optim.backends`), :mod:`~dml_optim.optimizers.settings`,
:mod:`~dml_optim.optimizers.states` and :mod:`~dml_optim.optimizers.introspect` (``BufferInfo``).

May import: core, dml, backends.
"""

from dml_optim.optimizers.adagrad import Adagrad
from dml_optim.optimizers.adam import Adam
from dml_optim.optimizers.adamw import AdamW
from dml_optim.optimizers.base import BufferInfo, FlatOptimizer
from dml_optim.optimizers.dml_adam import DmlAdam
from dml_optim.optimizers.lion import Lion
from dml_optim.optimizers.momentum import Momentum
from dml_optim.optimizers.sgd import SGD

__all__ = ["Adam", "AdamW", "Adagrad", "Momentum", "SGD", "DmlAdam", "Lion", "FlatOptimizer", "BufferInfo"]
