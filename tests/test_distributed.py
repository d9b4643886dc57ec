"""dml_optim under torch.distributed: DDP and ZeroRedundancyOptimizer (issue 9).

One job of two gloo processes on the CPU (loopback only) runs every
configuration in turn and writes what it ends with to files; the tests compare
those against single-process runs over the same global batches:

* ``ddp``: ``DistributedDataParallel`` with ``gradient_as_bucket_view=False``
  (DDP copies the averaged gradients back into ``p.grad``, our flat views);
* ``ddp-bucket``: ``gradient_as_bucket_view=True`` (``p.grad`` becomes a view
  of DDP's bucket; ``step()`` gathers it into the flat gradient buffer);
* ``zero``: DDP + ``ZeroRedundancyOptimizer(optimizer_class=<ours>)``, with a
  checkpoint consolidated on rank 0 mid-run (``dml_optim.training.distributed.zero_state_dict``),
  resumed both by a fresh ZeRO on both ranks (``load_zero_state_dict``) and by a
  plain single-process optimizer;
* for Adam only (the mechanisms do not depend on the optimizer): the optimizer
  created before DDP wraps the model; ZeRO's own ``load_state_dict``
  (``zero-resumed-plain``: it assigns ``optimizer.state[p]``, which writes
  through to the flat buffers) and ``parameters_as_bucket_view=True``
  (``zero-pbv``: ZeRO re-binds ``p.data`` into its own bucket, which the
  optimizer adopts as its flat buffer).  See docs/distributed.md.

DDP averages gradients over ranks, so the single-process reference minimises
the mean loss over the whole global batch.  Each rank takes the rows
``rank::world`` of a global batch (what ``DistributedSampler`` does).

The worker is this file run as a script: ``python tests/test_distributed.py
--worker RANK WORLD PORT OUTDIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _distributed import gloo_missing, run_job

import dml_optim
from dml_optim.job import toy
from dml_optim.core.options import OPTION_NAMES

WORLD = 2
STEPS = 6           # optimizer steps per run
RESUME_AT = 3       # the ZeRO checkpoint is taken after this many steps
GLOBAL_BATCH = 32
HIDDEN = 16
#: The 8-bit run's width: 32x128 and 128x128 weights, large enough (>= 4096 elements) to be quantized
HIDDEN_OF = {"adamw-8bit": 128}
MODEL_SEED = 1
DATA_SEED = 2
#: Name -> (class, constructor keywords): large enough steps that the parameters
#: move visibly in ``STEPS`` steps, and hyperparameters other than the defaults,
#: so that a checkpoint that loses them shows.
OPTIMIZERS = {
    "adam": (dml_optim.Adam, dict(lr=1e-2, alpha=0.8, beta=0.99, norm_coefficient=1e-3)),
    "dml-adam": (dml_optim.DmlAdam, dict(lr=1e-2, beta1=0.8, beta2=0.99)),
    "adagrad": (dml_optim.Adagrad, dict(lr=5e-2, decay_factor=0.1, epsilon=1e-6)),
    "momentum": (dml_optim.Momentum, dict(lr=5e-2, alpha=0.8, mode="nesterov")),
    # 8-bit states: each rank's ZeRO shard is quantized, its checkpoint holds codes and scales
    "adamw-8bit": (dml_optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), state_bits=8)),
}
DIST_TIMEOUT_S = 120  # the whole job; the tests never assert on time


# -- shared by the worker and the tests ------------------------------------------


def global_batches(steps: int = STEPS):
    """The ``steps`` global batches ``(x, y)`` every run trains on, in order."""
    x, y, _, _ = toy.make_dataset(DATA_SEED, n_train=steps * GLOBAL_BATCH, n_test=1)
    return [(x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]) for i in range(steps)]


def make_model(name: str | None = None):
    return toy.make_model(MODEL_SEED, hidden=HIDDEN_OF.get(name, HIDDEN))


def train_steps(model, optimizer, batches, rank: int = 0, world: int = 1) -> None:
    """One step per global batch; this rank's share is rows ``rank::world``."""
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rank::world]), y[rank::world])
        loss.backward()
        optimizer.step()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- the worker (runs in each of the two processes) ------------------------------


def _ddp(model, bucket_view: bool):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)


def _zero(params, name: str, **zero_kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = OPTIMIZERS[name]
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, **zero_kwargs, **kwargs)


def _save(out: Path, tag: str, rank: int, model) -> None:
    torch.save(flat_params(model), out / f"{tag}.rank{rank}.pt")


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    from dml_optim.training.distributed import load_zero_state_dict, zero_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batches = global_batches()
    try:
        for name, (cls, kwargs) in OPTIMIZERS.items():
            for tag, bucket_view in ((f"ddp.{name}", False), (f"ddp-bucket.{name}", True)):
                model = _ddp(make_model(name), bucket_view)
                train_steps(model, cls(model.parameters(), **kwargs), batches, rank, world)
                _save(out, tag, rank, model.module)

            # ZeRO, with a checkpoint consolidated on rank 0 after RESUME_AT steps
            model = _ddp(make_model(name), False)
            opt = _zero(model.parameters(), name)
            train_steps(model, opt, batches[:RESUME_AT], rank, world)
            opt.consolidate_state_dict(to=0)
            ckpt = out / f"zero.{name}.ckpt.pt"
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": zero_state_dict(opt)}, ckpt)
            dist.barrier()
            train_steps(model, opt, batches[RESUME_AT:], rank, world)
            _save(out, f"zero.{name}", rank, model.module)
            local = opt.optim.state_dict()
            shard = {"params": sum(len(g["params"]) for g in local["param_groups"]), "with_state": len(local["state"])}
            (out / f"zero.{name}.shard.rank{rank}.json").write_text(json.dumps(shard))

            # a fresh ZeRO on every rank resumes from the checkpoint
            saved = torch.load(ckpt, weights_only=True)
            model = make_model(name)
            model.load_state_dict(saved["model"])
            model = _ddp(model, False)
            opt = _zero(model.parameters(), name)
            load_zero_state_dict(opt, saved["optimizer"])
            train_steps(model, opt, batches[RESUME_AT:], rank, world)
            _save(out, f"zero-resumed.{name}", rank, model.module)

            if name != "adam":  # what follows does not depend on the optimizer
                continue

            # the optimizer packs the parameters *before* DDP wraps the model
            model = make_model(name)
            opt = cls(model.parameters(), **kwargs)
            model = _ddp(model, True)
            train_steps(model, opt, batches, rank, world)
            _save(out, f"ddp-opt-first.{name}", rank, model.module)

            # the same with torch's own ZeroRedundancyOptimizer.load_state_dict
            model = make_model(name)
            model.load_state_dict(saved["model"])
            model = _ddp(model, False)
            opt = _zero(model.parameters(), name)
            opt.load_state_dict(saved["optimizer"])
            train_steps(model, opt, batches[RESUME_AT:], rank, world)
            _save(out, f"zero-resumed-plain.{name}", rank, model.module)

            # ZeRO's parameters_as_bucket_view=True
            model = _ddp(make_model(name), False)
            opt = _zero(model.parameters(), name, parameters_as_bucket_view=True)
            train_steps(model, opt, batches, rank, world)
            _save(out, f"zero-pbv.{name}", rank, model.module)
        (out / f"done.rank{rank}").touch()
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another rank still uses it
    finally:
        dist.destroy_process_group()


# -- the parent: spawn the job once per session -----------------------------------




if __name__ != "__main__":
    import pytest

    from tolerances import assert_close

    pytestmark = [
        pytest.mark.slow,
        # importing torch.distributed.optim scripts functional optimizers (torch's own deprecation noise)
        pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning"),
    ]
    _MISSING = gloo_missing()

    @pytest.fixture(scope="module")
    def job(tmp_path_factory):
        """Run the two-process job once; returns its output folder."""
        if _MISSING:
            pytest.skip(_MISSING)
        return run_job(__file__, WORLD, tmp_path_factory.mktemp("distributed"), DIST_TIMEOUT_S, "distributed")

    @pytest.fixture(scope="module")
    def single():
        """Single-process runs over the same global batches, one per optimizer."""
        batches = global_batches()
        out = {}
        for name, (cls, kwargs) in OPTIMIZERS.items():
            model = make_model(name)
            train_steps(model, cls(model.parameters(), **kwargs), batches)
            out[name] = flat_params(model)
        return out

    def _ranks(job: Path, tag: str) -> list[torch.Tensor]:
        return [torch.load(job / f"{tag}.rank{r}.pt", weights_only=True) for r in range(WORLD)]

    #: DDP averages the ranks' gradients (a float32 sum in another order than one process's): where that
    #: rounding moves a state across a code level of an 8-bit block, the element's update changes by at most a
    #: level's step (1.4% relative at the top of a decade), lr 1e-2 over 6 steps: 1e-3
    LOW_BIT_TOL = dict(rtol=1e-3, atol=1e-3)

    def _check(job: Path, tag: str, expected: torch.Tensor) -> None:
        ranks = _ranks(job, tag)
        name = tag.split(".", 1)[1]
        for r in range(1, WORLD):
            assert torch.equal(ranks[r], ranks[0]), f"{tag}: rank {r} differs from rank 0"
        assert not torch.equal(ranks[0], flat_params(make_model(name))), f"{tag}: parameters never moved"
        assert_close(ranks[0], expected, **(LOW_BIT_TOL if name in HIDDEN_OF else {}))

    @pytest.mark.parametrize("name", list(OPTIMIZERS))
    @pytest.mark.parametrize("mode", ["ddp", "ddp-bucket", "zero", "zero-resumed"])
    def test_matches_single_process(job, single, mode, name):
        """Every rank ends with identical parameters, equal to one process over the same global batches."""
        _check(job, f"{mode}.{name}", single[name])

    def test_optimizer_created_before_ddp(job, single):
        """Packing first (p.data re-bound before DDP registers its hooks) works as well."""
        _check(job, "ddp-opt-first.adam", single["adam"])

    def test_zero_plain_load_state_dict(job, single):
        """ZeRO's own load_state_dict assigns zero.optim.state[param]: optimizer.state writes through."""
        name = "adam"
        _check(job, f"zero-resumed-plain.{name}", single[name])

    def test_zero_parameters_as_bucket_view(job, single):
        """ZeRO re-binds every p.data into its bucket, in our order: that bucket becomes the flat buffer."""
        name = "adam"
        _check(job, f"zero-pbv.{name}", single[name])

    @pytest.mark.parametrize("name", list(OPTIMIZERS))
    def test_zero_checkpoint_resumes_in_one_process(job, single, name):
        """The consolidated ZeRO checkpoint loads into a plain optimizer and continues in lockstep."""
        cls, kwargs = OPTIMIZERS[name]
        saved = torch.load(job / f"zero.{name}.ckpt.pt", weights_only=True)
        model = make_model(name)
        model.load_state_dict(saved["model"])
        options = {k: v for k, v in kwargs.items() if k in OPTION_NAMES}  # (options are the optimizer's own)
        opt = cls(model.parameters(), lr=1.0, **options)  # every hyperparameter comes from the checkpoint
        opt.load_state_dict(saved["optimizer"])
        for key, value in kwargs.items():
            assert opt.param_groups[0][key] == value, key
        steps = [int(s["step"]) for s in opt.state_dict()["state"].values()]
        assert steps == [RESUME_AT] * len(list(model.parameters()))
        train_steps(model, opt, global_batches()[RESUME_AT:])
        tol = LOW_BIT_TOL if name in HIDDEN_OF else {}
        assert_close(flat_params(model), _ranks(job, f"zero.{name}")[0], **tol)
        assert_close(flat_params(model), single[name], **tol)

    @pytest.mark.parametrize("name", list(OPTIMIZERS))
    def test_zero_shards_the_state(job, name):
        """Each rank's local optimizer holds a proper part of the parameters, with state for exactly those."""
        n = len(list(make_model(name).parameters()))
        shards = [json.loads((job / f"zero.{name}.shard.rank{r}.json").read_text()) for r in range(WORLD)]
        assert sum(s["params"] for s in shards) == n
        for s in shards:
            assert 0 < s["params"] < n and s["with_state"] == s["params"], shards

    @pytest.mark.parametrize("name", list(OPTIMIZERS))
    def test_zero_checkpoint_holds_every_shard(job, name):
        """The consolidated state dict has a state entry for every parameter (both shards)."""
        saved = torch.load(job / f"zero.{name}.ckpt.pt", weights_only=True)["optimizer"]
        n = len(list(make_model(name).parameters()))
        assert sorted(saved["state"]) == list(range(n))
        cls = OPTIMIZERS[name][0]
        assert {k: saved["dml_optim"][k] for k in ("format_version", "optimizer")} == {"format_version": 1,
                                                                                      "optimizer": cls.__name__}
        bits = OPTIMIZERS[name][1].get("state_bits")
        if bits:
            assert saved["dml_optim"]["quantization"] == "dml-optim-blockwise-3"  # (the active codebook, dml_optim.core.quant.ACTIVE_CODEBOOK)
        quantized = 0
        for entry in saved["state"].values():
            if "exp_avg_codes" in entry:
                quantized += 1
                assert set(entry) == {"step", *(f"{n}{s}" for n in cls.state_names for s in ("_codes", "_absmax"))}
            else:
                assert set(entry) == {"step", *cls.state_names}
        assert quantized == (2 if bits else 0)  # the two weights of 4096 elements or more

    def test_example_runs_in_one_process(tmp_path):
        """examples/ddp_train.py without torchrun (a world of one), ZeRO and a checkpoint included."""
        if _MISSING:
            pytest.skip(_MISSING)
        example = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"
        ckpt = tmp_path / "ckpt.pt"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        run = subprocess.run(
            [sys.executable, str(example), "--zero", "--optimizer", "momentum", "--steps", "60", "--log-every", "30",
             "--save", str(ckpt)],
            env=env, capture_output=True, text=True, timeout=DIST_TIMEOUT_S,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "parameters identical on all ranks: yes" in run.stdout
        accuracy = float(run.stdout.split("held-out accuracy: ")[1].split()[0])
        assert accuracy > 3 * toy.chance_level(), run.stdout
        saved = torch.load(ckpt, weights_only=True)
        assert saved["step"] == 60 and sorted(saved["optimizer"]["state"]) == list(range(6))

    def test_helpers_reject_a_non_zero_optimizer():
        from dml_optim.training.distributed import load_zero_state_dict, zero_state_dict

        opt = dml_optim.Adam(make_model().parameters())
        with pytest.raises(TypeError, match="ZeroRedundancyOptimizer, got Adam"):
            load_zero_state_dict(opt, opt.state_dict())
        with pytest.raises(TypeError, match="ZeroRedundancyOptimizer, got Adam"):
            zero_state_dict(opt)

    @pytest.fixture
    def world_of_one():
        """An in-process gloo group of one rank (a HashStore: no sockets)."""
        if _MISSING:
            pytest.skip(_MISSING)
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
        dist.destroy_process_group()

    def test_load_zero_state_dict_checks_before_writing(world_of_one):
        """A checkpoint of another layout is refused and leaves the shard's state as it was."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from dml_optim.training.distributed import load_zero_state_dict, zero_state_dict

        model = make_model()
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=dml_optim.Adam, lr=1e-2)
        train_steps(model, zero, global_batches(2))
        zero.consolidate_state_dict(to=0)
        good = zero_state_dict(zero)
        before = {k: v.clone() for k, v in good["state"][0].items()}
        bad = dict(good, param_groups=good["param_groups"] * 2)
        with pytest.raises(ValueError, match="2 parameter groups, this ZeroRedundancyOptimizer has 1"):
            load_zero_state_dict(zero, bad)
        wrong_shape = dict(good, state={**good["state"], 0: dict(good["state"][0], exp_avg=torch.zeros(3))})
        with pytest.raises(ValueError, match="exp_avg"):
            load_zero_state_dict(zero, wrong_shape)
        zero.consolidate_state_dict(to=0)
        after = zero_state_dict(zero)["state"][0]
        for key, value in before.items():
            assert torch.equal(after[key], value), key

    def test_load_zero_state_dict_reads_unmarked_and_torch_checkpoints(world_of_one):
        """A bare zero.state_dict() of ours keeps its hyperparameters; a ZeRO(torch.optim.Adam)
        checkpoint loads as a torch.optim one (betas -> alpha, beta; weight_decay -> norm_coefficient)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from dml_optim.training.distributed import load_zero_state_dict

        def zero(cls, **kwargs):
            return ZeroRedundancyOptimizer(make_model().parameters(), optimizer_class=cls, **kwargs)

        ours = zero(dml_optim.Adam, lr=1e-2, alpha=0.7)
        ours.optim.param_groups[0]["params"][0].grad = torch.ones_like(ours.optim.param_groups[0]["params"][0])
        ours.step()
        ours.consolidate_state_dict(to=0)
        bare = ours.state_dict()
        assert "dml_optim" not in bare
        fresh = zero(dml_optim.Adam, lr=1.0)
        load_zero_state_dict(fresh, bare)
        group = fresh.optim.param_groups[0]
        assert (group["lr"], group["alpha"]) == (1e-2, 0.7)
        assert fresh.optim.state_dict()["state"][0]["step"] == 1

        theirs = zero(torch.optim.Adam, lr=1e-2, betas=(0.6, 0.95), weight_decay=1e-3)
        theirs.consolidate_state_dict(to=0)
        fresh = zero(dml_optim.Adam, lr=1.0)
        load_zero_state_dict(fresh, theirs.state_dict())
        group = fresh.optim.param_groups[0]
        assert (group["lr"], group["alpha"], group["beta"], group["norm_coefficient"]) == (1e-2, 0.6, 0.95, 1e-3)


else:  # the worker
    def _main() -> int:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "PORT", "OUTDIR"), required=True)
        rank, world, port, out = parser.parse_args().worker
        torch.set_num_threads(1)
        _worker(int(rank), int(world), int(port), Path(out))
        return 0

    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads at exit have aborted a worker
    # ("terminate called without an active exception", exit -6) after all its work was done.
    os._exit(code)
