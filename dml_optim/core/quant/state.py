"""The storage object of a quantized state: :class:`QuantizedState` (codes, scales, format), sliced by block."""

from __future__ import annotations

import torch

from dml_optim.core.quant.codec import decode, encode_
from dml_optim.core.quant.eager import decode_into, encode_into
from dml_optim.core.quant.formats import StateFormat
from dml_optim.core.tracing import is_compiling

__all__ = ["QuantizedState", "tensors_of"]




def tensors_of(state) -> list[torch.Tensor]:
    """The tensors a state is stored in: itself, or a quantized state's codes and scales."""
    return state.tensors() if isinstance(state, QuantizedState) else [state]


class QuantizedState:
    """A flat state stored block-quantized: ``codes`` (uint8) and one float32 ``scales`` entry per block.

    ``numel`` elements (a whole number of blocks); slicing by element range
    (block-aligned) gives a view of the same storage.
    """

    __slots__ = ("codes", "scales", "format")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat):
        self.codes, self.scales, self.format = codes, scales, fmt

    @classmethod
    def full(cls, numel: int, value: float, fmt: StateFormat, device) -> "QuantizedState":
        """``numel`` elements equal to ``value`` (exact: the block maximum is exact), allocated on ``device``."""
        blocks = numel // fmt.block
        if blocks * fmt.block != numel:
            raise ValueError(f"a quantized state holds whole blocks of {fmt.block} elements, got {numel}")
        base = fmt.base
        if value == 0:
            code, scale = fmt.zero_code, 0.0
        elif value > 0:
            code, scale = base + fmt.magnitudes, float(value)  # the top level, 1, times the value
        elif fmt.signed:
            code, scale = base - fmt.magnitudes, -float(value)
        else:
            raise ValueError(f"an unsigned state cannot hold {value!r}")
        if fmt.bits == 4:
            code = code + 16 * code
        per_byte = 2 if fmt.bits == 4 else 1
        codes = torch.full((numel // per_byte,), code, dtype=torch.uint8, device=device)
        scales = torch.full((blocks,), scale, dtype=torch.float32, device=device)
        return cls(codes, scales, fmt)

    @property
    def numel(self) -> int:
        return self.scales.numel() * self.format.block

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]

    def _check(self, a: int, b: int) -> None:
        block = self.format.block
        if a % block or (b % block and b != self.numel):
            raise ValueError(f"a quantized state is sliced at block boundaries ({block}), got [{a}, {b})")

    def __getitem__(self, index: slice) -> "QuantizedState":
        a, b, _ = index.indices(self.numel)
        self._check(a, b)
        per_byte = 2 if self.format.bits == 4 else 1
        block = self.format.block
        return QuantizedState(self.codes[a // per_byte : b // per_byte], self.scales[a // block : b // block],
                              self.format)

    def decode(self, dtype: torch.dtype, out: torch.Tensor | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
        """The values in ``dtype`` (into ``out``; with ``index``, an int32 scratch of :func:`index_elements`,
        nothing is allocated)."""
        if index is not None and out is not None and not is_compiling() and self.scales.dtype == dtype:
            return decode_into(self.codes, self.scales, self.format, out, index)
        return decode(self.codes, self.scales, self.format, dtype, out)

    def encode_(self, values: torch.Tensor, mask: torch.Tensor | None = None, *,
                small: torch.Tensor | None = None, work: torch.Tensor | None = None,
                overwrite: bool = False) -> torch.Tensor | None:
        """Encode ``values``; with ``overwrite`` the encoder works in ``values`` (:func:`encode_into`, with
        ``small`` and ``work`` its scratch: nothing allocated), else ``values`` is left as it was.  Returns what
        :func:`encode_` returns for a compiled kernel to return (None outside one)."""
        if overwrite and not is_compiling() and not self.format.legacy:
            encode_into(values, self.codes, self.scales, self.format, small=small, mask=mask, work=work)
            return None
        return encode_(values, self.codes, self.scales, self.format, mask)

    def copy_(self, other: "QuantizedState") -> "QuantizedState":
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)
        return self

    def clone(self) -> "QuantizedState":
        return QuantizedState(self.codes.clone(), self.scales.clone(), self.format)

    def to(self, device) -> "QuantizedState":
        return QuantizedState(self.codes.to(device), self.scales.to(device), self.format)

    def __repr__(self) -> str:
        return f"QuantizedState({self.format.name}, {self.numel} elements, {self.nbytes} bytes, {self.device})"
