"""DirectML: device detection, the aten dispatch table, and the ADAM_OPTIMIZER
descriptor model and validator (shared by ``dml-optim validate`` and ``DmlAdam``)."""

from dml_optim.dml.device import available, backend_status, device
from dml_optim.dml.dispatch import dispatch_table, foreach_element_op, is_fallback, is_native, resolution
from dml_optim.dml.tensor_desc import (
    AdamOptimizerDesc,
    Binding,
    MalformedDescriptor,
    TensorDesc,
    adam_descriptor,
    calc_buffer_tensor_size,
    describe_tensor,
    dml_sizes,
    dump,
    dumps,
    load,
    loads,
    split_for_dml,
)
from dml_optim.dml.validate import FEATURE_LEVELS, RULES, Report, Violation, validate

__all__ = [
    "available", "backend_status", "device",
    "dispatch_table", "resolution", "is_native", "is_fallback", "foreach_element_op",
    "TensorDesc", "Binding", "AdamOptimizerDesc", "MalformedDescriptor",
    "calc_buffer_tensor_size", "dml_sizes", "describe_tensor", "adam_descriptor", "split_for_dml",
    "loads", "dumps", "load", "dump",
    "validate", "Report", "Violation", "RULES", "FEATURE_LEVELS",
]
