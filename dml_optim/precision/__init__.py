"""FP16/BF16/FP32 precision configurations and the comparison harness behind ``dml-optim compare``.

One module per job:

* :mod:`~dml_optim.precision.configs`: the configurations (:data:`CONFIGS`);
* :mod:`~dml_optim.precision.optimizers`: building an optimizer in a
  configuration and the float64 reference, from the registry;
* :mod:`~dml_optim.precision.streams`: the gradient streams (:data:`STREAMS`)
  and workloads;
* :mod:`~dml_optim.precision.metrics`: the metrics (:data:`METRICS`), pure
  functions with known answers;
* :mod:`~dml_optim.precision.runner`: :func:`compare` and :func:`run_stream`,
  the configurations in lockstep with the reference;
* :mod:`~dml_optim.precision.report`: the :class:`Report` and its renderings;
* :mod:`~dml_optim.precision.findings`: plain-language findings from the numbers;
* :mod:`~dml_optim.precision.memory`: bytes per parameter of each precision
  mode, read from the optimizer's own tensors (the README's table).

May import: core, dml, backends, optimizers, training, job, top.
"""

from dml_optim.precision.configs import CONFIGS, Config
from dml_optim.precision.metrics import (
    METRICS, REL_ERROR_FLOOR, flushed_entries, lost_updates, relative_error, smallest_subnormal, ulp_distance,
)
from dml_optim.precision.optimizers import (
    epsilon_name, make_optimizer, reference_optimizer, resolved_hyperparameters, second_moment,
)
from dml_optim.precision.report import Report, Result
from dml_optim.precision.runner import compare, run_stream
from dml_optim.precision.streams import (
    STREAMS, Stream, default_steps, gaussian_stream, recorded_stream, synthetic_stream, workload_params,
)

__all__ = [
    "Config", "CONFIGS", "STREAMS", "METRICS", "Stream", "Result", "Report",
    "compare", "run_stream", "make_optimizer", "reference_optimizer", "resolved_hyperparameters",
    "second_moment", "epsilon_name", "default_steps",
    "recorded_stream", "synthetic_stream", "gaussian_stream", "workload_params",
    "relative_error", "ulp_distance", "lost_updates", "flushed_entries",
    "smallest_subnormal", "REL_ERROR_FLOOR",
]
