"""DirectML: device detection, the aten dispatch table, and the ADAM_OPTIMIZER
descriptor model and validator (shared by ``dml-optim validate`` and ``DmlAdam``).

The descriptor code is split by job: :mod:`~dml_optim.dml.desc` (the model),
:mod:`~dml_optim.dml.desc_json` (JSON), :mod:`~dml_optim.dml.torch_bridge`
(torch shapes and tensors), :mod:`~dml_optim.dml.builder` (the optimizers'
in-place descriptors) and :mod:`~dml_optim.dml.validate` (the rules).

May import: core.
"""

from dml_optim.dml.builder import adam_descriptor, split_for_dml
from dml_optim.dml.desc import AdamOptimizerDesc, Binding, MalformedDescriptor, TensorDesc, calc_buffer_tensor_size
from dml_optim.dml.desc_json import dump, dumps, load, loads
from dml_optim.dml.device import available, backend_status, device
from dml_optim.dml.dispatch import dispatch_table, foreach_element_op, is_fallback, is_native, resolution
from dml_optim.dml.torch_bridge import describe_tensor, dml_sizes
from dml_optim.dml.validate import FEATURE_LEVELS, RULES, Report, Violation, validate

__all__ = [
    "available", "backend_status", "device",
    "dispatch_table", "resolution", "is_native", "is_fallback", "foreach_element_op",
    "TensorDesc", "Binding", "AdamOptimizerDesc", "MalformedDescriptor",
    "calc_buffer_tensor_size", "dml_sizes", "describe_tensor", "adam_descriptor", "split_for_dml",
    "loads", "dumps", "load", "dump",
    "validate", "Report", "Violation", "RULES", "FEATURE_LEVELS",
]
