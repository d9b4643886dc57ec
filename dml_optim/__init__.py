"""dml-optim: flat, in-place, DirectML-native training optimizers.

``Adam``, ``Adagrad`` and ``Momentum`` follow the ONNX ``ai.onnx.preview.training``
operators; ``DmlAdam`` follows DirectML's ``ADAM_OPTIMIZER``; ``AdamW`` and ``SGD`` are
``torch.optim.AdamW`` and ``torch.optim.SGD`` exactly (``Adagrad`` takes
``torch.optim.Adagrad``'s signature too); ``Lion`` is Chen et al.'s (2023).  Each packs a param group into one flat buffer
per (device, dtype) and updates it in place with a handful of DirectML-native
ops per step.
"""

#: The package version (PEP 440), as in pyproject.toml.
__version__ = "0.1.0"

from dml_optim.core import functional
from dml_optim.training.amp import DynamicLossScaler
from dml_optim.training.backward import StepInBackward, step_in_backward
from dml_optim.training.clip import clip_grad_norm_
from dml_optim.devices import device
from dml_optim.optimizers import SGD, Adagrad, Adam, AdamW, DmlAdam, FlatOptimizer, Lion, Momentum
from dml_optim.optimizers.registry import OPTIMIZERS

__all__ = ["Adam", "AdamW", "Adagrad", "Momentum", "SGD", "DmlAdam", "Lion", "FlatOptimizer", "DynamicLossScaler", "clip_grad_norm_",
           "step_in_backward", "StepInBackward", "OPTIMIZERS", "functional", "device", "__version__"]
