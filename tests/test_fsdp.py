"""Our optimizers under FSDP2 (``torch.distributed.fsdp.fully_shard``), against torch.optim under the same sharding.

One job of two gloo processes on the CPU (loopback only) shards a small MLP layer by layer
(``fully_shard`` on each Linear, then on the root), so every parameter is a DTensor of which
each rank holds one shard.  For Momentum (vs ``SGD``), Adam with epsilon 0 (vs ``Adam(eps=0)``)
and AdamW (vs ``AdamW``), each rank runs:

* ``ours`` / ``torch``: ``STEPS`` steps on its own batches (FSDP averages the gradients), each
  after ``clip_grad_norm_`` over the DTensor gradients;
* ``ours-resumed`` / ``torch-resumed``: ``RESUME_AT`` steps; ``dcp.save`` of the model's and
  the optimizer's state dicts (``get_state_dict``, the ``torch.distributed.checkpoint.state_dict``
  helpers) to a folder; a fresh model and optimizer; ``dcp.load`` and ``set_state_dict``; the
  remaining steps.  That must equal the uninterrupted run bit for bit.

The workers write the gathered parameters (``full_tensor()``), the consolidated optimizer state
(``get_optimizer_state_dict`` with ``full_state_dict=True``) and facts about the optimizer (flat
buffer sizes against the local shards, the types of the state tensors) to files; the tests
compare them here.  The reference for "FSDP itself is right" is one process training on
both ranks' batches at once.

Momentum's default backend runs torch's fused SGD kernel on the CPU (dml_optim/backends/fused.py), here on
each rank's local shards, which torch.optim cannot do on DTensor parameters (no sharding strategy
for ``aten._fused_sgd_``): its SGD runs the for-loop ops, a last-place rounding apart, so
``momentum`` is compared to the tolerance.  ``momentum-eager`` (``backend="eager"``, the same two
ops as torch's SGD) is compared bit for bit.

The worker is this file run as a script: ``python tests/test_fsdp.py --worker RANK WORLD PORT OUTDIR``.
``fully_shard`` is public from torch 2.6; on older torch (2.4.1, which torch-directml pins) the
module skips with that reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _distributed import gloo_missing, run_job
from _frameworks import torch_twin

import dml_optim

WORLD = 2
STEPS = 6
RESUME_AT = 3
ROWS_PER_RANK = 4
DIST_TIMEOUT_S = 180  # the whole job; the tests never assert on time

#: name -> (ours, torch's), each built as make(params)
PAIRS = {
    # torch_twin: torch's default SGD on DTensor parameters (tests/_frameworks.py), a rounding away from
    # the fused kernel our default backend runs on the local shards: compared to the tolerance
    "momentum": (lambda p: dml_optim.Momentum(p, lr=0.1, alpha=0.9),
                 lambda p: torch_twin(torch.optim.SGD)(p, lr=0.1, momentum=0.9)),
    # our eager chain is torch's SGD op for op: bit for bit
    "momentum-eager": (lambda p: dml_optim.Momentum(p, lr=0.1, alpha=0.9, backend="eager"),
                       lambda p: torch_twin(torch.optim.SGD)(p, lr=0.1, momentum=0.9)),
    "adam": (lambda p: dml_optim.Adam(p, lr=1e-2, epsilon=0.0),
             lambda p: torch.optim.Adam(p, lr=1e-2, eps=0.0)),
    "adamw": (lambda p: dml_optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    # 8-bit states over DTensor shards (the twin keeps FP32 states: compared within the quantization's reach)
    "adamw-8bit": (lambda p: dml_optim.AdamW(p, lr=1e-2, weight_decay=0.1, state_bits=8),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
}
EXACT = {"momentum-eager"}
#: input width and first layer's rows: the 8-bit run's first weight (64 x 201) keeps 6432 elements per rank,
#: enough to be quantized (>= 4096); the others' 13 rows do not split evenly over two ranks (FSDP2 pads it)
WIDTHS = {"adamw-8bit": (64, 201)}
#: the 8-bit run against torch's FP32 states: an Adam step moves an element by about lr at most, and the
#: quantized states change that step by a fraction (about 1% of a state at the top of its decade, more for
#: values far below their block's maximum): within a tenth of lr per step, over 6 steps (observed 3.7e-3)
LOW_BIT = {"adamw-8bit": dict(rtol=2e-2, atol=0.1 * 1e-2 * STEPS)}


def plain_model(name: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    width, rows = WIDTHS.get(name, (8, 13))
    return torch.nn.Sequential(torch.nn.Linear(width, rows), torch.nn.Tanh(), torch.nn.Linear(rows, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3))


def batches(rank: int, name: str | None = None) -> list[torch.Tensor]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step * WORLD + rank)
        out.append(torch.randn(ROWS_PER_RANK, WIDTHS.get(name, (8,))[0], generator=g))
    return out


def loss_fn(model, x):
    return model(x).square().mean()


#: ``clip_grad_norm_`` before each step: the global gradient norm is 0.50, 0.45, 0.43, 0.26, 0.19,
#: 0.12 over the 6 steps (one process, global batch), so clipping engages on the first three.
CLIP = 0.3


def train(model, opt, xs) -> None:
    for x in xs:
        opt.zero_grad()
        loss_fn(model, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # FSDP2: DTensor gradients, a global norm
        opt.step()


# -- the worker (runs in each of the two processes) ------------------------------


def _sharded_model(name: str | None = None):
    from torch.distributed.fsdp import fully_shard

    model = plain_model(name)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    facts = {}
    try:
        for name, makers in PAIRS.items():
            xs = batches(rank, name)
            for side, make in zip(("ours", "torch"), makers):
                model = _sharded_model(name)
                opt = make(model.parameters())
                train(model, opt, xs)
                full = [p.full_tensor() for p in model.parameters()]
                # the consolidated optimizer state (FQN keys, full tensors, on rank 0): a collective
                full_osd = get_optimizer_state_dict(model, opt,
                                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    torch.save(full_osd["state"], out / f"{name}.{side}.full-optim.pt")
                if side == "ours":
                    sd = opt.state_dict()
                    facts[name] = {
                        "params_are_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
                        "flat_numel": sum(b.numel for b in opt.flat_buffers()),
                        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
                        "state_types": sorted({type(v).__name__ for s in sd["state"].values()
                                               for k, v in s.items() if k != "step"}),
                        "quantized_buffers": sum(1 for b in opt.flat_buffers()
                                                 if any(type(v).__name__ == "QuantizedState" for v in b.states.values())),
                    }

                # checkpoint mid-run through torch.distributed.checkpoint, resume in a fresh model and optimizer
                model = _sharded_model(name)
                opt = make(model.parameters())
                train(model, opt, xs[:RESUME_AT])
                model_sd, optim_sd = get_state_dict(model, opt)
                facts.setdefault(name, {})[f"{side}_dcp_state_types"] = sorted(
                    {type(v).__name__ for s in optim_sd["state"].values() for k, v in s.items() if k != "step"})
                folder = out / f"ckpt-{name}-{side}"
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
                del model, opt
                model = _sharded_model(name)
                opt = make(model.parameters())
                model_sd, optim_sd = get_state_dict(model, opt)
                loaded = {"model": model_sd, "optim": optim_sd}
                dcp.load(loaded, checkpoint_id=str(folder))
                set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
                train(model, opt, xs[RESUME_AT:])
                resumed = [p.full_tensor() for p in model.parameters()]
                if rank == 0:
                    torch.save(full, out / f"{name}.{side}.pt")
                    torch.save(resumed, out / f"{name}.{side}-resumed.pt")
        (out / f"facts.rank{rank}.json").write_text(json.dumps(facts))
        (out / f"done.rank{rank}").touch()
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another rank still uses it
    finally:
        dist.destroy_process_group()


# -- the parent: run the job once per module --------------------------------------


def _missing() -> str | None:
    if gloo_missing():
        return gloo_missing()
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no public torch.distributed.fsdp.fully_shard (FSDP2 is public from 2.6)"
    return None


if __name__ != "__main__":
    import pytest

    pytestmark = pytest.mark.slow

    @pytest.fixture(scope="module")
    def job(tmp_path_factory):
        missing = _missing()
        if missing:
            pytest.skip(missing)
        return run_job(__file__, WORLD, tmp_path_factory.mktemp("fsdp"), DIST_TIMEOUT_S, "FSDP2")

    def _load(job: Path, name: str, tag: str) -> list[torch.Tensor]:
        return torch.load(job / f"{name}.{tag}.pt", weights_only=True)

    def _same(name: str, actual, expected, what: str) -> None:
        from tolerances import TORCH_ADAM_FLOAT32

        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if name in LOW_BIT:
                torch.testing.assert_close(a, e, **LOW_BIT[name], msg=lambda m, i=i: f"{name} {what} tensor {i}: {m}")
            elif name in EXACT:
                assert torch.equal(a, e), f"{name} {what} tensor {i}: max |diff| {(a - e).abs().max().item()}"
            else:
                torch.testing.assert_close(a, e, **TORCH_ADAM_FLOAT32,
                                           msg=lambda m, i=i: f"{name} {what} tensor {i}: {m}")

    @pytest.mark.parametrize("name", list(PAIRS))
    def test_fully_shard_then_ours_trains_like_torch(job, name):
        """``fully_shard`` on 2 gloo ranks, then ``dml_optim.X(model.parameters())``: equal to torch.optim."""
        ours, theirs = _load(job, name, "ours"), _load(job, name, "torch")
        assert any(not torch.equal(a, b) for a, b in zip(ours, plain_model(name).parameters())), "never moved"
        _same(name, ours, theirs, "ours vs torch.optim under FSDP2")

    @pytest.mark.parametrize("name", list(PAIRS))
    def test_fsdp_equals_one_process_on_the_global_batch(job, name):
        """FSDP2 averages the ranks' gradients: one process on both ranks' rows takes the same steps."""
        model = plain_model(name)
        opt = PAIRS[name][0](model.parameters())
        per_rank = [batches(r, name) for r in range(WORLD)]
        train(model, opt, [torch.cat(xs) for xs in zip(*per_rank)])
        from tolerances import TOL

        for a, e in zip(_load(job, name, "ours"), model.parameters(), strict=True):
            torch.testing.assert_close(a, e.detach(), **LOW_BIT.get(name, TOL[torch.float32]))

    @pytest.mark.parametrize("side", ["ours", "torch"])
    @pytest.mark.parametrize("name", list(PAIRS))
    def test_dcp_checkpoint_resume_equals_an_uninterrupted_run(job, name, side):
        """``dcp.save``/``dcp.load`` of model and optimizer (``get_state_dict``/``set_state_dict``)
        mid-run, resumed in a fresh model and optimizer: bit-identical to the run without the break."""
        for a, b in zip(_load(job, name, f"{side}-resumed"), _load(job, name, side), strict=True):
            assert torch.equal(a, b), f"{name} {side}: max |diff| {(a - b).abs().max().item()}"

    @pytest.mark.parametrize("name", list(PAIRS))
    def test_full_optimizer_state_dict_equals_torchs(job, name):
        """``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``
        gathers our sharded states into the same consolidated, FQN-keyed dict as torch.optim's: the
        same parameters, state names and full shapes, the same values (to the pair's tolerance)."""
        ours = torch.load(job / f"{name}.ours.full-optim.pt", weights_only=True)
        theirs = torch.load(job / f"{name}.torch.full-optim.pt", weights_only=True)
        shapes = {n: p.shape for n, p in plain_model(name).named_parameters()}
        assert sorted(ours) == sorted(theirs) == sorted(shapes)
        for fqn, state in ours.items():
            # our Momentum keeps a step count (ONNX Momentum's T: the first step is not damped); SGD has none
            assert sorted(state) == sorted({*theirs[fqn], "step"}), fqn
            for key, value in state.items():
                if key == "step":
                    assert float(value) == STEPS and float(theirs[fqn].get(key, STEPS)) == STEPS, fqn
                    continue
                assert value.shape == shapes[fqn], (fqn, key)  # gathered, not a shard
                _same(name, [value], [theirs[fqn][key]], f"{fqn} {key}")

    @pytest.mark.parametrize("name", list(PAIRS))
    def test_one_flat_buffer_over_each_ranks_local_shards_and_dtensor_states(job, name):
        for r in range(WORLD):
            facts = json.loads((job / f"facts.rank{r}.json").read_text())[name]
            assert facts["params_are_dtensors"]
            if name in LOW_BIT:  # the local shards, padded to whole blocks of 256 where quantized
                assert 0 <= facts["flat_numel"] - facts["local_numel"] < 256, facts
            else:
                assert facts["flat_numel"] == facts["local_numel"], facts  # the local shards, not the full tensors
            assert facts["state_types"] == ["DTensor"], facts  # opt.state_dict(): sharded states
            assert facts["ours_dcp_state_types"] == facts["torch_dcp_state_types"] == ["DTensor"], facts
            # 8-bit: the large weight's shard is quantized on every rank (saved decoded, as DTensors)
            assert facts["quantized_buffers"] == (1 if name in LOW_BIT else 0), facts

else:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "PORT", "OUTDIR"), required=True)
    rank, world, port, outdir = parser.parse_args().worker
    _worker(int(rank), int(world), int(port), Path(outdir))
