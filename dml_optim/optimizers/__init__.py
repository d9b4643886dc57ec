"""The optimizers: one module per class."""

from dml_optim.optimizers.adagrad import Adagrad
from dml_optim.optimizers.adam import Adam
from dml_optim.optimizers.base import FlatOptimizer
from dml_optim.optimizers.dml_adam import DmlAdam
from dml_optim.optimizers.momentum import Momentum

__all__ = ["Adam", "Adagrad", "Momentum", "DmlAdam", "FlatOptimizer"]
