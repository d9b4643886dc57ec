"""The block-wise 8-bit and 4-bit codes of ``dml_optim.core.quant`` against their definition (docs/design.md §5).

The oracle is written here from the definition, in float64 NumPy: the level
table of each format (the current codebook at 8 bits: ``root``, ``(k / K)**4``
as float32 evaluates ``((k * float32(1/K))**2)**2``, index 0 of the unsigned
state at ``k = 0.5``; at 4 bits and in the second codebook: ``asinh``,
``sinh(asinh(S) k / K) / S`` for the signed states, ``pow``, ``(k / K)**(1/p)``
with index 0 at ``(0.5 / K)**(1/p)`` for the unsigned ones; the first codebook, still read
from checkpoints: dynamic exponent ``10**(i - D + 1) * (0.1 + 0.9 * j / 2**i)``
for magnitude index ``k = 2**i - 1 + j``, linear ``(k + 1) / 16``).  Checked per block:

* the error bound: the current codes round to the nearest level in the
  companded domain (``asinh(S y)``, ``y**p``), so a decoded value is within
  half a companded step of the original (:meth:`StateFormat.bound`); the first
  codebook's codes are the table's nearest level (within half a step of the
  decade, ``0.45 * 10**(i - D + 1) / 2**i`` of the block maximum, or, linear,
  ``1/32``);
* zeros stay zero (signed formats: 0 is a level), a block of equal values and
  the block maximum are exact, an all-zero block gives no NaN and decodes to
  zeros (every format), a non-finite block stays non-finite, and only it;
* 4-bit packing: element ``2t`` in the low nibble; padding (a mask) encodes as 0
  and does not count towards the maximum;
* the eager encoder and decoder: their op counts, nothing allocated with the
  caller's scratch, every op native on DirectML's table;
* the same codes from the eager ops and from ``torch.compile`` (``root``: up to a neighbouring code, rarely),
  and the compiled ``root`` decoder's arithmetic equal to the table.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dml_optim.core import quant as Q
from dml_optim.backends.compiled import compile_available

CURRENT = [Q.format_for(bits, signed, Q.CODEBOOK) for bits in (8, 4) for signed in (True, False)]
SECOND = [f for f in (Q.format_for(bits, signed, Q.SECOND_CODEBOOK) for bits in (8, 4) for signed in (True, False))
          if f not in CURRENT]
CLOSED = CURRENT + SECOND  # (the closed-form codes)
BUCKETED = [f for f in CLOSED if f.kind in ("asinh", "pow")]  # (the compiled encoder's bucket lookup)
LEGACY = [Q.format_for(bits, signed, Q.LEGACY_CODEBOOK) for bits in (8, 4) for signed in (True, False)]
FORMATS = CLOSED + LEGACY
IDS = [f.name for f in FORMATS]


def _magnitudes(fmt) -> list[float]:
    """Level of each magnitude index ``k = 0 .. K``, from the definition."""
    if fmt.kind == "asinh":
        K, S = 2 ** (fmt.bits - 1) - 1, fmt.param
        return [math.sinh(math.asinh(S) * k / K) / S for k in range(K)] + [1.0]
    if fmt.kind == "pow":
        K = 2**fmt.bits - 1
        return [(0.5 / K) ** (1 / fmt.param)] + [(k / K) ** (1 / fmt.param) for k in range(1, K)] + [1.0]
    if fmt.kind == "root":  # float32 arithmetic, as the definition says
        K = 2 ** (fmt.bits - 1) - 1 if fmt.signed else 2**fmt.bits - 1
        t = np.maximum(np.arange(K + 1, dtype=np.float32), np.float32(0.5 if not fmt.signed else 0)) * np.float32(1 / K)
        t = t * t
        return [float(x) for x in t * t]
    if fmt.kind == "linear":
        return [(k + 1) / 16 for k in range(16)]
    d = fmt.bits - 1 if fmt.signed else fmt.bits
    mags = [0.0 if fmt.signed else 10.0**-d]
    for i in range(d):
        mags += [10.0 ** (i - d + 1) * (0.1 + 0.9 * j / 2**i) for j in range(1, 2**i + 1)]
    return mags


def _levels(fmt) -> np.ndarray:
    """The table of ``fmt``, from the definition (float64), indexed by code."""
    mags = _magnitudes(fmt)
    n = 2**fmt.bits
    if not fmt.signed:
        return np.array(mags)
    base = n // 2
    out = np.zeros(n)
    for c in range(1, n):
        k = c - base
        out[c] = math.copysign(mags[abs(k)], k) if k else 0.0
    out[0] = out[1]  # (no value encodes to code 0)
    return out


def _compand(fmt, a: np.ndarray) -> np.ndarray:
    """The companded index (before rounding) of ``a = |y|``."""
    if fmt.kind == "asinh":
        K = 2 ** (fmt.bits - 1) - 1
        return np.arcsinh(fmt.param * a) * K / math.asinh(fmt.param)
    return (2 ** (fmt.bits - 1) - 1 if fmt.signed else 2**fmt.bits - 1) * a**fmt.param


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


@pytest.mark.parametrize("fmt", CLOSED, ids=lambda f: f.name)
def test_round_trip_is_the_nearest_companded_level_within_the_bound(fmt):
    v = _blocks(fmt, spread=9.0)
    codes, scales = _encode(v, fmt)
    decoded = Q.decode(codes, scales, fmt, torch.float64)
    blocks = v.double().view(-1, fmt.block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    assert torch.equal(scales.double().view(-1, 1), absmax)
    y = (blocks / absmax).numpy()
    ours = (decoded.view(-1, fmt.block) / absmax).numpy()
    mags = np.array(_magnitudes(fmt))
    u = _compand(fmt, np.abs(y))
    gap = np.abs(np.abs(ours[..., None]) - mags)  # the index each value decoded to: a level, to float32 rounding
    index = gap.argmin(-1)
    assert np.all(gap.min(-1) <= 1e-6 * mags[index])
    # the nearest index in the companded domain, up to float32 rounding at a tie between two levels
    assert np.all(np.abs(index - u) <= 0.5 + 1e-4), np.abs(index - u).max()
    assert np.all(np.sign(ours) == np.where(index == 0, 0, np.sign(y)) if fmt.signed else ours > 0)
    bound = np.vectorize(fmt.bound)(y)
    assert np.all(np.abs(ours - y) <= bound * (1 + 1e-4) + 1e-7), np.abs(ours - y).max()


@pytest.mark.parametrize("fmt", CLOSED, ids=lambda f: f.name)
def test_the_documented_bound(fmt):
    """The bound is half a companded step.  ``asinh``: within ``sqrt(1 + (S y)**2) * (exp(A / 2K) - 1) / S``
    of ``y`` (``A = asinh(S)``): relative ``exp(A / 2K) - 1`` well above ``1/S`` (8 bits: 4.0% from 1e-3
    up; 4 bits: 18%), absolute ``(exp(A / 2K) - 1) / S`` at 0.  ``pow``: relative ``((u + 0.5) / u)**(1/p) - 1``
    (``u = K y**p``), and below the smallest level the distance up to it."""
    K = fmt.magnitudes
    if fmt.kind == "asinh":
        A, S = math.asinh(fmt.param), fmt.param
        for y in np.geomspace(1e-9, 1.0, 200):
            assert fmt.bound(y) <= math.sqrt(1 + (S * y) ** 2) * (math.exp(A / (2 * K)) - 1) / S * (1 + 1e-6)
        assert fmt.bound(0.0) <= (math.exp(A / (2 * K)) - 1) / S
    else:
        for y in np.geomspace(1e-12, 1.0, 200):
            u = K * y**fmt.param
            if u >= 1:
                assert fmt.bound(y) / y <= ((u + 0.5) / u) ** (1 / fmt.param) - 1 + 1e-12
            elif u < 0.5:
                assert fmt.bound(y) == fmt.level(0) - y
        assert fmt.bound(0.0) == fmt.level(0)


@pytest.mark.parametrize("fmt", LEGACY, ids=lambda f: f.name)
def test_first_codebook_round_trip_is_the_nearest_level_of_each_block(fmt):
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
    """The same scales and, for the bucket lookup (``asinh``, ``pow``: found from the eager encoder), the same
    codes bit for bit; the compiled ``root`` (two square roots against the eager ``pow``) and the first
    codebook's compiled ``log10`` may put a value on the other side of a rounding boundary: one level apart,
    rarely (``root``: values spread over 7 decades, at most 1 in 10,000)."""
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
    if fmt.bits == 4:
        codes, c2 = (torch.stack((c % 16, c // 16), -1).flatten() for c in (codes, c2))
    if fmt in BUCKETED:
        assert torch.equal(c2, codes)
        return
    differ = codes.int() - c2.int()
    rare = codes.numel() // (10_000 if fmt.kind == "root" else 1000)
    assert differ.abs().max() <= 1 and (differ != 0).sum() <= max(1, rare), (differ != 0).sum()


def _wrapped(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (0 .. 2**32 - 1) as int32."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


@pytest.mark.parametrize("fmt", BUCKETED, ids=lambda f: f.name)
def test_the_bucket_encoder_gives_the_eager_codes_at_every_edge_and_between(fmt):
    """The compiled kernel's encoder (:func:`quant.encode_buckets`: a bucket of the float's sign, exponent and top
    mantissa bits, one table entry, one compare) against the one definition of a code (:func:`quant.compand_`,
    the eager encoder's ops) on: every float32 within 4 ulps of each bucket's edge and of each bucket's ends
    (every place a code can change), and a million values spread uniformly and log-uniformly over
    ``[-divisor, divisor]`` (``[0, divisor]`` unsigned), subnormals and zeros of both signs included; up to
    1.01 times the divisor (a value over its block's divisor is at most the divisor, to rounding)."""
    shift, entry = Q.bucket_tables(fmt, "cpu")
    n = entry.numel()
    bucket = torch.arange(n, dtype=torch.int64)
    low = (entry >> 10).to(torch.int64)
    has_edge = (((entry >> 8) & 3) != 1) & (low > 0)
    starts = (bucket << shift) & 0xFFFFFFFF
    places = [starts[has_edge] + low[has_edge], starts, starts + (1 << shift) - 1]
    bits = torch.cat([p + d for p in places for d in range(-4, 5)])
    bits = _wrapped(bits.clamp(0, (1 << 32) - 1))
    y = bits.view(torch.float32)
    D = fmt.divisor
    y = y[(y.abs() <= 1.01 * D) & (y >= 0 if not fmt.signed else y == y)]  # (|y| <= divisor, to rounding)
    g = torch.Generator().manual_seed(3)
    spread = [torch.rand(1 << 19, generator=g) * D,
              torch.exp(torch.empty(1 << 19).uniform_(-100.0, math.log(D), generator=g)),
              torch.tensor([0.0, -0.0, 1e-45, 1e-40, D, 1.01 * D, float(np.nextafter(np.float32(D), np.float32(0)))])]
    if fmt.signed:
        spread += [-t for t in spread]
    y = torch.cat([y] + [t[t >= 0] if not fmt.signed else t for t in spread]).to(torch.float32)
    y = torch.cat([y, torch.zeros((-y.numel()) % 256)])  # (whole blocks: the eager ops' vectorized loop)
    want = Q.compand_(y.clone(), fmt)
    got = Q.encode_buckets(y, fmt)
    bad = (want != got).nonzero().flatten()
    assert bad.numel() == 0, [(y[i].item(), want[i].item(), got[i].item()) for i in bad[:5]]
    assert has_edge.sum() >= 2 * fmt.magnitudes if fmt.signed else fmt.magnitudes  # every level's edge is found


@pytest.mark.parametrize("fmt", CLOSED, ids=lambda f: f.name)
def test_the_eager_encoder_and_decoder_are_few_native_ops_that_allocate_nothing(fmt):
    """With the caller's scratch (a per-block float tensor for the encoder, an int32 index for the decoder),
    the encoder works in the values it is given: 7 ops (signed ``asinh``), 8 (signed ``root``, with a work
    tensor) or 6 (unsigned), one more at 4 bits (the nibbles' packing); the decoder 3; every op native on
    DirectML, no sync, nothing allocated."""
    import dml_optim
    from dml_optim.audit import audit_call

    p = torch.nn.Parameter(torch.zeros(1))
    opt = dml_optim.SGD([p], lr=0.1, backend="eager")  # (the audit records any code through an optimizer)
    v = _blocks(fmt, n_blocks=8)
    codes, scales = _encode(v, fmt)
    per = 2 if fmt.bits == 4 else 1
    c2, s2 = torch.empty_like(codes), torch.empty_like(scales)
    small = torch.empty_like(scales)
    index = torch.empty(Q.index_elements(fmt, v.numel()), dtype=torch.int32)
    out = torch.empty_like(v)
    work, scratch = v.clone(), torch.empty_like(v)
    Q.warm_tables(fmt, torch.float32, torch.device("cpu"))
    enc = audit_call(opt, lambda: Q.encode_into(work, c2, s2, fmt, small=small, work=scratch))
    dec = audit_call(opt, lambda: Q.decode_into(c2, s2, fmt, out, index))
    assert enc.total_ops == (6 + fmt.signed + (fmt.kind == "root" and fmt.signed) + (fmt.bits == 4)), enc.format()
    assert dec.total_ops == 3, dec.format()
    for report in (enc, dec):
        assert report.allocations == 0 and report.host_syncs == 0 and report.fallbacks == [], report.format()
        assert report.all_native, report.non_native()
    assert torch.equal(c2, codes) and torch.equal(s2, scales)  # the same codes as encode_, which keeps its input
    assert torch.equal(out, Q.decode(codes, scales, fmt, torch.float32))
    assert codes.numel() * per == v.numel()


def test_checkpoint_formats_stay_readable():
    """The first and second codebooks' formats are still known by name and decode as they did (their own tables)."""
    for fmt in LEGACY:
        assert Q.format_named(fmt.name) is fmt and fmt.legacy
        assert Q.format_for(fmt.bits, fmt.signed, Q.LEGACY_CODEBOOK) is fmt
    for fmt in SECOND:
        assert Q.format_named(fmt.name) is fmt and not fmt.legacy
        assert Q.format_for(fmt.bits, fmt.signed, Q.SECOND_CODEBOOK) is fmt
    assert {f.name for f in CURRENT}.isdisjoint(f.name for f in LEGACY + SECOND)
    assert {f.kind for f in SECOND} == {"asinh", "pow"} and len(SECOND) == 2  # (8 bits; the 4-bit codes are shared)
    assert Q.ACTIVE_CODEBOOK == Q.CODEBOOK == "dml-optim-blockwise-3"  # new states, and the name checkpoints say
    with pytest.raises(ValueError, match="unknown quantized state codebook"):
        Q.format_for(8, True, "dml-optim-blockwise-0")


def test_chunk_elements():
    from dml_optim.backends.eager import chunk_elements  # (the eager backend's chunk sizing)

    mib = 1 << 20
    # 12 bytes of scratch per chunk element: 32 MiB gives chunks of at most 2.79M elements, made equal
    size = chunk_elements(25_600_000, 12, ops_per_chunk=27)
    assert size % 256 == 0 and size * 12 <= 32 * mib
    assert -(-25_600_000 // size) == 10
    big = chunk_elements(124_000_000, 12, ops_per_chunk=27)  # 0.5 B/param: 62 MB of scratch
    assert big * 12 <= 0.5 * 124_000_000 and -(-124_000_000 // big) == 25
    assert chunk_elements(1000, 12, ops_per_chunk=27) == 1024  # one chunk, whole blocks
    with pytest.raises(ValueError, match="over 200"):
        chunk_elements(25_600_000, 12, ops_per_chunk=27, max_ops=200)


@pytest.mark.parametrize("fmt", [f for f in CURRENT if f.kind == "root"], ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_the_root_decoders_arithmetic_is_the_table_for_every_code(fmt, path):
    """The compiled kernel decodes a ``root`` code by arithmetic (:func:`quant.root_levels`), not a gather: equal
    to the table (the oracle's float32 evaluation of ``(k / K)**4``) for every code, eagerly and compiled."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = torch.tensor(_levels(fmt), dtype=torch.float32)
    if path == "eager":
        assert torch.equal(Q.root_levels(codes, fmt), want)
        assert torch.equal(Q.decode(codes, torch.ones(1), fmt, torch.float32), want)
        return
    if not compile_available("cpu")[0]:
        pytest.skip(f"torch.compile unavailable: {compile_available('cpu')[1]}")
    try:
        got = torch.compile(lambda c: Q.root_levels(c, fmt), dynamic=True)(codes)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", [f for f in CURRENT if f.kind == "root"], ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_every_root_level_encodes_to_its_own_code_on_both_paths(fmt, path):
    """Every code's decoded value (at a few block scales) encodes back to that code, eagerly and compiled: the
    eager ``pow`` and the compiled square roots differ only near a rounding edge, never at a level (what a
    skipped step and a checkpoint round trip rely on); signed code 0, which no value encodes to, decodes as 1."""
    if path == "compiled" and not compile_available("cpu")[0]:
        pytest.skip(f"torch.compile unavailable: {compile_available('cpu')[1]}")
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.clone()
    if fmt.signed:
        want[0] = 1
    for scale in (1.0, 3.7e-3, 123.4, 2.5e-20):
        values = Q.decode(codes, torch.tensor([scale]), fmt, torch.float32)
        c, s = torch.empty_like(codes), torch.empty(1)
        if path == "eager":
            Q.encode_(values, c, s, fmt)
        else:
            try:
                torch.compile(lambda v, c, s: Q.encode_(v, c, s, fmt), dynamic=True)(values, c, s)
            finally:
                torch.set_flush_denormal(False)
        assert s.item() == values.abs().max().item()
        assert torch.equal(c, want), (scale, (c.int() - want.int()).nonzero().flatten()[:5].tolist())
