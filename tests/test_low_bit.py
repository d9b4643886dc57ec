"""8-bit and 4-bit optimizer state (``state_bits``, issue 21): every optimizer, every path that steps.

The oracles: the same optimizer with full-precision state (the quantization
is a storage format, so the rule and everything around it are the ones tested
elsewhere against torch.optim and the float64 references), the codec's own
definition (tests/test_quant.py), and exact equality where the scheme makes it
exact (a skipped step, a parameter without a gradient, a checkpoint round
trip: decoding and encoding again is bit-identical).

The model has two parameters of at least 4096 elements whose sizes are not
multiples of the block (4160 and 8320: their buffer is padded) and small ones
that keep full-precision state (bitsandbytes' threshold).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import os
import re
import subprocess
import sys

import pytest
import torch

import dml_optim
from dml_optim.core import quant as Q
from dml_optim.audit import audit_step
from dml_optim.backends.compiled import compile_available
from dml_optim.optimizers import registry

NAMES = sorted(registry.OPTIMIZERS)
BITS = (8, 4)
#: hyperparameters of each optimizer for these runs (a moment for SGD: without one it keeps no state)
HYPER = {"adam": dict(lr=1e-3, epsilon=1e-8), "dml-adam": dict(lr=1e-3), "adamw": dict(lr=1e-3),
         "adagrad": dict(lr=1e-2), "momentum": dict(lr=1e-2, alpha=0.9), "sgd": dict(lr=1e-2, momentum=0.9),
         "lion": dict(lr=3e-4)}
_COMPILED = pytest.mark.skipif(not compile_available("cpu")[0],
                               reason=f"torch.compile unavailable here: {compile_available('cpu')[1]}")
BACKENDS = [pytest.param("eager"), pytest.param("compiled", marks=[pytest.mark.slow, _COMPILED])]


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 130), torch.nn.Tanh(), torch.nn.Linear(130, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).to(dtype)


def _batches(steps, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        out.append((x.to(dtype), torch.tanh(x @ w).to(dtype)))
    return out


def _train(model, opt, batches):
    loss = None
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return float(loss)


def _build(name, model, bits, **kw):
    return registry.build(name, model.parameters(), state_bits=bits, **{**HYPER[name], **kw})


def _quantized(opt):
    return [(i, s) for i in opt.flat_buffers() for s in i.states.values() if isinstance(s, Q.QuantizedState)]


def _state_snapshot(opt):
    out = []
    for info in opt.flat_buffers():
        for name, s in sorted(info.states.items()):
            out += [t.clone() for t in (s.tensors() if isinstance(s, Q.QuantizedState) else [s])]
    return out


# -- quality ---------------------------------------------------------------------------------------

#: trajectory distance to the full-precision run over 200 steps, relative to how far that run moved
#: (observed on this model: 8-bit 0.013 to 0.041, 4-bit 0.18 to 0.46: a 4-bit code keeps 15 levels, so
#: the state is off by up to a tenth of its block maximum each step and the two runs drift apart; the
#: loss is what must stay as good); and the final loss relative to the full-precision one (observed:
#: 8-bit 0.97 to 1.00, 4-bit 0.85 to 0.99)
DRIFT = {8: 0.08, 4: 0.6}
LOSS = {8: 1.03, 4: 1.15}
#: Lion's update is the sign of an interpolation: a quantization error of the momentum flips the sign of every
#: element whose interpolation is within that error of 0, and each flip moves the element by 2 lr, so the
#: trajectory drifts further for the same loss (observed: 8-bit 0.094, 4-bit 0.68; the loss bound is the same)
DRIFT_OF = {"lion": {8: 0.15, 4: 0.9}}


@functools.lru_cache(maxsize=None)
def _full_precision_run(name):
    """(initial parameters, final parameters, final loss) of 200 full-precision steps (shared by the cases)."""
    ref_model = _model()
    x0 = torch.cat([p.detach().flatten() for p in ref_model.parameters()])
    ref_loss = _train(ref_model, _build(name, ref_model, None, backend="eager"), _batches(200))
    return x0, torch.cat([p.detach().flatten() for p in ref_model.parameters()]), ref_loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_two_hundred_steps_stay_close_to_full_precision(name, bits, backend):
    x0, ref, ref_loss = _full_precision_run(name)
    model = _model()
    opt = _build(name, model, bits, backend=backend)
    loss = _train(model, opt, _batches(200))
    assert len(_quantized(opt)) == len(type(opt).group_state_names(opt.param_groups[0]))
    ours = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(ours).all()
    assert float((ours - ref).norm() / (ref - x0).norm()) < DRIFT_OF.get(name, DRIFT)[bits]
    assert loss < ref_loss * LOSS[bits]
    if backend == "compiled":
        assert opt.resolved_backends() == [["compiled", "compiled"]]


@pytest.mark.slow
@_COMPILED
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_the_compiled_step_gives_the_eager_codes(name, bits):
    """From one state, one step eager and one compiled: the same parameters (to float32 rounding: the
    fused kernel contracts multiply-adds) and the same codes, except where that rounding lands a value on
    the other side of a level's boundary (then one level apart; observed: 0 to 3 codes in 12,544)."""
    batches = _batches(5)
    models = [_model(), _model()]
    opts = [_build(name, m, bits, backend=b) for m, b in zip(models, ("eager", "compiled"))]
    _train(models[0], opts[0], batches[:4])
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    with torch.no_grad():
        for p, q in zip(models[1].parameters(), models[0].parameters()):
            p.copy_(q)
    for m, o in zip(models, opts):
        _train(m, o, batches[4:])
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for (_, a), (_, b) in zip(_quantized(opts[1]), _quantized(opts[0])):
        if bits == 4:
            ca = torch.stack((a.codes % 16, a.codes // 16), -1).flatten().int()
            cb = torch.stack((b.codes % 16, b.codes // 16), -1).flatten().int()
        else:
            ca, cb = a.codes.int(), b.codes.int()
        differ = (ca != cb).sum().item()
        assert (ca - cb).abs().max() <= 1 and differ <= max(1, ca.numel() // 1000), differ
        torch.testing.assert_close(a.scales, b.scales, rtol=1e-5, atol=0)


def _compiled_run(monkeypatch, scratch_bound: int | None, one_call: bool | None = None):
    """8-bit AdamW on the compiled backend, 3 steps over one parameter of 4 x 33 blocks less 50 elements (the
    eager scratch bound lowered to ``scratch_bound`` bytes; ``one_call`` False: the CPU taken out of
    ``dml_optim.testing.one_call_devices()``, as on a torch whose kernel writes temporaries per element): its parameter,
    the optimizer and its kernel calls (the blocks of each)."""
    from dml_optim import testing
    from dml_optim.backends import eager

    if scratch_bound is not None:
        monkeypatch.setattr(eager, "MIN_SCRATCH", scratch_bound)
    devices = testing.one_call_devices() if one_call is None else ("cpu",) if one_call else ()
    with testing.large_quantized_buffers_in_one_call(devices), testing.kernel_calls() as records:
        params = [torch.nn.Parameter(torch.randn(4 * 33 * 256 - 50, generator=torch.Generator().manual_seed(0)))]
        opt = dml_optim.AdamW(params, lr=1e-3, state_bits=8, backend="compiled")
        for step in range(3):
            params[0].grad = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(step + 1))
            opt.step()
    assert opt.flat_buffers()[0].backend == "compiled"
    assert opt.flat_buffers()[0].step_counts == (3,)
    return params[0].detach(), opt, [r.args[0].shape[0] for r in records]  # (the first operand's blocks)


def _one_call_here() -> bool:
    from dml_optim.testing import one_call_devices

    return "cpu" in one_call_devices()


@_COMPILED
@pytest.mark.slow
@pytest.mark.skipif(not _one_call_here(), reason=f"torch {torch.__version__}: the compiled kernel writes temporaries "
                    "per element on the CPU here and runs in chunks (dml_optim.testing.one_call_devices(); the chunks' test "
                    "covers it)")
def test_the_compiled_kernel_takes_a_large_quantized_buffer_in_one_call(monkeypatch):
    """Where the kernel realizes nothing per element (the CPU from torch 2.13: inductor told to recompute, not store, each value), a
    quantized buffer far over the eager scratch bound (lowered here to one block) still takes one call a step."""
    _, _, calls = _compiled_run(monkeypatch, 256)
    assert calls == [4 * 33] * 3


@_COMPILED
@pytest.mark.slow
def test_the_compiled_kernel_runs_a_large_quantized_buffer_in_chunks_where_it_writes_temporaries(monkeypatch):
    """Where the kernel may materialize temporaries per element (torch before 2.13, CUDA), a quantized buffer
    whose decoded states would pass the eager scratch bound runs through it in chunks (here the bound lowered
    to make four), with the same result as one call and its step count advanced once a step."""
    one, opt_one, calls_one = _compiled_run(monkeypatch, None)
    assert calls_one == [4 * 33] * 3
    four, opt_four, calls = _compiled_run(monkeypatch, 2 * 4 * 33 * 256, one_call=False)  # two states of 33 blocks
    assert calls == [33] * 12
    assert torch.equal(four, one)
    for (_, a), (_, b) in zip(_quantized(opt_four), _quantized(opt_one)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@_COMPILED
def test_the_compiled_8bit_kernel_returns_each_root_states_block_factor(monkeypatch):
    """On the CPU the compiled 8-bit AdamW kernel returns, per fourth-root state, the factor every element of a
    block is multiplied by before its roots (so that inductor computes it once per block, not at every vector of
    16 elements: quant.encode_), equal to its definition from the new block maxima, in float32:
    ``1 / (absmax / divisor + 2**-126)`` for the signed first moment, its square root for the second; then the
    step's scalars (0-d)."""
    import numpy as np

    from dml_optim.testing import kernel_calls

    with kernel_calls() as records:
        p = torch.nn.Parameter(torch.randn(33 * 256 - 50, generator=torch.Generator().manual_seed(0)))
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-2
        opt = dml_optim.AdamW([p], lr=1e-3, state_bits=8, backend="compiled")
        opt.step()
    returned = [r.out for r in records]
    assert opt.flat_buffers()[0].backend == "compiled" and len(returned) == 1
    states = dict(opt.flat_buffers()[0].states)
    factors, scalars = returned[0][:2], returned[0][2:]
    assert [f.shape for f in factors] == [(33, 1)] * 2 and scalars and all(t.dim() == 0 for t in scalars)
    for factor, name in zip(factors, ("exp_avg", "exp_avg_sq")):
        s = states[name]
        assert s.format.kind == "root" and s.format.signed == (name == "exp_avg")
        absmax = s.scales.numpy().astype(np.float32)
        want = np.float32(1) / (absmax * np.float32(1 / s.format.divisor) + np.float32(2.0**-126))
        if not s.format.signed:
            want = np.sqrt(want)
        torch.testing.assert_close(factor.reshape(-1), torch.from_numpy(want), rtol=1e-6, atol=0)


_PEAK_CHILD = """
import gc, torch, dml_optim
from dml_optim.backends import eager
eager.MIN_SCRATCH = 4 << 20  # (the step's own memory bound: 4 MiB here, 0.25 B/param of this buffer)
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
torch.manual_seed(0)
n = 1 << 22
p = torch.nn.Parameter(torch.randn(n) * 0.1)
p.grad = torch.randn(n) * 1e-2
opt = dml_optim.AdamW([p], lr=1e-3, weight_decay=1e-2, state_bits=8, backend="compiled")
for _ in range(3):
    opt.step()
assert opt.flat_buffers()[0].backend == "compiled"
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
for _ in range(3):
    opt.step()
print(status("VmHWM") - before)
"""


@_COMPILED
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="the resident peak is read from /proc/self/status after a reset (Linux only)")
def test_the_compiled_low_bit_step_keeps_its_own_memory_within_the_scratch_bound():
    """Issue 34, item 5: the compiled 8-bit step's own memory, measured as the resident peak above the resident
    set in a fresh process (every allocation its own mapping: ``MALLOC_MMAP_THRESHOLD_``), stays within the
    scratch bound (lowered to 4 MiB, 0.25 B/param of the 4M-element buffer): where the kernel realizes nothing
    per element (the CPU from torch 2.13) it allocates a few floats per block in one call, elsewhere it runs in
    chunks.  A kernel that realized one float state in one call would add 16 MiB."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    assert peak <= 4 << 20, peak
    if _one_call_here():
        assert peak < 1 << 20, peak  # (a few floats per block: 16K blocks)


# -- memory ----------------------------------------------------------------------------------------


def _transformer():
    """2,621,456 parameters: a two-layer transformer encoder over a 2000-token vocabulary with a head
    (biases and LayerNorms, 0.33% of the parameters, keep full-precision state)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return torch.nn.ModuleDict(dict(embed=torch.nn.Embedding(2000, 256),
                                    body=torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                    head=torch.nn.Linear(256, 2000)))


def _expected_bytes(model, bits, states=2):
    """The layout's arithmetic: per quantized tensor (>= 4096 elements) whole blocks of codes plus a
    float32 scale per block; per smaller tensor float32 values; for each of ``states`` states."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if n >= Q.MIN_ELEMENTS:
            blocks = -(-n // Q.BLOCK[bits])
            total += blocks * Q.BLOCK[bits] * bits // 8 + 4 * blocks
        else:
            total += 4 * n
    return states * total


@pytest.mark.parametrize("bits, limit", [(8, 2.1), (4, 1.1)])
def test_state_bytes_per_parameter(bits, limit):
    """Item 2 of the issue: AdamW's state bytes per parameter, counted in ``state_dict()`` and in
    ``flat_buffers()`` (codes, scales, and the full-precision state of tensors under 4096 elements),
    on a model of 2.6M parameters.  The figure depends on the share of small tensors: an MNIST-sized
    MLP (784-512-256-10, 535,818 parameters, its 2,560-element head and biases 0.62%) gives 2.07 and
    1.106 (the README's table); the exact arithmetic is checked on both."""
    model = _transformer()
    n = sum(p.numel() for p in model.parameters())
    assert n >= 500_000
    opt = dml_optim.AdamW(model.parameters(), state_bits=bits)
    _train_tokens(model, opt)
    saved = _saved(opt.state_dict())
    from_state_dict = sum(t.numel() * t.element_size() for e in saved["state"].values()
                          for k, t in e.items() if k != "step")
    from_buffers = sum(s.nbytes if isinstance(s, Q.QuantizedState) else s.numel() * s.element_size()
                       for i in opt.flat_buffers() for s in i.states.values())
    assert from_state_dict == from_buffers == _expected_bytes(model, bits)
    assert from_buffers / n <= limit, from_buffers / n
    mlp = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    opt = dml_optim.AdamW(mlp.parameters(), state_bits=bits)
    g = torch.Generator().manual_seed(0)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(mlp(torch.randn(16, 784, generator=g)), torch.randint(0, 10, (16,))).backward()
    opt.step()
    assert sum(s.nbytes if isinstance(s, Q.QuantizedState) else s.numel() * s.element_size()
               for i in opt.flat_buffers() for s in i.states.values()) == _expected_bytes(mlp, bits)


def _train_tokens(model, opt, steps=2):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, 2000, (4, 16), generator=g)
        opt.zero_grad()
        logits = model["head"](model["body"](model["embed"](tokens)))
        torch.nn.functional.cross_entropy(logits.reshape(-1, 2000), tokens.reshape(-1)).backward()
        opt.step()


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_resumes_bit_identically(name, bits):
    batches = _batches(8)
    model = _model()
    opt = _build(name, model, bits, backend="eager")
    _train(model, opt, batches)
    expected = [p.detach().clone() for p in model.parameters()]
    expected_state = _state_snapshot(opt)

    model = _model()
    opt = _build(name, model, bits, backend="eager")
    _train(model, opt, batches[:4])
    ckpt = _saved({"model": model.state_dict(), "opt": opt.state_dict()})
    assert ckpt["opt"]["dml_optim"]["quantization"] == Q.ACTIVE_CODEBOOK  # the codebook's name
    entry = ckpt["opt"]["state"][0]
    first = type(opt).state_names[0]
    assert entry[f"{first}_codes"].dtype == torch.uint8 and entry[f"{first}_absmax"].dtype == torch.float32
    block = Q.BLOCK[bits]
    assert entry[f"{first}_codes"].numel() == -(-4160 // block) * block // (2 if bits == 4 else 1)  # whole blocks
    model2 = _model(seed=5)
    model2.load_state_dict(ckpt["model"])
    opt2 = _build(name, model2, bits, backend="eager")
    opt2.load_state_dict(ckpt["opt"])
    _train(model2, opt2, batches[4:])
    _assert_bit_identical(model2, opt2, expected, expected_state)


def _assert_bit_identical(model, opt, params, state):
    """``model``'s parameters and ``opt``'s quantized state (codes and scales) equal the snapshots, bit for bit."""
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p.detach(), q)
    for a, b in zip(_state_snapshot(opt), state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", BITS)
def test_checkpoints_move_between_precisions(bits):
    """Full precision (ours, or torch.optim.AdamW's) into low-bit: quantized; low-bit into full precision:
    decoded; and back again: the same codes (decoding and encoding again is exact)."""
    batches = _batches(3)
    model = _model()
    low = _build("adamw", model, bits)
    _train(model, low, batches)
    full = dml_optim.AdamW(_model().parameters(), lr=1e-3)
    full.load_state_dict(_saved(low.state_dict()))
    for (info, q), name in zip(_quantized(low), ("exp_avg", "exp_avg_sq")):
        p = model[0].weight
        decoded = q.decode(torch.float32)[: p.numel()].view(p.shape)
        fp = full.state[full.param_groups[0]["params"][0]][name]
        assert torch.equal(fp, decoded)
        assert torch.equal(low.state[p][name], decoded)  # optimizer.state shows the decoded values
    twin = torch.optim.AdamW(_model().parameters(), lr=1e-3)
    twin.load_state_dict(_saved(full.state_dict()))
    again = _build("adamw", _model(), bits)
    again.load_state_dict(_saved(twin.state_dict()))  # torch.optim's checkpoint into low-bit
    for (_, a), (_, b) in zip(_quantized(again), _quantized(low)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    other = _build("adamw", _model(), 12 - bits)  # 8-bit into 4-bit and back: decoded and encoded again
    other.load_state_dict(_saved(low.state_dict()))
    assert all(s.format.bits == 12 - bits for _, s in _quantized(other))


def _saved_values(sd, bits, cls, codebook, params):
    """Per parameter index and state name: the values a low-bit state dict holds (decoded with its formats,
    padding cut off), as ``{(index, name): tensor}``."""
    out = {}
    for pid, entry in sd["state"].items():
        for key in entry:
            if key.endswith("_codes"):
                name = key[: -len("_codes")]
                fmt = Q.format_for(bits, name not in cls.unsigned_states, codebook)
                out[(pid, name)] = Q.decode(entry[key], entry[f"{name}_absmax"], fmt, torch.float32)[: params[pid].numel()]
            elif key != "step" and not key.endswith("_absmax"):
                out[(pid, key)] = entry[key].reshape(-1)
    return out


def _within_bound(loaded, saved, fmt):
    """Every loaded element within ``fmt``'s bound of the saved one, blocks laid from the parameter's first
    element (a padding that shifted the values would put them in the wrong blocks, far outside)."""
    n = saved.numel()
    padded = torch.zeros(-(-n // fmt.block) * fmt.block)
    padded[:n] = saved
    absmax = padded.view(-1, fmt.block).abs().amax(1, keepdim=True).expand(-1, fmt.block).reshape(-1)[:n]
    y = (saved / torch.where(absmax > 0, absmax, torch.ones(()))).double()
    bound = torch.tensor([fmt.bound(float(t)) for t in y]) * absmax.double() * (1 + 1e-5) + 1e-12
    assert torch.all((loaded.double() - saved.double()).abs() <= bound)


@pytest.mark.parametrize("source,target", [(8, 4), (8, None), (4, 8), (None, 8)])
def test_checkpoints_load_across_formats_element_by_element(source, target):
    """A checkpoint saved with ``state_bits=source`` loads into ``state_bits=target`` (None: full precision):
    each loaded value is the saved one (full precision: exactly), or within the target code's bound of it,
    element by element, for parameters whose sizes are not whole numbers of blocks (4160 = 16.25 blocks of
    256, 32.5 of 128; 8320) and the small ones that stay in full precision."""
    batches = _batches(3)
    model = _model()
    opt = dml_optim.AdamW(model.parameters(), lr=1e-3, state_bits=source)
    _train(model, opt, batches)
    sd = _saved(opt.state_dict())
    codebook = sd["dml_optim"].get("quantization")
    saved = _saved_values(sd, source, dml_optim.AdamW, codebook, list(model.parameters())) if source else {
        (pid, k): v.reshape(-1) for pid, e in sd["state"].items() for k, v in e.items() if k != "step"}
    twin = _model(seed=3)
    other = dml_optim.AdamW(twin.parameters(), lr=1e-3, state_bits=target)
    other.load_state_dict(sd)
    params = list(twin.parameters())
    checked = 0
    for (pid, name), value in saved.items():
        p = params[pid]
        loaded = other.state[p][name].reshape(-1)  # (optimizer.state shows decoded values)
        assert loaded.numel() == p.numel() == value.numel()
        if target is None or p.numel() < Q.MIN_ELEMENTS:
            assert torch.equal(loaded, value.to(loaded.dtype)), (pid, name)
        else:
            _within_bound(loaded, value, Q.format_for(target, name not in dml_optim.AdamW.unsigned_states))
            checked += 1
    assert checked == (4 if target else 0)  # two padded matrices, two states each
    _train(twin, other, batches)  # and it steps on
    assert all(torch.isfinite(p).all() for p in twin.parameters())


@pytest.mark.parametrize("book", [Q.LEGACY_CODEBOOK, Q.SECOND_CODEBOOK])
def test_a_checkpoint_of_an_earlier_codebook_still_loads(book):
    """Codes saved with the first codebook (dynamic exponent, linear) or the second (asinh, power) decode with
    their own formats and are encoded again in the current ones: the loaded values are the old ones within the
    current code's bound."""
    model = _model()
    opt = dml_optim.AdamW(model.parameters(), lr=1e-3)  # full precision: the reference values
    _train(model, opt, _batches(3))
    full = _saved(opt.state_dict())
    sd = copy.deepcopy(full)
    sd["param_groups"][0]["state_bits"] = 8
    expected = {}
    for pid, entry in sd["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            if entry[name].numel() < Q.MIN_ELEMENTS:
                continue
            fmt = Q.format_for(8, name == "exp_avg", book)
            assert fmt.kind != "root"
            values = entry.pop(name).reshape(-1)
            padded = torch.zeros(-(-values.numel() // fmt.block) * fmt.block)
            padded[: values.numel()] = values
            codes, scales = torch.empty(padded.numel(), dtype=torch.uint8), torch.empty(padded.numel() // fmt.block)
            Q.encode_(padded, codes, scales, fmt)
            entry[f"{name}_codes"], entry[f"{name}_absmax"] = codes, scales
            expected[(pid, name)] = Q.decode(codes, scales, fmt, torch.float32)[: values.numel()]
    sd["dml_optim"]["quantization"] = book
    assert expected
    twin = _model(seed=3)
    other = dml_optim.AdamW(twin.parameters(), lr=1e-3, state_bits=8)
    other.load_state_dict(sd)
    params = list(twin.parameters())
    for (pid, name), value in expected.items():
        loaded = other.state[params[pid]][name].reshape(-1)
        fmt = Q.format_for(8, name == "exp_avg")
        assert fmt.kind == "root"  # (new states use the third codebook: the old codes are decoded and encoded again)
        _within_bound(loaded, value, fmt)
    assert other.state_dict()["dml_optim"]["quantization"] == Q.CODEBOOK == "dml-optim-blockwise-3"


def test_a_malformed_quantized_entry_is_refused_by_name():
    model = _model()
    opt = _build("adamw", model, 8)
    _train(model, opt, _batches(1))
    sd = _saved(opt.state_dict())
    sd["state"][0]["exp_avg_codes"] = sd["state"][0]["exp_avg_codes"][:-1]
    with pytest.raises(ValueError, match=r"exp_avg_codes'\] has shape \(4351,\), expected \(4352,\)"):
        _build("adamw", _model(), 8).load_state_dict(sd)
    sd = _saved(opt.state_dict())
    del sd["dml_optim"]["quantization"]
    with pytest.raises(ValueError, match="quantization=None"):
        _build("adamw", _model(), 8).load_state_dict(sd)
    for name in ("exp_avg", "exp_avg_sq"):  # a negative block maximum: every sign flipped, or NaN after a step
        sd = _saved(opt.state_dict())
        sd["state"][0][f"{name}_absmax"] = -sd["state"][0][f"{name}_absmax"]
        fresh = _build("adamw", _model(), 8)
        with pytest.raises(ValueError, match=rf"'{name}_absmax'\] holds \d+ negative block maxima"):
            fresh.load_state_dict(sd)
        assert fresh.state_dict()["state"] == {}  # (nothing was written)


# -- every path around the rule ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", BITS)
def test_a_skipped_step_leaves_parameters_and_quantized_state_bit_identical(bits, backend):
    model = _model()
    opt = _build("adamw", model, bits, backend=backend, nonfinite="skip")
    batches = _batches(3)
    _train(model, opt, batches[:2])
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_snapshot(opt)
    x, y = batches[2]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[2].weight.grad[3, 7] = float("inf")
    opt.step()
    _assert_bit_identical(model, opt, params, state)


@pytest.mark.parametrize("bits", BITS)
def test_a_parameter_without_a_gradient_keeps_its_quantized_state(bits):
    """torch.optim's rule (a ``None`` gradient: no update, no state change) holds bit for bit: the
    parameter's blocks are its own."""
    model = _model()
    opt = _build("adamw", model, bits)
    _train(model, opt, _batches(2))
    (info, first), _ = _quantized(opt)
    idx = list(info.param_indices).index(2)  # model[2].weight (4th in group order: 0, 1, 2, ...)
    p = model[2].weight
    lo = sum(-(-n // first.format.block) * first.format.block for n in
             [opt.param_groups[0]["params"][j].numel() for j in info.param_indices[:idx]])
    before = first[lo : lo + -(-p.numel() // first.format.block) * first.format.block].clone()
    value = p.detach().clone()
    x, y = _batches(1, seed=9)[0]
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    p.grad = None
    opt.step()
    assert torch.equal(p.detach(), value)
    after = _quantized(opt)[0][1]
    after = after[lo : lo + before.numel]
    assert torch.equal(after.codes, before.codes) and torch.equal(after.scales, before.scales)
    assert opt.state[p]["step"] == 2 and opt.state[model[0].weight]["step"] == 3


@pytest.mark.parametrize("bits", BITS)
def test_clipping_loss_scaling_atomic_and_capturable_work_with_quantized_state(bits):
    """The scaled, clipped, atomic, capturable run equals the plain run bit for bit when both compute the
    step's coefficients the same way.

    The reference is ``capturable=True`` too: a capturable step (and a step gated on a scaler's ``found_inf``)
    computes its coefficients (``lr / (1 - beta1**t)``, ...) with float32 tensor ops on the device, a plain
    one in Python's float64 on the host.  The two differ by about one float32 ulp, and near a decision
    boundary of the quantizer one ulp of an update flips one 8-bit code: a parameter then differs by a code
    step (2.3e-5 seen on an Intel Xeon VM, 0 on an AMD EPYC one), which no tolerance argued from float32
    rounding covers.  The loss scale is a power of two, so scaling and unscaling are exact, and the clip
    reads the same gradients: with the same coefficients every code is the same."""
    batches = _batches(4)
    ref_model, model = _model(), _model()
    ref = _build("adamw", ref_model, bits, capturable=True)
    opt = _build("adamw", model, bits, atomic=True, capturable=True)
    scaler = dml_optim.DynamicLossScaler(init_scale=2.0**8)
    for x, y in batches:
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            if o is opt:
                scaler.scale(loss).backward()
                scaler.unscale_(o)
                dml_optim.clip_grad_norm_(o, 1.0)
                scaler.step(o)
                scaler.update()
            else:
                loss.backward()
                dml_optim.clip_grad_norm_(o, 1.0)
                o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for (_, a), (_, b) in zip(_quantized(opt), _quantized(ref)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("bits", BITS)
def test_following_a_cast_and_unfreezing_carry_the_quantized_state(bits):
    model = _model()
    for p in model[4].parameters():
        p.requires_grad_(False)
    opt = _build("adamw", model, bits)
    _train(model, opt, _batches(2))
    codes = [s.codes.clone() for _, s in _quantized(opt)]
    model.to(torch.float64)  # followed: re-packed as float64, the codes carried over bit for bit
    for p in model[4].parameters():
        p.requires_grad_(True)  # unfrozen: taken in with fresh state
    x, y = _batches(1, seed=4, dtype=torch.float64)[0]
    opt.zero_grad()
    before = [s.codes.clone() for _, s in _quantized(opt)]
    assert all(torch.equal(a, b) for a, b in zip(before, codes))
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert {i.dtype for i in opt.flat_buffers()} == {torch.float64}
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in model.parameters()])).all()


def test_changing_state_bits_before_any_state_repacks_and_after_is_refused():
    model = _model()
    opt = dml_optim.AdamW(model.parameters())
    opt.param_groups[0]["state_bits"] = 8
    _train(model, opt, _batches(1))
    assert len(_quantized(opt)) == 2
    opt.param_groups[0]["state_bits"] = 4
    with pytest.raises(ValueError, match="state_bits from 8 to 4"):
        _train(model, opt, _batches(1))
    with pytest.raises(ValueError, match="state_bits must be None, 8 or 4, got 16"):
        dml_optim.AdamW(model.parameters(), state_bits=16)


@pytest.mark.parametrize("new_bits", [4, None])
def test_the_state_dict_the_refusal_asks_for_loads_into_the_new_options(new_bits):
    """The refusal above says: build a new optimizer with the new options and load this one's state dict.  That
    state dict names the bits its states are stored in (8), not the group's changed option, so it loads (it
    once said ``state_bits=4`` beside 8-bit codes and every optimizer refused it; found by a review)."""
    model = _model()
    opt = _build("adamw", model, 8)
    _train(model, opt, _batches(2))
    before = opt.state_dict()
    opt.param_groups[0]["state_bits"] = new_bits
    saved = opt.state_dict()
    assert saved["param_groups"][0]["state_bits"] == 8 == before["param_groups"][0]["state_bits"]
    target = copy.deepcopy(model)
    fresh = dml_optim.AdamW(target.parameters(), state_bits=new_bits)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["state_bits"] == new_bits
    decoded = opt.state  # (the live view decodes: the values the codes hold)
    for p, q in zip(model.parameters(), target.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            if new_bits is None:  # full precision: exactly the saved values
                assert torch.equal(fresh.state[q][name], decoded[p][name])
            else:
                assert fresh.state[q][name].shape == decoded[p][name].shape
    _train(target, fresh, _batches(1, seed=5))


def test_dml_descriptors_refuse_quantized_state():
    model = _model()
    opt = dml_optim.DmlAdam(model.parameters(), state_bits=8)
    _train(model, opt, _batches(1))
    with pytest.raises(ValueError, match="quantized"):
        opt.dml_descriptors()


# -- DirectML: the eager op chain ------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_a_low_bit_step_is_native_on_directml_without_syncs_and_independent_of_the_parameter_count(name, bits):
    counts = []
    for n in (1, 7):
        params = [torch.nn.Parameter(torch.randn(4160 + 64 * i)) for i in range(n)]  # padded blocks
        opt = registry.build(name, params, state_bits=bits, backend="eager", **HYPER[name])
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        report = audit_step(opt)
        assert report.fallback_ops == 0, report.fallbacks
        assert report.host_syncs == 0
        counts.append(report.total_ops)
    assert counts[0] == counts[1]


#: Ops per chunk of the eager low-bit step (issue 34: at most 40; observed with a padded parameter: 14 (Adagrad,
#: momentum, SGD) to 30 (AdamW 4-bit), AdamW 8-bit 28).
OPS_PER_CHUNK = 40


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_the_eager_low_bit_step_allocates_nothing_and_costs_the_same_ops_in_every_chunk(name, bits, monkeypatch):
    """A buffer of four chunks (four padded parameters of 33 blocks, the scratch bound lowered so that each
    is a chunk) dispatches four times the ops of a buffer of one; at most :data:`OPS_PER_CHUNK` each, and
    after the first step neither allocates anything (scratch kept, codes written in place)."""
    from dml_optim.backends import eager

    n = 33 * Q.BLOCK[bits] - 50

    def audited(count):
        params = [torch.nn.Parameter(torch.randn(n)) for _ in range(count)]
        opt = registry.build(name, params, state_bits=bits, backend="eager", **HYPER[name])
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        report = audit_step(opt)
        assert report.fallback_ops == 0 and report.host_syncs == 0, report.format()
        assert report.allocations == 0, report.format()
        (info,) = opt.flat_buffers()
        return report, info

    one, info = audited(1)
    assert info.scratch[0].numel() == info.numel  # (one chunk)
    monkeypatch.setattr(eager, "MIN_SCRATCH", int(1.2 * sum(t.nbytes for t in info.scratch)))
    four, info = audited(4)
    assert info.scratch[0].numel() * 4 == info.numel  # (four chunks)
    assert one.total_ops <= OPS_PER_CHUNK, one.format()
    assert four.total_ops == 4 * one.total_ops, (one.format(), four.format())


@pytest.mark.parametrize("bits", BITS)
def test_an_atomic_step_that_fails_mid_way_restores_the_quantized_state(bits):
    """``atomic=True``: the rule raises after its first call (the quantized buffer was written, the
    full-precision one not yet): parameters, codes and scales are restored bit for bit."""
    model = _model()
    opt = _build("adamw", model, bits, atomic=True)
    _train(model, opt, _batches(2))
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_snapshot(opt)
    x, y = _batches(1, seed=7)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    real = opt.owner.rule  # (the rule its backends run: the element-wise update wrapped to fail after its call)
    calls = []

    def failing(*args, **kwargs):
        real.apply(*args, **kwargs)
        calls.append(1)
        raise RuntimeError("injected failure")

    opt.owner.rule = dataclasses.replace(real, apply=failing)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            opt.step()
    finally:
        opt.owner.rule = real
    assert calls == [1]
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p.detach(), q)
    for a, b in zip(_state_snapshot(opt), state):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_train_reaches_full_precision_accuracy_and_the_readme_says_so():
    """Item 3 of the issue: ``dml-optim train --optimizer adamw --state-bits 8`` within 1.0 point of the
    FP32 run's held-out accuracy, ``--state-bits 4`` within 2.0 (1,000 steps, as the README quotes)."""
    from pathlib import Path

    from dml_optim.job.train import TrainConfig, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the command's default (--threads 1): the quoted numbers are its
    try:
        acc = {bits: train(TrainConfig(optimizer="adamw", state_bits=bits), audit=False).test_accuracy
               for bits in (None, 8, 4)}
    finally:
        torch.set_num_threads(threads)
    assert 100 * (acc[None] - acc[8]) <= 1.0 and 100 * (acc[None] - acc[4]) <= 2.0, acc
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    found = re.search(r"reaches ([\d.]+)% held-out accuracy in FP32, ([\d.]+)% with `--state-bits 8` and "
                      r"([\d.]+)% with `--state-bits 4`", readme)
    assert found, "the README no longer quotes the low-bit accuracies"
    fp32, bits8, bits4 = (float(v) for v in found.groups())
    # The README's figures are one machine's run, and they must make the claim themselves.
    assert fp32 - bits8 <= 1.0 and fp32 - bits4 <= 2.0, (fp32, bits8, bits4)
    # This machine's run is another rounding of the same training: torch's fused FP32 kernel and the compiled
    # low-bit kernel round by the vector width they run with, and 1,000 steps carry one rounding difference into
    # another trajectory.  Measured with the same code (seed 0, one thread): AMD EPYC Zen 4, AVX-512: 90.0 / 89.6 /
    # 89.6; Intel Xeon, AVX-512: 90.0 / 89.7 / 90.3; the same Intel at AVX2 width (ATEN_CPU_CAPABILITY=avx2,
    # inductor's cpp.simdlen=256): 89.9 / 89.6 / 90.3; an AVX2 VM's FP32: 90.2.  The widest spread is 0.7 points,
    # so a figure more than 1.5 points from this machine's is a change of the job, not of the machine.
    assert abs(fp32 - 100 * acc[None]) <= 1.5, (fp32, acc)
    assert abs(bits8 - 100 * acc[8]) <= 1.5 and abs(bits4 - 100 * acc[4]) <= 1.5, (bits8, bits4, acc)
