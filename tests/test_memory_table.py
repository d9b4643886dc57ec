"""The memory table (bytes per parameter of each precision configuration, on the site's precision page) and
the README's training-bytes table are the measured ones, and what they and the text around them say follows
from the dtypes.

The table is rebuilt here by :func:`dml_optim.precision.memory.memory_table`
(from the optimizer's own tensors) and compared with the page's block, so
it cannot go stale; the by-hand expectations below check the measurement
itself: parameters and gradients take the parameters' dtype, Adam's two
states the state dtype, a master copy 4 bytes, a compensation buffer the
parameters' dtype.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dml_optim.job import toy
from dml_optim.core.options import CHUNK_ELEMENTS
from dml_optim.precision import CONFIGS, make_optimizer
from dml_optim.precision.memory import HIDDEN, OPTIMIZERS, measure, memory_table

README = Path(__file__).resolve().parent.parent / "README.md"
#: The site's page that holds the whole memory table (the README holds the training-bytes one).
PRECISION_PAGE = README.parent / "docs" / "guide" / "precision.md"

#: (parameters, gradients, states, master copy, compensation) in bytes per parameter, by hand from the dtypes:
#: FP32 4 bytes, FP16/BF16 2; Adam and AdamW keep two states (exp_avg, exp_avg_sq), in FP32 with master
#: weights, Kahan or stochastic rounding and in the parameters' dtype otherwise (fp16-fp32compute: FP16 states, FP32 arithmetic).
EXPECTED = {
    "fp32": (4, 4, 8, 0, 0),
    "fp16": (2, 2, 4, 0, 0),
    "fp16-fp32compute": (2, 2, 4, 0, 0),
    "fp16-master": (2, 2, 8, 4, 0),
    "fp16-kahan": (2, 2, 8, 0, 2),
    "bf16": (2, 2, 4, 0, 0),
    "bf16-kahan": (2, 2, 8, 0, 2),
    # block-quantized states: their own arithmetic, below; parameters, gradients and compensation as without,
    # times the padding that starts every quantized tensor at a block boundary
    "fp32-8bit": (4, 4, None, 0, 0),
    "fp32-4bit": (4, 4, None, 0, 0),
    "fp16-kahan-8bit": (2, 2, None, 0, 2),
    "fp16-kahan-4bit": (2, 2, None, 0, 2),
    # stochastic rounding: FP32 states as with Kahan, no compensation buffer
    "fp16-sr": (2, 2, 8, 0, 0),
    "bf16-sr": (2, 2, 8, 0, 0),
    "fp16-sr-8bit": (2, 2, None, 0, 0),  # DirectML's lean configuration
    "fp16-sr-4bit": (2, 2, None, 0, 0),
    "bf16-sr-8bit": (2, 2, None, 0, 0),
    "bf16-sr-4bit": (2, 2, None, 0, 0),
}


def _quantized(bits: int, states: int = 2) -> tuple[float, float]:
    """Per parameter of the MLP: (state bytes, padded elements per element).  Tensors of 4096 elements or
    more store whole blocks of ``bits``-bit codes (256 per block at 8 bits, 128 at 4) and a float32 scale per
    block, and are padded to whole blocks in every flat buffer; smaller ones keep float32 values."""
    block = {8: 256, 4: 128}[bits]
    total = n = padded = 0
    for p in toy.make_model(0, HIDDEN).parameters():
        n += p.numel()
        blocks = -(-p.numel() // block)
        quantized = p.numel() >= 4096
        total += (blocks * block * bits / 8 + 4 * blocks) if quantized else 4 * p.numel()
        padded += blocks * block if quantized else p.numel()
    return states * total / n, padded / n


@pytest.fixture(scope="module")
def footprints():
    return {(f.optimizer, f.config): f for f in (measure(name, config) for name in OPTIMIZERS for config in CONFIGS.values())}


def _readme_block() -> str:
    match = re.search(r"<!-- MEMORY-TABLE -->\n(.*?)\n<!-- /MEMORY-TABLE -->", PRECISION_PAGE.read_text(), flags=re.S)
    assert match, "docs/guide/precision.md has no <!-- MEMORY-TABLE --> block"
    return match.group(1)


def test_every_configuration_is_expected():
    assert set(EXPECTED) == set(CONFIGS)


def test_readme_training_bytes_table_is_the_measured_one(footprints):
    # regenerate with: python -m dml_optim.precision.memory training
    from dml_optim.precision.memory import TRAINING_CONFIGS, training_bytes_table

    match = re.search(r"<!-- TRAINING-BYTES -->\n(.*?)\n<!-- /TRAINING-BYTES -->", README.read_text(), flags=re.S)
    assert match, "README.md has no <!-- TRAINING-BYTES --> block"
    assert match.group(1) == training_bytes_table([measure("adamw", CONFIGS[c]) for c in TRAINING_CONFIGS])


def test_readme_table_is_the_measured_one(footprints):
    # regenerate with: python -m dml_optim.precision.memory
    assert _readme_block() == memory_table(list(footprints.values()))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bytes_per_parameter_follow_from_the_dtypes(footprints, optimizer):
    for config, (params, grads, states, master, kahan) in EXPECTED.items():
        f = footprints[(optimizer, config)]
        if states is None:
            n_states = {"adagrad": 1, "momentum": 1, "sgd": 1}.get(optimizer, 2)
            states, pad = _quantized(CONFIGS[config].state_bits, n_states)
            params, grads, kahan = params * pad, grads * pad, kahan * pad
        assert (f.params, f.grads, f.states, f.master, f.kahan) == (params, grads, states, master, kahan), config
        assert f.parameters == sum(p.numel() for p in toy.make_model(0, HIDDEN).parameters())


def test_the_readme_text_quotes_the_table(footprints):
    text = " ".join(README.read_text().split())
    match = re.search(r"with Adam, Kahan (\d+) bytes per parameter, master weights (\d+), FP32 (\d+) plus a full-size "
                      r"scratch, plain FP16 (\d+) plus its scratch", text)
    assert match, "the README's sentence on large-model memory is missing"
    held = [footprints[("adam", c)].held for c in ("fp16-kahan", "fp16-master", "fp32", "fp16")]
    assert [int(v) for v in match.groups()] == held
    assert "That is 2 bytes per parameter where master weights take 4" in text


def test_scratch_is_bounded_when_the_update_converts():
    # the README: full size in the storage dtype when the update does not convert; FP32 chunks of at most
    # 2**20 elements per slot when it does, so under 0.3 bytes per parameter at 100M parameters; low-bit
    # states in chunks within 32 MiB or 0.5 bytes per parameter (issue 34)
    model = toy.make_model(0, 1100)  # 1,258,410 parameters: more than one chunk
    numel = sum(p.numel() for p in model.parameters())
    assert numel > CHUNK_ELEMENTS
    for name, config in CONFIGS.items():
        params = [torch.nn.Parameter(p.detach().to(config.param_dtype)) for p in model.parameters()]
        opt = make_optimizer("adam", params, config)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        scratch = opt.flat_buffers()[0].scratch
        if (config.param_dtype == config.arithmetic_dtype == config.stored_state_dtype and not config.kahan
                and not config.state_bits):
            assert all(t.numel() == numel and t.dtype == config.param_dtype for t in scratch), name
        elif config.state_bits:  # equal chunks of whole blocks within 32 MiB (or 0.5 bytes per parameter)
            info = opt.flat_buffers()[0]
            chunk = scratch[0].numel()
            assert sum(t.nbytes for t in scratch) <= 32 << 20 and chunk % 128 == 0, name
            assert -(-info.numel // chunk) == (2 if config.kahan else 1), name  # (Kahan: 28 bytes per element)
        else:
            assert all(t.numel() == CHUNK_ELEMENTS and t.dtype == torch.float32 for t in scratch), name
            assert len(scratch) * CHUNK_ELEMENTS * 4 / 1e8 < 0.3, name
