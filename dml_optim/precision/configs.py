"""The precision configurations ``dml-optim compare`` runs: how parameters, states and arithmetic are stored.

A :class:`Config` is a parameter (storage) dtype plus the optimizer options
that decide the rest: ``state_dtype``, ``compute_dtype``, ``master_weights``
(an FP32 copy of the parameters), ``kahan`` (a compensation buffer in the
parameters' dtype) or ``rounding="stochastic"`` (the FP32 result rounded into
the parameters up or down with unbiased probabilities, no buffer).  :data:`CONFIGS` lists them in the order reports show
them.  DirectML has no bfloat16: the ``bf16`` configurations say "CPU/CUDA only", and ``fp16-sr-8bit`` (float16
written by stochastic rounding, 8-bit states) is DirectML's lean configuration.  The dtypes a configuration ends up with are the optimizers' own rules
(states and arithmetic in FP32 with master weights, Kahan or stochastic
rounding, unless set),
read from the optimizer base class, not restated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dml_optim.core.dtypes import compute_dtype, state_dtype

__all__ = ["Config", "CONFIGS", "REFERENCE"]


@dataclass(frozen=True)
class Config:
    """A precision configuration: how parameters, states and arithmetic are stored."""

    name: str
    param_dtype: torch.dtype
    state_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    master_weights: bool = False
    kahan: bool = False
    state_bits: int | None = None
    #: How the FP32 result is written into float16/bfloat16 parameters: ``"nearest"`` or ``"stochastic"``.
    rounding: str = "nearest"
    description: str = ""

    def options(self) -> dict[str, Any]:
        """The optimizer keyword arguments of this configuration (``rounding`` only when it is not the
        default, so a round-to-nearest configuration passes what it always did)."""
        options = dict(state_dtype=self.state_dtype, compute_dtype=self.compute_dtype,
                       master_weights=self.master_weights, kahan=self.kahan, state_bits=self.state_bits)
        if self.rounding != "nearest":
            options["rounding"] = self.rounding
        return options

    @property
    def stored_state_dtype(self) -> torch.dtype:
        """The dtype the optimizer stores its states in (``state_dtype``, or the optimizers' default; for
        quantized states, the dtype they decode into, and the dtype of the small tensors' states)."""
        if self.state_bits:
            return compute_dtype(self.options(), self.param_dtype, self.state_bits)
        return state_dtype(self.options(), self.param_dtype)

    @property
    def arithmetic_dtype(self) -> torch.dtype:
        """The dtype the update is computed in (``compute_dtype``, or the optimizers' default)."""
        return compute_dtype(self.options(), self.param_dtype, self.state_bits)

    @property
    def carries_small_updates(self) -> bool:
        """Updates below half an ULP of the stored parameters are kept (a master copy or a compensation buffer)."""
        return self.master_weights or self.kahan

    @property
    def stochastic(self) -> bool:
        """The parameters are written by stochastic rounding: small updates kept on average, not carried."""
        return self.rounding == "stochastic"


#: The configurations ``dml-optim compare`` runs, in order.
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("fp32", torch.float32, description="FP32 parameters, states and arithmetic"),
        Config("fp16", torch.float16, description="FP16 parameters, states and arithmetic (DirectML's native FP16 path)"),
        Config("fp16-fp32compute", torch.float16, compute_dtype=torch.float32,
               description="FP16 parameters and states, FP32 arithmetic in bounded chunks"),
        Config("fp16-master", torch.float16, master_weights=True,
               description="FP16 parameters, FP32 master weights, FP32 states and arithmetic"),
        Config("fp16-kahan", torch.float16, kahan=True,
               description="FP16 parameters plus an FP16 Kahan compensation buffer, FP32 states and arithmetic"),
        Config("fp16-sr", torch.float16, rounding="stochastic",
               description="FP16 parameters written by stochastic rounding (no compensation buffer), FP32 states "
                           "and arithmetic"),
        Config("bf16", torch.bfloat16, description="bfloat16 parameters, states and arithmetic (CPU/CUDA only)"),
        Config("bf16-kahan", torch.bfloat16, kahan=True,
               description="bfloat16 parameters plus a bfloat16 Kahan compensation buffer, FP32 states and "
                           "arithmetic (CPU/CUDA only)"),
        Config("bf16-sr", torch.bfloat16, rounding="stochastic",
               description="bfloat16 parameters written by stochastic rounding (no compensation buffer), FP32 "
                           "states and arithmetic (CPU/CUDA only)"),
        Config("fp32-8bit", torch.float32, state_bits=8,
               description="FP32 parameters and arithmetic, 8-bit block-quantized states"),
        Config("fp32-4bit", torch.float32, state_bits=4,
               description="FP32 parameters and arithmetic, 4-bit block-quantized states"),
        Config("fp16-kahan-8bit", torch.float16, kahan=True, state_bits=8,
               description="FP16 parameters plus an FP16 Kahan compensation buffer, 8-bit block-quantized "
                           "states, FP32 arithmetic"),
        Config("fp16-kahan-4bit", torch.float16, kahan=True, state_bits=4,
               description="FP16 parameters plus an FP16 Kahan compensation buffer, 4-bit block-quantized "
                           "states, FP32 arithmetic"),
        # DirectML's lean configuration (DirectML has no bfloat16): float16 written by stochastic rounding, low-bit
        # states (on a device, with the step inside backward and a DynamicLossScaler; compare feeds the gradients)
        Config("fp16-sr-8bit", torch.float16, rounding="stochastic", state_bits=8,
               description="FP16 parameters written by stochastic rounding, 8-bit block-quantized states, FP32 "
                           "arithmetic (DirectML's lean configuration)"),
        Config("fp16-sr-4bit", torch.float16, rounding="stochastic", state_bits=4,
               description="FP16 parameters written by stochastic rounding, 4-bit block-quantized states, FP32 "
                           "arithmetic (DirectML's lean configuration at 4 bits)"),
        Config("bf16-sr-8bit", torch.bfloat16, rounding="stochastic", state_bits=8,
               description="bfloat16 parameters written by stochastic rounding, 8-bit block-quantized states, "
                           "FP32 arithmetic (CPU/CUDA only)"),
        Config("bf16-sr-4bit", torch.bfloat16, rounding="stochastic", state_bits=4,
               description="bfloat16 parameters written by stochastic rounding, 4-bit block-quantized states, "
                           "FP32 arithmetic (CPU/CUDA only)"),
    )
}

#: The float64 reference every configuration is measured against.
REFERENCE = Config("reference", torch.float64, description="the same update rule in float64")
