"""Transformers' ``Trainer`` with our optimizers, against torch.optim in the same Trainer.

A tiny BERT classifier built from a config (nothing downloaded; no tokenizer: the dataset is
token ids).  The Trainer clips (``max_grad_norm=1.0``, its default, through accelerate) and,
given no scheduler, builds its linear decay over our optimizer; ``OneCycleLR`` at its defaults
cycles ``betas``/``momentum``.  Two ways in:

* ``Trainer(optimizers=(opt, scheduler))``: the optimizer is built on the model's parameters
  before the Trainer exists (and, on a GPU, before the Trainer moves the model);
* ``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))``: the Trainer builds it, with its two param
  groups (``weight_decay`` from ``TrainingArguments`` for weights, 0 for biases and LayerNorm),
  i.e. torch's names in the group dicts.

The torch.optim twins are tests/_frameworks.py's: Momentum's is compared bit for bit, with torch's
fused SGD on the CPU (our default backend runs torch's fused kernel there); the Adam family to its
tolerance.

Checkpoints: the Trainer saves ``optimizer.pt`` (our ``state_dict``) every ``save_steps``;
``train(resume_from_checkpoint=...)`` in a new Trainer, with a new model and optimizer, must end
where the uninterrupted run ended, bit for bit.  ``fp16=True`` is CUDA-only: on the CPU the
Trainer's accelerate ignores it (no autocast, no GradScaler; tests/test_accelerate.py runs that
flow on the CPU).

Each run takes about a second (2-core CPU), so runs are cached per module: the uninterrupted
runs the equality tests make are the ones the resume tests compare with.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from _frameworks import BY_ID, Pair, moved, need, params_of, reset_accelerate, torch_twin
from _frameworks import fresh_accelerate  # noqa: F401 - the fixture, used through pytestmark

import dml_optim

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model comes from a config
transformers = need("transformers")
need("accelerate")
if not transformers.utils.is_torch_available():  # transformers 5 disables its torch support below torch 2.6
    pytest.skip(f"transformers {transformers.__version__} does not support torch {torch.__version__} "
                "(it disables its PyTorch support); transformers 4.x runs these tests there", allow_module_level=True)
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_accelerate")]  # slow: about 1 s per Trainer run on 2 cores

STEPS = 6
SAVE_AT = 3
LR = 1e-2
CUDA = torch.cuda.is_available()




def _model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config)


def _dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (32, 8), generator=g)
    labels = torch.randint(0, 2, (32,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]


#: Adam-family runs leave out the parameters whose gradients are rounding noise (below).
NOISE_FROZEN = ("adam", "adamw")


def _freeze_for_eps_zero(model):
    """Adam's update divides the first moment by the root of the second: for a parameter whose gradient is
    rounding noise, the update is noise divided by its own size, so the last-place differences between two
    correct implementations (different summation orders, fused multiply-adds) become differences of order
    lr instead of a few units in the last place of the update, and no tolerance from the arithmetic holds
    (AdamW on torch 2.14.1: 2.2e-6 on such an element).  Two such groups here: embedding rows no batch has
    used yet (zero gradients: 0/0 with epsilon 0, NaN in torch's Adam as well) and the attention's key bias,
    whose gradient is zero in exact arithmetic (softmax ignores a shift shared by all keys) and rounding
    noise in float32.  Those stay frozen in the Adam-family runs; every other element's update is well
    conditioned, and the runs agree to ``TORCH_ADAM_FLOAT32`` (a few float32 roundings per step)."""
    for name, p in model.named_parameters():
        if "embeddings" in name or "key.bias" in name:
            p.requires_grad_(False)


def _onecycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)  # cycle_momentum=True


SCHEDULERS = {None: None, "onecycle": _onecycle}


def _train(make, out, *, scheduler=None, resume=None, bf16=False, fp16=False, freeze=False, factory=None,
           weight_decay=0.0):
    """One Trainer run; ``make(params, lr)`` builds the optimizer passed in ``optimizers=``, or
    ``factory`` is ``optimizer_cls_and_kwargs``.  Returns (final parameters, trainer)."""
    reset_accelerate()
    model = _model()
    if freeze:
        _freeze_for_eps_zero(model)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=LR,
                             save_strategy="steps", save_steps=SAVE_AT, logging_strategy="no", report_to=[],
                             use_cpu=not fp16, seed=0, disable_tqdm=True, bf16=bf16, fp16=fp16,
                             weight_decay=weight_decay)
    if factory is not None:
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(), optimizer_cls_and_kwargs=factory)
    else:
        opt = make(model.parameters(), LR)  # before the Trainer (and, with fp16, before it moves the model)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(),
                          optimizers=(opt, SCHEDULERS[scheduler](opt) if scheduler else None))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    assert trainer.state.global_step == STEPS
    return params_of(model), trainer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``get(side, name, scheduler, bf16)``: the uninterrupted run, cached; returns (parameters,
    its output folder with ``checkpoint-SAVE_AT``)."""
    cache = {}

    def get(side, name, scheduler=None, bf16=False, fp16=False):
        key = (side, name, scheduler, bf16, fp16)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{side}-{name}")
            params, _ = _train(getattr(BY_ID[name], side), out, scheduler=scheduler, bf16=bf16, fp16=fp16,
                               freeze=name in NOISE_FROZEN)
            cache[key] = params, out
        return cache[key]

    return get


CASES = [("momentum", None, False), ("adamw", None, False), ("adam", "onecycle", False),
         ("momentum", "onecycle", False), ("adamw", None, True)]


@pytest.mark.parametrize("name,scheduler,bf16", CASES,
                         ids=["momentum", "adamw", "adam-onecycle", "momentum-onecycle", "adamw-bf16"])
def test_trainer_with_our_optimizer_equals_torch(name, scheduler, bf16, uninterrupted):
    """``Trainer(optimizers=(ours, scheduler or None))``: clipping, the Trainer's linear schedule
    or OneCycleLR, bf16 autocast on the CPU; equal to torch.optim in the same Trainer."""
    pair = BY_ID[name]
    ours, _ = uninterrupted("ours", name, scheduler, bf16)
    theirs, _ = uninterrupted("theirs", name, scheduler, bf16)
    assert moved(params_of(_model()), ours)
    pair.assert_same(ours, theirs)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: on the CPU the Trainer's accelerate runs fp16=True without autocast "
                                     "or GradScaler (tests/test_accelerate.py runs that flow on the CPU)")
@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_trainer_fp16_on_cuda_equals_torch(name, tmp_path):
    """``fp16=True``: the Trainer moves the model (and our optimizer follows it) to the GPU and steps
    through a GradScaler."""
    pair = BY_ID[name]
    ours, trainer = _train(pair.ours, tmp_path / "ours", fp16=True)
    theirs, _ = _train(pair.theirs, tmp_path / "torch", fp16=True)
    assert trainer.accelerator.scaler is not None
    assert all(p.device.type == "cuda" for p in ours)
    # Both optimizers are built on the CPU parameters: Momentum's twin is torch's fused SGD there (what
    # our CPU backend runs), and after the move it runs torch's fused CUDA kernel while ours runs its
    # CUDA step (eager or compiled): the same update, rounded differently, so the pair's tolerance.
    replace(pair, exact=False).assert_same(ours, theirs)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6),
                    reason="transformers >= 4.50 refuses torch.load below torch 2.6 (CVE-2025-32434): "
                           "resume_from_checkpoint cannot load optimizer.pt there, for torch.optim as for us")
@pytest.mark.parametrize("name,scheduler", [("momentum", None), ("adamw", None), ("adam", "onecycle")],
                         ids=["momentum", "adamw", "adam-onecycle"])
def test_resume_from_checkpoint_equals_an_uninterrupted_run(name, scheduler, uninterrupted, tmp_path):
    """``resume_from_checkpoint=checkpoint-3`` in a new Trainer with a new model and a new optimizer:
    the Trainer loads our ``optimizer.pt`` (and the scheduler's) and ends bit for bit where the
    uninterrupted run ended (which equals torch.optim's, above)."""
    pair = BY_ID[name]
    full, out = uninterrupted("ours", name, scheduler)
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert "dml_optim" in saved and saved["state"] and all(s["step"].item() == SAVE_AT for s in saved["state"].values())
    resumed, _ = _train(pair.ours, tmp_path / "resumed", scheduler=scheduler, resume=checkpoint, freeze=name in NOISE_FROZEN)
    for a, b in zip(resumed, full, strict=True):
        assert torch.equal(a, b)


FACTORIES = [
    # torch's keyword names for ours (momentum=, as for SGD); weight_decay reaches each group as a torch name
    Pair("momentum", lambda: (dml_optim.Momentum, {"lr": LR, "momentum": 0.9}),
         lambda: (torch_twin(torch.optim.SGD), {"lr": LR, "momentum": 0.9}), exact=True),
    Pair("adamw", lambda: (dml_optim.AdamW, {"lr": LR, "betas": (0.8, 0.99)}),
         lambda: (torch.optim.AdamW, {"lr": LR, "betas": (0.8, 0.99)})),
]


@pytest.mark.parametrize("pair", FACTORIES, ids=[p.id for p in FACTORIES])
def test_optimizer_cls_and_kwargs_equals_torch(pair, tmp_path):
    """``Trainer(optimizer_cls_and_kwargs=(dml_optim.X, kwargs))``: the Trainer builds ours over its
    two param groups (``weight_decay`` 0.1 for weights, 0 for biases and LayerNorm): equal to
    torch.optim built the same way."""
    freeze = pair.id in NOISE_FROZEN
    ours, trainer = _train(None, tmp_path / "ours", factory=pair.ours(), weight_decay=0.1, freeze=freeze)
    theirs, _ = _train(None, tmp_path / "torch", factory=pair.theirs(), weight_decay=0.1, freeze=freeze)
    opt = trainer.optimizer.optimizer  # inside the Trainer's accelerate wrapper
    assert type(opt).__module__.startswith("dml_optim")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert moved(params_of(_model()), ours)
    pair.assert_same(ours, theirs)
