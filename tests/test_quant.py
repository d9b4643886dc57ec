"""The block-wise 8-bit and 4-bit codes of ``dml_optim.core.quant`` against their definition (docs/design.md §5).

The oracle is written here from the definition, in float64 NumPy: the level
table of each format (dynamic exponent: ``10**(i - D + 1) * (0.1 + 0.9 * j / 2**i)``
for magnitude index ``k = 2**i - 1 + j``; linear: ``(k + 1) / 16``), and the
nearest level by brute force over the whole table.  Checked per block:

* the error bound: the decoded value is the table's nearest level (up to one
  float32 rounding of the normalized value), so within half a step of the
  decade (``0.45 * 10**(i - D + 1) / 2**i`` of the block maximum) or, for the
  linear format, ``1/32``;
* zeros stay zero (signed formats: 0 is a level), a block of equal values and
  the block maximum are exact, an all-zero block gives no NaN and decodes to
  zeros (every format), a non-finite block stays non-finite, and only it;
* 4-bit packing: element ``2t`` in the low nibble; padding (a mask) encodes as 0
  and does not count towards the maximum;
* the same codes from the eager ops and from ``torch.compile``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dml_optim.core import quant as Q
from dml_optim.backends.compiled import compile_available

FORMATS = [Q.format_for(bits, signed) for bits in (8, 4) for signed in (True, False)]
IDS = [f.name for f in FORMATS]


def _levels(fmt) -> np.ndarray:
    """The table of ``fmt``, from the definition (float64), indexed by code."""
    n = 2**fmt.bits
    if fmt.kind == "linear":
        return np.array([(k + 1) / n for k in range(n)])
    d = fmt.bits - 1 if fmt.signed else fmt.bits
    mags = [0.0 if fmt.signed else 10.0**-d]
    for i in range(d):
        mags += [10.0 ** (i - d + 1) * (0.1 + 0.9 * j / 2**i) for j in range(1, 2**i + 1)]
    if not fmt.signed:
        return np.array(mags)
    base = n // 2
    out = np.zeros(n)
    for c in range(1, n):
        k = c - base
        out[c] = math.copysign(mags[abs(k)], k) if k else 0.0
    out[0] = out[1]  # (no value encodes to code 0)
    return out


def _encode(v: torch.Tensor, fmt, mask=None):
    per = 2 if fmt.bits == 4 else 1
    codes = torch.empty(v.numel() // per, dtype=torch.uint8)
    scales = torch.empty(v.numel() // fmt.block, dtype=torch.float32)
    Q.encode_(v, codes, scales, fmt, mask)
    return codes, scales


def _blocks(fmt, n_blocks=64, seed=0, spread=7.0):
    """Values over ``spread`` decades, random signs (unsigned formats: magnitudes), whole blocks."""
    g = torch.Generator().manual_seed(seed)
    n = fmt.block * n_blocks
    mags = 10.0 ** (-spread * torch.rand(n, generator=g, dtype=torch.float64))
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double() if fmt.signed else 1.0
    return (mags * signs * 3.0).float()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_the_table_is_the_definition(fmt):
    np.testing.assert_allclose(np.array(fmt.levels()), _levels(fmt), rtol=1e-15, atol=0)
    table = _levels(fmt)
    assert table.max() == 1.0  # the block maximum is a level
    assert (0.0 in table) == fmt.signed  # signed formats keep an exact 0; unsigned ones exclude it
    if fmt.signed:
        assert -1.0 in table
    mags = np.unique(np.abs(table))
    assert np.all(np.diff(mags) > 0)
    assert len(np.unique(table)) == (2**fmt.bits - 1 if fmt.signed else 2**fmt.bits)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_round_trip_is_the_nearest_level_of_each_block(fmt):
    v = _blocks(fmt)
    codes, scales = _encode(v, fmt)
    decoded = Q.decode(codes, scales, fmt, torch.float64)
    table = _levels(fmt)
    blocks = v.double().view(-1, fmt.block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    assert torch.equal(scales.double().view(-1, 1), absmax)
    y = (blocks / absmax).numpy()
    nearest = table[np.abs(y[..., None] - table).argmin(axis=-1)]
    ours = (decoded.view(-1, fmt.block) / absmax).numpy()
    best = np.abs(nearest - y)
    # nearest up to the float32 rounding of y (ties between two levels may go either way)
    assert np.all(np.abs(ours - y) <= best + 2e-7), np.abs(ours - y).max()  # noqa: the message is the worst error
    if fmt.kind == "de":
        d = fmt.bits - 1 if fmt.signed else fmt.bits
        i = np.clip(np.floor(np.log10(np.maximum(np.abs(y), 1e-300))) + d, 0, d - 1)
        half_step = 0.45 * 10.0 ** (i - d + 1) / 2.0**i
        floor = 0.55 * 10.0 ** (1 - d) if fmt.signed else 10.0**-d  # below the smallest level
        assert np.all(np.abs(ours - y) <= np.maximum(half_step, floor) + 2e-7)
    else:  # half a step of 1/16; below the smallest level (1/16, zero excluded) rounded up to it
        assert np.all(np.abs(ours - y) <= np.where(y < 1 / 16, 1 / 16 - y, 1 / 32) + 2e-7)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_block_maximum_equal_values_and_zeros(fmt):
    b = fmt.block
    v = _blocks(fmt, n_blocks=4)
    v[:b] = 0.0  # an all-zero block
    v[b : 2 * b] = 0.3  # all equal
    if fmt.signed:
        v[2 * b : 3 * b : 2] = 0.0  # zeros inside a block
        v[2 * b + 1] = -5.0  # a negative maximum
    codes, scales = _encode(v, fmt)
    out = Q.decode(codes, scales, fmt, torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(scales).all()
    assert torch.equal(out[:b], torch.zeros(b))  # no NaN from 0/0: zeros
    assert torch.equal(out[b : 2 * b], v[b : 2 * b])  # equal values: exact
    for block, got in zip(v.view(-1, b), out.view(-1, b)):
        k = block.abs().argmax()
        assert got[k] == block[k]  # the block maximum: exact
    if fmt.signed:
        assert torch.equal(out[2 * b : 3 * b : 2], torch.zeros(b // 2))  # zeros stay zero
        assert out[2 * b + 1] == -5.0


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_non_finite_block_stays_non_finite_and_alone(fmt):
    v = _blocks(fmt, n_blocks=3)
    v[fmt.block + 5] = float("nan")
    codes, scales = _encode(v, fmt)
    out = Q.decode(codes, scales, fmt, torch.float32).view(3, -1)
    assert not torch.isfinite(out[1]).any()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    assert int(codes.max()) < 256  # every code is a valid index of the table


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.bits == 4], ids=lambda f: f.name)
def test_four_bit_codes_pack_two_per_byte_low_nibble_first(fmt):
    v = _blocks(fmt, n_blocks=1)
    codes, scales = _encode(v, fmt)
    assert codes.numel() == fmt.block // 2
    table = torch.tensor(_levels(fmt))
    lo, hi = codes.long() % 16, codes.long() // 16
    expect = torch.stack([table[lo], table[hi]], dim=1).reshape(-1) * scales.double()
    torch.testing.assert_close(Q.decode(codes, scales, fmt, torch.float64), expect, rtol=1e-7, atol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_padding_encodes_as_zero_and_does_not_count(fmt):
    b = fmt.block
    v = _blocks(fmt, n_blocks=2)
    v[b + b // 2 :] = 1e6  # garbage in the padding of the second block
    valid = torch.tensor([b, b // 2], dtype=torch.int32)
    codes, scales = _encode(v, fmt, Q.block_mask(valid, b))
    assert scales[1] == v[b : b + b // 2].abs().max()
    out = Q.decode(codes, scales, fmt, torch.float32)
    padding = out[b + b // 2 :]
    assert (padding.abs() <= scales[1] * (0.0 if fmt.signed else _levels(fmt)[0] + 1e-9)).all()
    ref_codes, ref_scales = _encode(v[: b + b // 2].clone().resize_(2 * b).zero_().index_copy_(
        0, torch.arange(b + b // 2), v[: b + b // 2]), fmt)
    assert torch.equal(scales, ref_scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_decoding_and_encoding_again_is_bit_identical(fmt):
    """What a skipped step, an inactive parameter's masked update or a checkpoint round trip relies on."""
    codes, scales = _encode(_blocks(fmt, seed=3), fmt)
    again_codes, again_scales = _encode(Q.decode(codes, scales, fmt, torch.float32), fmt)
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_full_state_is_exact(fmt):
    for value in (0.0, 0.25, -0.5):
        if value < 0 and not fmt.signed:
            with pytest.raises(ValueError, match="unsigned"):
                Q.QuantizedState.full(fmt.block, value, fmt, "cpu")
            continue
        s = Q.QuantizedState.full(2 * fmt.block, value, fmt, "cpu")
        assert torch.equal(s.decode(torch.float32), torch.full((2 * fmt.block,), value))


@pytest.mark.slow
@pytest.mark.skipif(not compile_available("cpu")[0], reason=f"torch.compile unavailable: {compile_available('cpu')[1]}")
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_compiled_encode_gives_the_eager_codes(fmt):
    v = _blocks(fmt, seed=7)
    Q.warm_tables(fmt, torch.float32, torch.device("cpu"))
    codes, scales = _encode(v, fmt)

    def enc(values, c, s):
        Q.encode_(values, c, s, fmt)

    c2, s2 = torch.empty_like(codes), torch.empty_like(scales)
    try:
        torch.compile(enc, dynamic=True)(v, c2, s2)
    finally:  # torch 2.4 + gcc < 13: loading the -ffast-math kernel turned on flush-to-zero (conftest checks)
        torch.set_flush_denormal(False)
    assert torch.equal(s2, scales)
    assert torch.equal(c2, codes)
