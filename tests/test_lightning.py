"""Lightning's Trainer with our optimizers, against torch.optim under the same Trainer.

``configure_optimizers`` returns one of ours (or its torch.optim twin, tests/_frameworks.py:
Momentum's is compared bit for bit, and it is torch's fused SGD where Lightning builds it on CPU
float32 parameters, as our default backend runs torch's fused kernel there; torch's default SGD
for ``16-true``/``bf16-true`` and on a GPU) with ``OneCycleLR`` at its defaults
(``cycle_momentum=True``: it cycles ``betas[0]`` or ``momentum`` every step), or with
``ReduceLROnPlateau`` on the logged loss.  Every fit clips
(``gradient_clip_val``; the gradient norm before clipping is recorded and exceeds the limit).
Precisions: ``32-true``, ``bf16-mixed`` (autocast to bfloat16), ``16-mixed`` (autocast to float16
and a GradScaler), and ``16-true``/``bf16-true`` (the module cast before ``configure_optimizers``).
Given ``precision="16-mixed"`` on the CPU, Lightning switches to ``bf16-mixed`` ("AMP with fp16
is not supported on CPU"), so on the CPU the tests hand it the same plugin it builds on a GPU,
``MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))``; ``16-mixed-cuda`` is the plain
flag on a GPU (skipped without one).  Lightning refuses gradient clipping with an optimizer that
unscales inside its own step (``_step_supports_amp_scaling``); ours leaves that to GradScaler
for float32 gradients, so clipping works, and GradScaler's step must not warn.

Checkpoints: ``trainer.save_checkpoint`` then ``fit(ckpt_path=...)`` in a new Trainer.  At an
epoch boundary that equals an uninterrupted fit.  Mid-epoch, Lightning does not resume the
plain DataLoader where it stopped, so the resumed fit is compared with torch.optim resumed the
same way (like with like), and the difference from the uninterrupted fit is shown to be real.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _frameworks import BY_ID, PAIR_IDS, PAIRS, amp_future_warnings, moved, need, params_of
from tolerances import TORCH_ADAM_FLOAT32

need("lightning")
import lightning as L  # noqa: E402

pytestmark = [
    # Lightning's own advice for a toy setup (workers, logging interval, ...): not ours to fix
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # Lightning's use of torch's pytree
]

BATCHES_PER_EPOCH = 4
EPOCHS = 2
TOTAL_STEPS = BATCHES_PER_EPOCH * EPOCHS
CLIP = 0.5


class Lit(L.LightningModule):
    """A tiny classifier; ``scheduler``: "onecycle" (OneCycleLR at its defaults), "plateau"
    (ReduceLROnPlateau on the logged training loss) or None.  Records per step the unclipped
    gradient norm Lightning sees before clipping, and (lr, betas/momentum) after the step."""

    def __init__(self, make, lr=0.05, onecycle=True, scheduler="onecycle"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        self.make, self.lr, self.trace, self.norms = make, lr, [], []
        self.scheduler = scheduler if onecycle else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):  # after GradScaler's unscale_, before clipping
        grads = [p.grad.float() for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        group = self.trainer.optimizers[0].param_groups[0]
        self.trace.append((group["lr"],) + tuple(group[k] for k in ("betas", "momentum") if k in group))

    def configure_optimizers(self):
        opt = self.make(self.parameters(), self.lr)
        if self.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=TOTAL_STEPS)  # defaults otherwise
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "plateau":  # mode="max" on a loss: it halves the lr whenever the loss does not rise
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "train_loss"}}
        return opt


def _loader():
    g = torch.Generator().manual_seed(1)
    n = 16 * BATCHES_PER_EPOCH
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16)


CUDA = torch.cuda.is_available()
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "16-mixed-cuda"]


def _precision(precision: str) -> dict:
    """Trainer keywords for one of ``PRECISIONS``."""
    if precision == "16-mixed":  # what Lightning builds for 16-mixed on a GPU, on the CPU
        from lightning.pytorch.plugins import MixedPrecision

        return dict(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    if precision == "16-mixed-cuda":
        if not CUDA:
            pytest.skip("needs CUDA: Lightning runs precision='16-mixed' on the CPU as bf16-mixed "
                        "(the CPU case passes Lightning's MixedPrecision plugin with a CPU GradScaler instead)")
        return dict(accelerator="gpu", precision="16-mixed")
    return dict(accelerator="cpu", precision=precision)


def _fit(make, precision="32-true", *, ckpt_path=None, save=None, onecycle=True, scheduler="onecycle", module=None,
         **limits):
    module = module or Lit(make, onecycle=onecycle, scheduler=scheduler)
    trainer = L.Trainer(devices=1, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **_precision(precision), **limits)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    trainer.norms = module.norms
    return params_of(module), module.trace, trainer


def _same_norms(pair, norms, torch_norms):
    """Gradient norms before clipping: equal for an exact pair, else to float32 Adam's tolerance;
    clipping engaged (a norm above ``CLIP``) in both runs."""
    assert max(norms) > CLIP and max(torch_norms) > CLIP, f"clipping never engaged: {norms}"
    tol = dict(rtol=0, atol=0) if pair.exact else TORCH_ADAM_FLOAT32
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(torch_norms), **tol, equal_nan=True)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_fit_with_clipping_and_onecycle_equals_torch(pair, precision):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, trace, trainer = _fit(pair.ours, precision, max_epochs=EPOCHS)
    theirs, torch_trace, torch_trainer = _fit(pair.theirs, precision, max_epochs=EPOCHS)
    assert trainer.global_step == TOTAL_STEPS
    assert moved(params_of(Lit(pair.ours)), ours)
    pair.assert_same(ours, theirs)
    _same_norms(pair, trainer.norms, torch_trainer.norms)
    assert trace == torch_trace and len({t[1] for t in trace}) > 2  # lr and momentum cycled alike
    opt = trainer.optimizers[0]
    assert type(opt).__module__.startswith("dml_optim")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert trainer.precision_plugin.precision == precision.removesuffix("-cuda")
    assert (scaler is not None) == precision.startswith("16-mixed")
    assert opt._step_supports_amp_scaling is False  # float32 gradients: GradScaler unscales, then clipping
    assert not amp_future_warnings(caught)


@pytest.mark.parametrize("precision", ["16-mixed", "16-mixed-cuda"])
def test_16_mixed_with_gradient_clipping_without_a_scheduler(precision):
    """The clipping row alone: Lightning's MixedPrecision.clip_gradients refuses an optimizer whose
    ``_step_supports_amp_scaling`` is True ("does not allow for gradient clipping"); ours, with
    float32 gradients, is clipped after GradScaler's own unscale, like torch.optim.  Its twin, torch's
    fused SGD, would be refused as well (a fused torch optimizer unscales inside its kernel):
    ``torch_twin`` puts it on GradScaler's own path, the one ours takes."""
    pair = BY_ID["momentum"]
    ours, _, trainer = _fit(pair.ours, precision, onecycle=False, max_epochs=EPOCHS)
    theirs, _, torch_trainer = _fit(pair.theirs, precision, onecycle=False, max_epochs=EPOCHS)
    assert trainer.precision_plugin.scaler is not None and trainer.global_step == TOTAL_STEPS
    pair.assert_same(ours, theirs)
    _same_norms(pair, trainer.norms, torch_trainer.norms)


def test_gradscaler_skips_an_overflowing_step_under_16_mixed():
    """An inf gradient under 16-mixed: GradScaler's native check finds it, our step is not called,
    the scale halves; torch.optim under the same Trainer does the same."""

    class Overflow(Lit):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.global_step == 2 and batch_idx == 2 else loss

    def fit(make):
        module = Overflow(make)
        trainer = L.Trainer(devices=1, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                            **_precision("16-mixed"))
        trainer.fit(module, _loader())
        return params_of(module), trainer.precision_plugin.scaler.get_scale(), trainer.optimizers[0]

    pair = BY_ID["adamw"]
    ours, scale, opt = fit(pair.ours)
    theirs, torch_scale, _ = fit(pair.theirs)
    assert scale == torch_scale == 2.0 ** 15  # the default 2**16, halved once
    assert opt.state_dict()["state"][0]["step"].item() == BATCHES_PER_EPOCH - 1
    pair.assert_same(ours, theirs)


@pytest.mark.parametrize("pair", [BY_ID["momentum"], BY_ID["adam"]], ids=["momentum", "adam"])
def test_resume_at_an_epoch_boundary_equals_an_uninterrupted_fit(pair, tmp_path):
    """``save_checkpoint`` after epoch 1, ``fit(ckpt_path=...)`` in a new Trainer with a new module and
    optimizer: bit-identical to the fit without the break (OneCycleLR's position included), and
    equal to torch.optim resumed the same way."""
    full, _, _ = _fit(pair.ours, max_epochs=EPOCHS)
    resumed = {}
    for side in ("ours", "theirs"):
        path = tmp_path / f"{side}-epoch1.ckpt"
        _fit(getattr(pair, side), max_epochs=1, save=path)
        resumed[side], _, trainer = _fit(getattr(pair, side), max_epochs=EPOCHS, ckpt_path=path)
        assert trainer.global_step == TOTAL_STEPS
    saved = torch.load(tmp_path / "ours-epoch1.ckpt", weights_only=False)
    assert "dml_optim" in saved["optimizer_states"][0]  # our state dict went through Lightning's checkpoint
    for a, b in zip(resumed["ours"], full, strict=True):
        assert torch.equal(a, b)
    pair.assert_same(resumed["ours"], resumed["theirs"])


@pytest.mark.parametrize("pair", [BY_ID["momentum"], BY_ID["adamw"]], ids=["momentum", "adamw"])
def test_reduce_lr_on_plateau_equals_torch(pair):
    """Lightning steps ReduceLROnPlateau on the monitored, logged loss; it writes ``group["lr"]``
    of ours as of torch's, and the lr it wrote is the one the next step uses."""
    ours, trace, trainer = _fit(pair.ours, scheduler="plateau", max_epochs=EPOCHS)
    theirs, torch_trace, _ = _fit(pair.theirs, scheduler="plateau", max_epochs=EPOCHS)
    assert trainer.global_step == TOTAL_STEPS
    assert trace == torch_trace and len({t[0] for t in trace}) > 2, trace  # the lr was cut more than once
    pair.assert_same(ours, theirs)


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_true_half_precision_with_clipping_equals_torch(precision):
    """``precision="16-true"``/``"bf16-true"``: Lightning casts the module before
    ``configure_optimizers``, so ours packs float16/bfloat16 parameters; no GradScaler; gradients
    clipped in that dtype.  Momentum's ungated float16/bfloat16 step is SGD's, bit for bit."""
    pair = BY_ID["momentum"]
    dtype = torch.float16 if precision == "16-true" else torch.bfloat16
    ours, trace, trainer = _fit(pair.ours, precision, max_epochs=EPOCHS)
    theirs, torch_trace, torch_trainer = _fit(pair.theirs, precision, max_epochs=EPOCHS)
    assert [p.dtype for p in ours] == [dtype] * len(ours)
    assert moved(params_of(Lit(pair.ours).to(dtype)), ours)
    pair.assert_same(ours, theirs, dtype)
    _same_norms(pair, trainer.norms, torch_trainer.norms)
    assert trace == torch_trace


@pytest.mark.parametrize("pair,precision", [(BY_ID["momentum"], "32-true"), (BY_ID["adamw"], "16-mixed")],
                         ids=["momentum-32-true", "adamw-16-mixed"])
def test_resume_mid_epoch_equals_torch_resumed_the_same_way(pair, precision, tmp_path):
    mid = BATCHES_PER_EPOCH // 2 + 1
    results, steps = {}, {}
    for side in ("ours", "theirs"):
        make = getattr(pair, side)
        path = tmp_path / f"{side}.ckpt"
        _fit(make, precision, max_steps=mid, save=path)
        results[side], _, trainer = _fit(make, precision, max_epochs=EPOCHS, ckpt_path=path)
        steps[side] = trainer.global_step
    assert steps["ours"] == steps["theirs"]
    pair.assert_same(results["ours"], results["theirs"])
    full, _, _ = _fit(pair.ours, precision, max_epochs=EPOCHS)
    # like with like: Lightning's mid-epoch resume is not the uninterrupted run, for torch.optim as for us
    assert moved(full, results["ours"])
