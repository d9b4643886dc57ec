"""Whole-training memory: the measured peak of real training steps, per optimizer configuration.

What a user can fit is decided by the peak of a whole training step, not by
the optimizer's state alone.  For each configuration (:data:`CONFIGS`) and each
``zero_grad`` style (``set_to_none=True``: accelerate's ``optimizer.zero_grad``,
transformers' Trainer's ``model.zero_grad()``; ``set_to_none=False``), a fresh
subprocess runs real steps of a model (:data:`MODELS`; the default, ``mlp``:
12 x ``Linear(2048, 2048)``, 50.4M parameters, batch 8): forward, backward,
``torch.nn.utils.clip_grad_norm_(params, 1.0)`` (torch's own clipping on every
row, the same call everywhere: what a drop-in replacement meets), ``step``,
``zero_grad``.

**The counter** (CPU, Linux): the child runs with ``MALLOC_MMAP_THRESHOLD_=65536``
so that glibc returns every freed block of 64 KiB or more to the OS at once
(the resident set is then what is live, not what the allocator kept); it reads
``VmRSS`` before the model exists (after the imports and a warm-up of the same
configuration on a tiny model, so that lazily loaded code and kernels are not
counted), runs ``warmup`` steps (default 2; the default backend is stepped
until it has settled), resets the peak by writing ``5`` to
``/proc/self/clear_refs``, runs ``steps`` more (default 2) and reads
``VmHWM``.  ``peak_bytes`` = ``VmHWM`` - that baseline: everything the
training held at its worst moment (parameters, gradients, optimizer state,
scratch, temporaries of the step, activations, clipping's norms).  The peak
above the resident size right after the imports (before the warm-up: the
method of issue 32's first table, which includes the libraries' own pages) is
recorded beside it, as ``peak_bytes_with_libraries``.  On CUDA the counter is
``torch.cuda.max_memory_allocated`` (reset at the same point) minus the bytes
allocated before the model existed (code path present; measured only where a
GPU is).

**Arithmetic** (``arithmetic``: parameters + gradients + optimizer state, the
optimizer's own tensors walked, quantized codes and scales included) is
printed beside the measurement, never instead of it.

Configurations that need a package that is not installed (bitsandbytes,
torchao) are rows with status ``"not installed"``; options that do not exist
yet (``rounding="stochastic"``, the step inside backward, loss scaling inside
backward) are probed by trying them on a one-element parameter and reported
``"not available yet"`` with the error, until they exist.

**What runs on DirectML** (:attr:`Config.directml`, in every row as ``directml``): DirectML has no
bfloat16 (torch-directml ends the process on a bfloat16 tensor, microsoft/DirectML#688), so the
bfloat16 rows are measured here for comparison only, ``"not on DirectML (no bfloat16)"``.  DirectML's lean
configuration is float16 parameters, ``rounding="stochastic"``, ``state_bits=8`` (or 4), the eager
backend and the step inside backward with a :class:`dml_optim.DynamicLossScaler` (float16 gradients
underflow without loss scaling): ``ours-fp16-sr-8bit-eager-backward`` and ``-4bit-``, whose loop is
``scaler.scale(loss).backward(); scaler.update(); zero_grad`` (phase ``"scaler"``).

The JSON document (:func:`measure`, written to
``bench/results/memory-<UTC date>.json`` by ``python -m
dml_optim.benchmark.wholemem``): ``schema`` (``"dml-optim-wholemem-1"``),
``created``, ``machine``, ``versions``, ``method``, ``model`` and ``rows``, one per
(configuration, ``zero_grad`` style); see :func:`row_fields` for a row's fields.
A bench run registers it as the row set ``wholemem`` through :func:`bench_tasks`.

Long by design: the configurations, the models, the child that measures and the parent that starts it are
one module, because the child is ``python -m`` of this very module and must run exactly the code the
parent describes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["add_ratios", "training_loop", "SCHEMA", "Config", "CONFIGS", "LEAN_FP16", "MODELS", "ModelSpec", "MMAP_THRESHOLD", "NOT_ON_DIRECTML",
           "RECOMMENDED", "availability", "measure", "measure_one", "run_child", "row_fields", "format_table",
           "default_output_path", "bench_tasks", "main"]

SCHEMA = "dml-optim-wholemem-1"
#: ``MALLOC_MMAP_THRESHOLD_`` of the child: blocks of this many bytes or more are mmap'ed and returned on free.
MMAP_THRESHOLD = 65536
_RESULT_PREFIX = "WHOLEMEM-RESULT "
_CLIP = "torch.nn.utils.clip_grad_norm_(params, 1.0)"


# -- models -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model to train: ``kind`` ``"mlp"`` (``depth`` x ``Linear(width, width)``, ReLU between, a batch of
    ``batch`` random rows, MSE to a random target) or ``"gpt"`` (a pre-norm GPT: ``depth`` blocks of width
    ``width``, ``heads`` heads, a tied embedding of ``vocab`` tokens, ``batch`` sequences of ``seq``
    tokens)."""

    name: str
    kind: str
    width: int
    depth: int
    batch: int
    vocab: int = 0
    heads: int = 0
    seq: int = 0

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"{self.depth} x Linear({self.width}, {self.width}), ReLU between, batch {self.batch}"
        return (f"GPT: {self.depth} pre-norm blocks of width {self.width}, {self.heads} heads, tied embedding of "
                f"{self.vocab} tokens, batch {self.batch} x {self.seq} tokens")


MODELS = {
    "mlp": ModelSpec("mlp", "mlp", 2048, 12, 8),
    "gpt": ModelSpec("gpt", "gpt", 640, 10, 2, vocab=8192, heads=10, seq=128),
    # small ones: the quick bench and the tests
    "mlp-small": ModelSpec("mlp-small", "mlp", 512, 4, 8),
    "gpt-small": ModelSpec("gpt-small", "gpt", 128, 2, 2, vocab=512, heads=4, seq=32),
    # the warm-up before the baseline (quantized states need tensors of >= 4096 elements)
    "tiny": ModelSpec("tiny", "mlp", 128, 2, 4),
}


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class _GPT(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed = torch.nn.Embedding(spec.vocab, spec.width)
        self.pos = torch.nn.Parameter(torch.randn(spec.seq, spec.width) * 0.02)
        self.blocks = torch.nn.ModuleList(_Block(spec.width, spec.heads) for _ in range(spec.depth))
        self.ln = torch.nn.LayerNorm(spec.width)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.t()


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``(model, loss_fn)``: ``loss_fn()`` runs the forward pass on a fixed batch and returns the loss."""
    torch.manual_seed(seed)
    if spec.kind == "mlp":
        layers: list[torch.nn.Module] = []
        for i in range(spec.depth):
            layers += [torch.nn.Linear(spec.width, spec.width)] + ([torch.nn.ReLU()] if i < spec.depth - 1 else [])
        model = torch.nn.Sequential(*layers).to(device=device, dtype=dtype)
        x = torch.randn(spec.batch, spec.width, device=device, dtype=dtype)
        y = torch.randn(spec.batch, spec.width, device=device, dtype=dtype)
        # (the loss in float32, as the GPT's: torch 2.4.1, torch-directml's, has no bfloat16 mse_loss on the CPU)
        return model, lambda: torch.nn.functional.mse_loss(model(x).float(), y.float())
    model = _GPT(spec).to(device=device, dtype=dtype)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return model, lambda: torch.nn.functional.cross_entropy(model(inputs).float().reshape(-1, spec.vocab),
                                                            targets.reshape(-1))


def count_params(spec: ModelSpec) -> int:
    """The parameters of ``spec``'s model (built on the meta device: nothing allocated, whatever its size)."""
    with torch.device("meta"):  # (modules made on the meta device, not made on the CPU and moved there)
        model, _ = build_model(spec, torch.device("meta"), torch.float32)
    return sum(p.numel() for p in model.parameters())


# -- configurations -------------------------------------------------------------------------------------------------


#: What a bfloat16 row's ``directml`` says: DirectML has no bfloat16 (microsoft/DirectML#688).
NOT_ON_DIRECTML = "not on DirectML (no bfloat16)"
#: What the float16 lean rows' ``directml`` says.
RECOMMENDED = "yes: DirectML's lean configuration (recommended)"


@dataclass(frozen=True)
class Config:
    """One optimizer configuration: ``family`` (``torch``, ``dml_optim``, ``bitsandbytes``, ``torchao``),
    the parameters' ``dtype``, the optimizer's keyword ``options``, the package it needs (``peer``),
    ``phase2``: ``"rounding"`` (needs ``rounding="stochastic"``), ``"backward"`` (the step inside
    backward) and ``"scaler"`` (with it, a :class:`dml_optim.DynamicLossScaler` passed to
    ``step_in_backward`` and the loss scaled), and ``directml``: whether it runs on DirectML, in words
    (:func:`_on_directml` by default)."""

    key: str
    label: str
    family: str
    dtype: str = "float32"
    options: tuple[tuple[str, Any], ...] = ()
    peer: str | None = None
    phase2: tuple[str, ...] = ()
    directml: str = ""
    optimizer: str = "AdamW"  # (the dml_optim class of a dml_optim row)

    def __post_init__(self):
        if not self.directml:
            object.__setattr__(self, "directml", _on_directml(self))

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)


def _on_directml(cfg: Config) -> str:
    """Whether ``cfg`` runs on DirectML, in words: bfloat16 never does; the others as their family does."""
    if cfg.dtype == "bfloat16":
        return NOT_ON_DIRECTML
    if cfg.family == "torch":
        return "yes, with a CPU fallback per parameter (lerp_)"
    if cfg.family == "bitsandbytes":
        return "no (no DirectML backend)"
    if cfg.family == "torchao":
        return "not tested"
    if cfg.kwargs.get("backend") == "eager":
        return "yes"
    return "yes (there backend=\"auto\" runs eager; this row measures the CPU's default)"


def _ours(key: str, label: str, dtype: str = "float32", phase2: tuple[str, ...] = (), directml: str = "",
          optimizer: str = "AdamW", **options) -> Config:
    return Config(key, label, "dml_optim", dtype, tuple(options.items()), phase2=phase2, directml=directml,
                  optimizer=optimizer)


CONFIGS: tuple[Config, ...] = (
    Config("torch-fp32", "torch.optim.AdamW, FP32 (foreach)", "torch", options=(("foreach", True),)),
    Config("torch-bf16", "torch.optim.AdamW, bf16 parameters and states", "torch", "bfloat16",
           options=(("foreach", True),)),
    _ours("ours-fp32-eager", 'dml_optim.AdamW, FP32, backend="eager" (DirectML\'s path)', backend="eager"),
    _ours("ours-fp32", "dml_optim.AdamW, FP32, the default backend", backend="auto"),
    _ours("ours-8bit-eager", "dml_optim.AdamW(state_bits=8), eager", backend="eager", state_bits=8),
    _ours("ours-4bit-eager", "dml_optim.AdamW(state_bits=4), eager", backend="eager", state_bits=4),
    _ours("ours-8bit", "dml_optim.AdamW(state_bits=8), the default backend", backend="auto", state_bits=8),
    _ours("ours-bf16-kahan-8bit-eager", "dml_optim.AdamW, bf16 + kahan=True + state_bits=8, eager", "bfloat16",
          backend="eager", kahan=True, state_bits=8),
    _ours("ours-bf16-kahan-4bit-eager", "dml_optim.AdamW, bf16 + kahan=True + state_bits=4, eager", "bfloat16",
          backend="eager", kahan=True, state_bits=4),
    Config("bnb-8bit", "bitsandbytes AdamW8bit", "bitsandbytes", peer="bitsandbytes"),
    Config("torchao-8bit", "torchao AdamW8bit", "torchao", peer="torchao"),
    Config("torchao-4bit", "torchao AdamW4bit", "torchao", peer="torchao"),
    # phase 2 of the whole-training-memory work: rows that say "not available yet" until the options exist
    _ours("ours-bf16-sr-8bit-eager", 'dml_optim.AdamW, bf16 + rounding="stochastic" + state_bits=8, eager',
          "bfloat16", phase2=("rounding",), backend="eager", rounding="stochastic", state_bits=8),
    _ours("ours-bf16-sr-4bit-eager", 'dml_optim.AdamW, bf16 + rounding="stochastic" + state_bits=4, eager',
          "bfloat16", phase2=("rounding",), backend="eager", rounding="stochastic", state_bits=4),
    _ours("ours-fp32-eager-backward", "dml_optim.AdamW, FP32, eager, step inside backward",
          phase2=("backward",), backend="eager"),
    _ours("ours-fp32-backward", "dml_optim.AdamW, FP32, the default backend, step inside backward",
          phase2=("backward",), backend="auto"),
    _ours("ours-bf16-kahan-8bit-eager-backward", "dml_optim.AdamW, bf16 + kahan + state_bits=8, eager, step inside "
          "backward", "bfloat16", phase2=("backward",), backend="eager", kahan=True, state_bits=8),
    _ours("ours-bf16-sr-8bit-eager-backward", 'dml_optim.AdamW, bf16 + rounding="stochastic" + state_bits=8, eager, '
          "step inside backward", "bfloat16", phase2=("rounding", "backward"), backend="eager",
          rounding="stochastic", state_bits=8),
    _ours("ours-bf16-sr-4bit-eager-backward", 'dml_optim.AdamW, bf16 + rounding="stochastic" + state_bits=4, eager, '
          "step inside backward", "bfloat16", phase2=("rounding", "backward"), backend="eager",
          rounding="stochastic", state_bits=4),
    # DirectML's lean configuration (issue 49): float16 (DirectML has no bfloat16), the loss scaled inside backward
    _ours("ours-fp16-sr-8bit-eager-backward", 'dml_optim.AdamW, fp16 + rounding="stochastic" + state_bits=8, eager, '
          "step inside backward with DynamicLossScaler", "float16", phase2=("rounding", "backward", "scaler"),
          directml=RECOMMENDED, backend="eager", rounding="stochastic", state_bits=8),
    _ours("ours-fp16-sr-4bit-eager-backward", 'dml_optim.AdamW, fp16 + rounding="stochastic" + state_bits=4, eager, '
          "step inside backward with DynamicLossScaler", "float16", phase2=("rounding", "backward", "scaler"),
          directml=RECOMMENDED, backend="eager", rounding="stochastic", state_bits=4),
    _ours("ours-fp16-kahan-8bit-eager-backward", "dml_optim.AdamW, fp16 + kahan + state_bits=8, eager, step inside "
          "backward with DynamicLossScaler", "float16", phase2=("backward", "scaler"), backend="eager", kahan=True,
          state_bits=8),
    # Lion (one state: 4 bytes per parameter less than AdamW in FP32, 1 with state_bits=8)
    _ours("ours-lion-fp32-eager", 'dml_optim.Lion, FP32, backend="eager" (DirectML\'s path)', optimizer="Lion",
          backend="eager"),
    _ours("ours-lion-8bit-eager", "dml_optim.Lion(state_bits=8), eager", optimizer="Lion", backend="eager",
          state_bits=8),
    _ours("ours-lion-fp16-sr-8bit-eager-backward", 'dml_optim.Lion, fp16 + rounding="stochastic" + state_bits=8, '
          "eager, step inside backward with DynamicLossScaler", "float16", phase2=("rounding", "backward", "scaler"),
          optimizer="Lion", backend="eager", rounding="stochastic", state_bits=8),
)
#: The float16 lean configurations: what DirectML runs in the least memory (the recommended configuration).
LEAN_FP16 = ("ours-fp16-sr-8bit-eager-backward", "ours-fp16-sr-4bit-eager-backward")
_BY_KEY = {c.key: c for c in CONFIGS}
#: The reference every row's ratio is taken to (same model, same zero_grad style, same run).
REFERENCE = "torch-fp32"


def config(key: str) -> Config:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown configuration {key!r} (known: {', '.join(_BY_KEY)})") from None


def _step_in_backward() -> Callable | None:
    """The step-inside-backward entry point, where one exists: ``dml_optim.step_in_backward`` or
    ``dml_optim.training.backward.step_in_backward``."""
    import dml_optim

    fn = getattr(dml_optim, "step_in_backward", None)
    if fn is not None:
        return fn
    try:
        return importlib.import_module("dml_optim.training.backward").step_in_backward
    except (ImportError, AttributeError):
        return None


def availability(cfg: Config) -> tuple[str, str | None]:
    """``("available", None)``, ``("not installed", why)`` or ``("not available yet", why)``: a peer package is
    imported; a phase-2 option is tried on a one-element parameter of the configuration's dtype."""
    if cfg.peer is not None:
        try:
            importlib.import_module(cfg.peer)
        except Exception as exc:  # ImportError, or a broken install (missing shared library ...)
            return "not installed", f"{cfg.peer}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if "rounding" in cfg.phase2:
        import dml_optim

        probe = torch.nn.Parameter(torch.zeros(4, dtype=getattr(torch, cfg.dtype)))
        try:
            getattr(dml_optim, cfg.optimizer)([probe], **cfg.kwargs)
        except (TypeError, ValueError) as exc:
            return "not available yet", (f"dml_optim.{cfg.optimizer}(rounding=\"stochastic\"): "
                                         f"{type(exc).__name__}: {exc}")
    if "backward" in cfg.phase2:
        step_in_backward = _step_in_backward()
        if step_in_backward is None:
            return "not available yet", "no dml_optim.step_in_backward (nor dml_optim.training.backward.step_in_backward)"
        probe = torch.nn.Parameter(torch.zeros(4, dtype=getattr(torch, cfg.dtype)))
        try:
            step_in_backward(_build_optimizer(cfg, [probe]), **_scaler_kwargs(cfg)).remove()
        except (TypeError, ValueError, AttributeError) as exc:  # refused for this configuration, with the reason
            return "not available yet", f"step_in_backward: {type(exc).__name__}: {exc}"
    return "available", None


def _scaler_kwargs(cfg: Config) -> dict[str, Any]:
    """``{"scaler": DynamicLossScaler()}`` for a configuration of phase ``"scaler"``, else ``{}``."""
    if "scaler" not in cfg.phase2:
        return {}
    import dml_optim

    scaler = getattr(dml_optim, "DynamicLossScaler", None)
    if scaler is None:
        raise AttributeError("no dml_optim.DynamicLossScaler")
    return {"scaler": scaler()}


def _build_optimizer(cfg: Config, params: list[torch.nn.Parameter]):
    lr = 1e-4
    if cfg.family == "torch":
        return torch.optim.AdamW(params, lr=lr, **cfg.kwargs)
    if cfg.family == "dml_optim":
        import dml_optim

        return getattr(dml_optim, cfg.optimizer)(params, lr=lr, **cfg.kwargs)
    if cfg.family == "bitsandbytes":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr)
    if cfg.family == "torchao":
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if cfg.key.endswith("8bit") else AdamW4bit)(params, lr=lr)
    raise ValueError(f"unknown family {cfg.family!r}")


# -- what the optimizer holds (the arithmetic) ---------------------------------------------------------------------


def _tensors_in(value, out: list[torch.Tensor], depth: int = 0) -> None:
    """Every plain tensor reachable from ``value`` (containers, tensor subclasses' inner tensors, the fields of
    small state objects such as a quantized state)."""
    if depth > 4 or value is None:
        return
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                _tensors_in(getattr(value, name), out, depth + 1)
        else:
            out.append(value)
        return
    if isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out, depth + 1)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            _tensors_in(v, out, depth + 1)
    elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
        fields = getattr(value, "__dict__", None) or {s: getattr(value, s, None) for s in getattr(value, "__slots__", ())}
        for v in fields.values():
            if isinstance(v, (torch.Tensor, list, tuple, dict)):
                _tensors_in(v, out, depth + 1)


def _bytes(tensors: Sequence[torch.Tensor], exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages of ``tensors`` (a storage counted once, and not if in ``exclude``)."""
    seen: dict[int, int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            ptr, size = id(t), t.numel() * t.element_size()
        if ptr not in exclude and size:
            seen[ptr] = size
    return sum(seen.values())


def arithmetic(opt, params: list[torch.nn.Parameter]) -> dict[str, int]:
    """``params``, ``grads`` (one per parameter, in its dtype), ``state`` (the optimizer's states, master copy,
    compensation; quantized codes and scales) and ``scratch`` (dml_optim's kept scratch, beside: not in
    the arithmetic total), in bytes."""
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    scratch = 0
    if hasattr(opt, "flat_buffers"):
        held: list[torch.Tensor] = []
        scratch_tensors: list[torch.Tensor] = []
        for info in opt.flat_buffers():
            _tensors_in(dict(info.states), held)
            _tensors_in([info.master, info.kahan], held)
            _tensors_in(list(info.scratch), scratch_tensors)
        state = _bytes(held, param_storages)
        scratch = _bytes(scratch_tensors, param_storages)
    else:
        held = []
        _tensors_in([opt.state[p] for p in params if p in opt.state], held)
        state = _bytes([t for t in held if t.dim() > 0], param_storages)
    return {"params": p_bytes, "grads": p_bytes, "state": state, "total": 2 * p_bytes + state, "scratch": scratch}


# -- the child: real training steps, the peak measured -------------------------------------------------------------


def _status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class _Counter:
    """The resident set on the CPU (VmRSS, VmHWM reset through clear_refs); allocated bytes on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            if not (os.path.exists("/proc/self/clear_refs") and os.path.exists("/proc/self/status")):
                raise RuntimeError("the CPU's peak is read from /proc/self/status (Linux only)")
            self.name = "VmHWM (resident set), MALLOC_MMAP_THRESHOLD_=%d" % MMAP_THRESHOLD
        elif device.type == "cuda":
            self.name = "torch.cuda.max_memory_allocated"
        else:
            raise RuntimeError(f"no peak-memory counter on {device.type}")

    def now(self) -> int:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS")

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_bytes("VmHWM")


def _settle(opt, step: Callable[[], Any]) -> None:
    """Step dml_optim's default backend until it has chosen for good (it may compile after running eagerly for
    a while): the measured steps are a long run's."""
    try:
        from dml_optim.benchmark.candidates import settle_steps
    except ImportError:
        return
    settle_steps(opt, step)


def training_loop(cfg: Config, spec: ModelSpec, device: torch.device, set_to_none: bool, seed: int = 0):
    """``(opt, params, iterate, mode)``: ``iterate()`` runs one training iteration and returns the loss."""
    dtype = getattr(torch, cfg.dtype)
    model, loss_fn = build_model(spec, device, dtype, seed)
    params = list(model.parameters())
    opt = _build_optimizer(cfg, params)
    if "backward" in cfg.phase2:
        step_in_backward = _step_in_backward()
        if step_in_backward is None:
            raise RuntimeError("no step inside backward")
        scaler = _scaler_kwargs(cfg).get("scaler")
        step_in_backward(opt, scaler=scaler)
        if scaler is not None:  # float16: the loss scaled, each run unscaled (float32) and gated inside backward
            def iterate():
                loss = loss_fn()  # (in float32: the model's output cast up, as every row does)
                scaler.scale(loss).backward()  # each run of the flat buffer unscaled, checked and stepped inside
                scaler.update()
                opt.zero_grad(set_to_none=set_to_none)
                return loss.detach()

            return (opt, params, iterate, "forward, scaler.scale(loss).backward() (each run unscaled, checked and "
                    f"stepped inside), scaler.update(), zero_grad(set_to_none={set_to_none}); no clipping (refused)")

        def iterate():
            loss = loss_fn()
            loss.backward()  # each run of the flat buffer steps inside
            opt.zero_grad(set_to_none=set_to_none)
            return loss.detach()

        return opt, params, iterate, "forward, backward (the step inside), zero_grad; no clipping (refused)"

    def iterate():
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()

    return opt, params, iterate, f"forward, backward, {_CLIP}, step, zero_grad(set_to_none={set_to_none})"


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration in this process (the child); ``spec``: ``config``, ``set_to_none``, ``model``,
    ``device``, ``warmup``, ``steps``, ``seed``, ``tiny_warmup``, and ``extra_bytes``: when given, the measured
    steps run a second time with a tensor of that many bytes held through them, and that peak is
    ``peak_extra_bytes`` (the tests' known allocation)."""
    t0 = time.perf_counter()
    cfg = config(spec["config"])
    model_spec = MODELS[spec["model"]] if isinstance(spec["model"], str) else ModelSpec(**spec["model"])
    device = torch.device(spec.get("device", "cpu"))
    set_to_none = bool(spec["set_to_none"])
    counter = _Counter(device)
    if cfg.peer is not None:
        importlib.import_module(cfg.peer)
    import dml_optim  # noqa: F401  (imported before the baselines in every configuration)

    if cfg.kwargs.get("backend") == "eager" and device.type == "cpu":
        # DirectML's path: its scratch laid out as there (a float32 step in chunks within 32 MiB or 0.5 B/param;
        # the CPU's own eager step keeps a full-size float32 scratch, 4 B/param, for speed)
        from dml_optim.backends.eager import laid_out_as

        layout = laid_out_as("privateuseone")  # (kept: a dropped context manager's generator would reset it)
        layout.__enter__()  # (for the rest of this subprocess)

    after_imports = counter.now()
    if spec.get("tiny_warmup", True):  # the code paths, kernels and lazy imports of this configuration, loaded
        opt, _, iterate, _ = training_loop(cfg, MODELS["tiny"], device, set_to_none, seed=1)
        for _ in range(3):
            iterate()
        del opt, iterate
    baseline = counter.now()
    opt, params, iterate, loop = training_loop(cfg, model_spec, device, set_to_none, seed=spec.get("seed", 0))
    losses = []
    for _ in range(spec.get("warmup", 2)):
        losses.append(float(iterate()))
    backend = None
    if cfg.family == "dml_optim":
        if "backward" not in cfg.phase2:
            _settle(opt, iterate)
        try:
            from dml_optim.benchmark.candidates import ran

            backend = ran(opt)
        except Exception:  # the introspection is optional
            backend = None
    counter.reset()
    before_steps = counter.now()
    for _ in range(spec.get("steps", 2)):
        losses.append(float(iterate()))
    peak = counter.peak()
    peak_extra = None
    if spec.get("extra_bytes"):  # the same steps again, a known allocation held through them
        counter.reset()
        extra = torch.ones(int(spec["extra_bytes"]) // 4, dtype=torch.float32, device=device)
        for _ in range(spec.get("steps", 2)):
            losses.append(float(iterate()))
        peak_extra = counter.peak()
        del extra
    ar = arithmetic(opt, params)
    return {
        "config": cfg.key, "set_to_none": set_to_none, "model": model_spec.name, "device": device.type,
        "counter": counter.name, "params": sum(p.numel() for p in params), "loop": loop, "backend": backend,
        "after_imports_bytes": after_imports, "baseline_bytes": baseline, "before_steps_bytes": before_steps,
        "peak_raw_bytes": peak, "peak_bytes": peak - baseline, "peak_bytes_with_libraries": peak - after_imports,
        "arithmetic_bytes": ar, "losses": losses, "seconds": round(time.perf_counter() - t0, 1),
        "extra_bytes": int(spec.get("extra_bytes") or 0),
        "peak_extra_bytes": None if peak_extra is None else peak_extra - baseline,
    }


# -- the parent: one subprocess per configuration and zero_grad style ----------------------------------------------


def measure_one(spec: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    """Run :func:`run_child` in a fresh interpreter with ``MALLOC_MMAP_THRESHOLD_`` set; its result, or
    ``{"error": ...}``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    cmd = [sys.executable, "-m", "dml_optim.benchmark.wholemem", "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_PREFIX):
            return json.loads(line[len(_RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"the child exited with {proc.returncode}: {tail}"}


def row_fields() -> dict[str, str]:
    """The fields of a row of the document, with their meaning (for the README table generator)."""
    return {
        "config": "configuration key (CONFIGS)", "label": "what it is, in words", "family": "torch, dml_optim, "
        "bitsandbytes or torchao", "dtype": "the parameters' dtype", "directml": "whether it runs on DirectML, in "
        "words (bfloat16: not on DirectML)", "zero_grad": '"set_to_none=True" or '
        '"set_to_none=False"', "set_to_none": "bool", "status": '"measured", "not installed", "not available yet" '
        'or "failed"', "reason": "why not measured (None when measured)", "loop": "what one iteration runs "
        "(the clipping call named)", "backend": "what dml_optim's buffers ran", "params": "trainable parameters",
        "peak_bytes": "peak above the baseline (before the model existed, after a warm-up on a tiny model)",
        "peak_bytes_per_param": "peak_bytes / params", "peak_bytes_with_libraries": "peak above the resident "
        "size right after the imports", "peak_bytes_per_param_with_libraries": "the same per parameter",
        "ratio_to_reference": "peak_bytes / the same zero_grad style's torch-fp32 peak_bytes",
        "arithmetic_bytes_per_param": "params + grads + optimizer state, per parameter (beside, never instead)",
        "arithmetic": "bytes: params, grads, state, total, scratch (dml_optim's kept scratch, not in total)",
        "seconds": "the child's wall time", "losses": "each step's loss (a sanity check)",
    }


def measure(configs: Sequence[str] | None = None, *, model: str = "mlp", styles: Sequence[bool] = (True, False),
            device: str = "cpu", warmup: int = 2, steps: int = 2, log: Callable[[str], None] = print,
            timeout: float = 1800.0) -> dict[str, Any]:
    """The document: every configuration of ``configs`` (default all) x ``styles`` (``set_to_none`` values),
    each in its own subprocess."""
    from dml_optim.benchmark.machine import describe

    keys = list(configs or [c.key for c in CONFIGS])
    cfgs = [config(k) for k in keys]
    spec = MODELS[model]
    dev = torch.device(device)
    n = count_params(spec)
    versions = {"torch": torch.__version__}
    for peer in ("bitsandbytes", "torchao"):
        try:  # (from the installed metadata: importing torchao takes seconds)
            versions[peer] = importlib.metadata.version(peer)
        except importlib.metadata.PackageNotFoundError:
            versions[peer] = None
    doc: dict[str, Any] = {
        "schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": describe(dev), "versions": versions,
        "method": {
            "counter": "VmHWM - VmRSS before the model (Linux /proc/self/status), MALLOC_MMAP_THRESHOLD_="
                       f"{MMAP_THRESHOLD}, peak reset by writing 5 to /proc/self/clear_refs" if dev.type == "cpu"
                       else "torch.cuda.max_memory_allocated - memory_allocated before the model",
            "baseline": "after the imports and 3 iterations of the same configuration on a tiny model, freed",
            "warmup_steps": warmup, "measured_steps": steps, "clip": _CLIP + " on every row but the step inside "
            "backward (clipping refused there)", "lr": 1e-4, "reference": REFERENCE,
            "loss_scaling": "rows of phase 'scaler' (float16, the step inside backward): "
                            "step_in_backward(opt, scaler=dml_optim.DynamicLossScaler()), the loop "
                            "scaler.scale(loss).backward(); scaler.update(); zero_grad; the loss in float32",
            "directml": "each row's 'directml' says whether it runs on DirectML; DirectML has no bfloat16, so the "
                        "bfloat16 rows are measured on the CPU for comparison only",
            "eager_layout": "rows of backend='eager' (DirectML's path) lay their scratch out as on DirectML: a float32 "
                            "step in chunks within 32 MiB or 0.5 B/param (the CPU's own eager step keeps a full-size "
                            "float32 scratch, 4 B/param, for speed)",
        },
        "model": {"name": spec.name, "description": spec.describe(), "params": n},
        "rows": [],
    }
    for cfg in cfgs:
        status, reason = availability(cfg)
        for style in styles:
            row: dict[str, Any] = {"config": cfg.key, "label": cfg.label, "family": cfg.family, "dtype": cfg.dtype,
                                   "directml": cfg.directml, "zero_grad": f"set_to_none={style}",
                                   "set_to_none": style, "status": status, "reason": reason, "params": n}
            if status == "available":
                log(f"  {cfg.key}, zero_grad(set_to_none={style}) ...")
                res = measure_one(dict(config=cfg.key, set_to_none=style, model=model, device=device, warmup=warmup,
                                       steps=steps), timeout=timeout)
                if "error" in res:
                    row.update(status="failed", reason=res["error"])
                else:
                    ar = res["arithmetic_bytes"]
                    row.update(status="measured", reason=None, loop=res["loop"], backend=res["backend"],
                               counter=res["counter"], peak_bytes=res["peak_bytes"],
                               peak_bytes_per_param=round(res["peak_bytes"] / n, 2),
                               peak_bytes_with_libraries=res["peak_bytes_with_libraries"],
                               peak_bytes_per_param_with_libraries=round(res["peak_bytes_with_libraries"] / n, 2),
                               arithmetic=ar, arithmetic_bytes_per_param=round(ar["total"] / n, 2),
                               baseline_bytes=res["baseline_bytes"], seconds=res["seconds"], losses=res["losses"])
                log(f"    {_describe_row(row)}")
            doc["rows"].append(row)
    add_ratios(doc)
    return doc


def add_ratios(doc: dict[str, Any]) -> None:
    """Each measured row's ``ratio_to_reference``: its peak over torch.optim.AdamW FP32's, same ``zero_grad`` style."""
    ref = {r["set_to_none"]: r["peak_bytes"] for r in doc["rows"]
           if r["config"] == REFERENCE and r["status"] == "measured"}
    for r in doc["rows"]:
        base = ref.get(r["set_to_none"])
        r["ratio_to_reference"] = round(r["peak_bytes"] / base, 3) if r["status"] == "measured" and base else None


def _describe_row(r: dict[str, Any]) -> str:
    if r["status"] != "measured":
        return f"{r['status']}: {r['reason']}"
    return (f"peak {r['peak_bytes_per_param']:.2f} B/param ({r['peak_bytes'] / 2**20:.0f} MiB; with the "
            f"libraries' pages {r['peak_bytes_per_param_with_libraries']:.2f}), arithmetic "
            f"{r['arithmetic_bytes_per_param']:.2f}, backend {r.get('backend')}, {r['seconds']} s")


def format_table(doc: dict[str, Any]) -> str:
    """A markdown table: one line per configuration, the two zero_grad styles side by side (B/param)."""
    rows: dict[str, dict[bool, dict]] = {}
    for r in doc["rows"]:
        rows.setdefault(r["config"], {})[r["set_to_none"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        if r["status"] != "measured":
            return r["status"]
        ratio = f" ({r['ratio_to_reference']:.2f}x)" if r.get("ratio_to_reference") is not None else ""
        return f"{r['peak_bytes_per_param']:.2f}{ratio}"

    lines = [f"Whole-training peak, {doc['model']['description']} ({doc['model']['params'] / 1e6:.1f}M parameters), "
             "bytes per parameter (x torch.optim.AdamW FP32's, same zero_grad style)", "",
             "| configuration | on DirectML | peak, set_to_none=True | peak, set_to_none=False | arithmetic |",
             "|---|---|---:|---:|---:|"]
    for key, styles in rows.items():
        any_row = next(iter(styles.values()))
        arith = next((f"{r['arithmetic_bytes_per_param']:.2f}" for r in styles.values() if r["status"] == "measured"), "")
        directml = any_row.get("directml") or (_BY_KEY[key].directml if key in _BY_KEY else "")
        lines.append(f"| {any_row['label']} | {directml} | {cell(styles.get(True))} | {cell(styles.get(False))} "
                     f"| {arith} |")
    return "\n".join(lines)


def default_output_path(root: Path | None = None) -> Path:
    """``bench/results/memory-<UTC date>.json`` under ``root`` (the current directory by default)."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return (root or Path.cwd()) / "bench" / "results" / f"memory-{date}.json"


# -- the bench row set -------------------------------------------------------------------------------------------


#: The configurations the bench's ``wholemem`` rows measure (quick: FP32 torch and dml_optim eager, 8-bit eager).
QUICK_CONFIGS = ("torch-fp32", "ours-fp32-eager", "ours-8bit-eager")


def bench_tasks(plan, task: Callable[[str, str, Callable], Any]) -> list:
    """The ``wholemem`` row set of a bench plan (:class:`dml_optim.benchmark.run.Plan`): one task per
    configuration (both zero_grad styles), made by ``task(row, label, run)`` (the bench's ``Task``, passed in:
    this module, a child's ``python -m`` target, imports nothing of the bench runner), recorded under
    ``doc["wholemem"]`` (the model's description and one entry per row). Quick: the small MLP and
    :data:`QUICK_CONFIGS`."""
    model = "mlp-small" if plan.quick else "mlp"
    keys = QUICK_CONFIGS if plan.quick else tuple(c.key for c in CONFIGS)
    tasks = []
    for key in keys:
        def run(doc, log, key=key):
            part = measure([key], model=model, device=str(plan.device), log=log)
            doc.setdefault("wholemem", []).extend(dict(r, model=part["model"]) for r in part["rows"])
            add_ratios({"rows": doc["wholemem"]})
        tasks.append(task("wholemem", f"wholemem: {key} on {model}, both zero_grad styles, in subprocesses", run))
    return tasks


# -- command line --------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dml_optim.benchmark.wholemem",
        description="Whole-training peak memory of real training steps, one subprocess per configuration and "
                    "zero_grad style (see the module's docstring).")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS), help="the model (default: mlp, 50.4M)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="KEY",
                        help=f"configurations (default: all): {', '.join(_BY_KEY)}")
    parser.add_argument("--zero-grad", choices=("both", "none", "zeros"), default="both",
                        help="set_to_none=True (none), False (zeros) or both (default)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/memory-<date>.json)")
    parser.add_argument("--list", action="store_true", help="list the configurations and whether each can run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        result = run_child(json.loads(args.child))
        print(_RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    if args.list:
        for cfg in CONFIGS:
            status, why = availability(cfg)
            print(f"{cfg.key:38} {status}{': ' + why if why else ''}")
        return 0
    for key in args.configs or ():
        if key not in _BY_KEY:
            parser.error(f"--configs: unknown configuration {key!r} (known: {', '.join(_BY_KEY)})")
    styles = {"both": (True, False), "none": (True,), "zeros": (False,)}[args.zero_grad]
    out = args.out or default_output_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = measure(args.configs, model=args.model, styles=styles, device=args.device, warmup=args.warmup,
                  steps=args.steps)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(format_table(doc))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
