"""Block-wise 8-bit and 4-bit storage of optimizer states (``state_bits=8`` or ``4``).

A quantized state is one more *storage format* of a flat state buffer: the
rule never sees it.  Before the rule runs a range is decoded into the compute
dtype (as a float16 state is converted into float32), after it the result is
encoded back (docs/design.md §5, "Low-bit state").

Long by design: it holds three codebooks (the first two still decode the checkpoints saved with them), each
with its eager encoder and decoder (in place, in a caller's scratch) and the form a compiled kernel traces.

**Layout.** The elements are cut into blocks of :data:`BLOCK` elements (256
at 8 bits, 128 at 4 bits); each block keeps one float32 scale, its absolute
maximum, and each element one code (a byte, or a nibble: two codes per byte,
element ``2t`` in the low nibble).  Blocks never straddle two parameters: a
quantized flat buffer starts every parameter at a block boundary (zero padding
between parameters), so a parameter's state is its own blocks, and a state
whose values did not change encodes to the very same bits.

**Codes** of the codebook :data:`CODEBOOK` (what new states use, :data:`ACTIVE_CODEBOOK`; a
value ``v`` normalized by its block's maximum, ``y = v / absmax``, ``K`` the
largest magnitude index: 127 or 7 signed, 255 or 15 unsigned):

* ``"root"``, every 8-bit state: the index ``k = round(K * |y|**(1/4))`` (signed
  states, the first moment and the momentum buffer, keep the sign of ``y`` and
  store ``128 + k``); level ``(k / K)**4`` *as float32 evaluates it*,
  ``((max(k, 1/2) * float32(1 / K))**2)**2`` (index 0 of an unsigned state at
  ``k = 1/2``, as ``"pow"`` below), so that a compiled kernel decodes by four
  multiplies, the table bit for bit (:func:`root_levels`), and encodes by two
  square roots: no gather, no transcendental function.
* ``"asinh"``, 4-bit signed states (first moment, momentum buffer): the index
  ``k = round(K * asinh(S * y) / asinh(S))`` (``asinh`` is odd: no sign
  to split off), stored as ``2**(bits-1) + k``; level ``sinh(asinh(S) * k / K) / S``.
  Linear near 0 (exact 0) and logarithmic from ``1/S`` up (a constant
  relative step ``asinh(S) / K``): mu-law companding.  ``S`` = 5.
* ``"pow"``, 4-bit unsigned states (second moment, Adagrad's sum): the index
  ``k = round(K * y**p)``, level ``(k / K)**(1/p)`` (``p`` = 1/2); index 0 is ``(0.5 / K)**(1/p)``, the top of the values that
  round to it, not 0: a second moment never decodes to 0 while its first moment
  does not (the "zero-point problem" of Li et al. 2023, "Memory Efficient
  Optimizers with 4-bit States").

Each is one closed-form expression per element, no decade search: the eager
encoder is 6 (unsigned), 7 (``asinh``) or 8 (signed ``root``) ops per block range, each in place or
into an ``out=`` tensor the caller keeps, all native on DirectML.  The compiled ``asinh`` and ``pow``
encoders (float32) are a lookup on the float's bits, a shift, one gather from a small table and a compare,
whose table is found from the eager encoder (:func:`bucket_tables`): the same codes bit for bit; the
compiled ``root`` encoder's square roots and the eager ``pow`` may round a value within about 1e-5 of a
code's edge to neighbouring codes.  An eager decode is one gather from the format's 256- or 16-entry
table (4 bits: a 256 x 2 table of byte -> two values, no unpacking ops) and one multiply by the block scale.

The second codebook, ``"dml-optim-blockwise-2"`` (:data:`SECOND_CODEBOOK`), had the 4-bit codes above and
at 8 bits ``"asinh"`` (``S`` = 1e4) and ``"pow"`` (``p`` = 1/4, levels in float64); its checkpoints load.

The first codebook, ``"dml-optim-blockwise-1"`` (:data:`LEGACY_CODEBOOK`), is
kept for reading checkpoints: ``"de"`` (Dettmers et al. 2022's dynamic
exponent: a magnitude index ``k`` in ``[0, 2**D - 1]`` picks decade
``i = floor(log2 k)`` and fraction ``j = k - 2**i + 1``, level
``10**(i - D + 1) * (0.1 + 0.9 * j / 2**i)``; signed ones keep an exact 0,
unsigned ones have ``10**-D`` at index 0) and ``"linear"`` (4-bit unsigned,
``(k + 1) / 16``).  Its encoder (a ``log10`` per element and gathers from
8-entry tables) stays for tests and conversions.

Bounds (tests/test_quant.py): the block maximum, 0 (signed formats) and a
block of equal values are exact; a zero block stays zero; otherwise a value is
rounded to the nearest level *in the companded domain* (``asinh(S y)`` or
``|y|**p``): within half a companded step (:meth:`StateFormat.bound`).
Blocks whose maximum is below ``2**-126 * c`` (``c`` the format's
:attr:`StateFormat.divisor`: about 3e4 signed, 4e9 for the 8-bit second
moment, i.e. a block maximum under 5e-29) are encoded against a larger
divisor: their values decode smaller, never larger than the maximum.

The package, by concern: :mod:`~dml_optim.core.quant.formats` (blocks, codebooks, levels),
:mod:`~dml_optim.core.quant.tables` (per-device tables), :mod:`~dml_optim.core.quant.eager` (the eager codec,
DirectML's), :mod:`~dml_optim.core.quant.traced` (the codec a compiled kernel traces),
:mod:`~dml_optim.core.quant.legacy` (the first codebook), :mod:`~dml_optim.core.quant.codec` (which of them
runs), :mod:`~dml_optim.core.quant.state` (:class:`QuantizedState`).  The eager step's chunk sizing is the eager
backend's (:func:`dml_optim.backends.eager.chunk_elements`).
"""

from __future__ import annotations

from dml_optim.core.quant.codec import decode, encode_, warm_tables
from dml_optim.core.quant.eager import block_mask, compand_, decode_into, encode_into, index_elements
from dml_optim.core.quant.formats import (BLOCK, CODEBOOK, CODEBOOKS, LEGACY_CODEBOOK, MIN_ELEMENTS, SECOND_CODEBOOK,
                                          StateFormat, active_codebook, format_for, format_named, use_codebook)
from dml_optim.core.quant.state import QuantizedState, tensors_of
from dml_optim.core.quant.traced import bucket_tables, encode_buckets, root_levels

__all__ = ["BLOCK", "MIN_ELEMENTS", "CODEBOOK", "SECOND_CODEBOOK", "LEGACY_CODEBOOK", "ACTIVE_CODEBOOK", "CODEBOOKS",
           "StateFormat", "format_for", "QuantizedState", "format_named", "warm_tables", "encode_", "encode_into",
           "compand_", "bucket_tables", "encode_buckets", "decode", "decode_into", "block_mask", "tensors_of",
           "index_elements", "active_codebook", "use_codebook", "root_levels"]


def __getattr__(name: str):
    """``ACTIVE_CODEBOOK``: the codebook new states are created in, read live (:func:`use_codebook` changes it)."""
    if name == "ACTIVE_CODEBOOK":
        return active_codebook()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
