"""Data-parallel training with dml_optim under torch.distributed (DDP, optionally ZeRO).

Trains the built-in toy classifier (:mod:`dml_optim.job.toy`) with
``DistributedDataParallel``.  Every rank draws the same shuffled order of the
training set; each global batch is split across ranks like
``DistributedSampler`` does (rank ``r`` takes rows ``r::world_size``), and DDP
averages the gradients, so N processes follow the same trajectory as one
process on the whole global batch.  Rank 0 prints progress and the final
held-out accuracy.

Run (CPU, gloo; DirectML has no collective backend)::

    torchrun --nproc_per_node 2 examples/ddp_train.py
    torchrun --nproc_per_node 2 examples/ddp_train.py --optimizer momentum --zero --steps 300
    torchrun --nproc_per_node 2 examples/ddp_train.py --zero --steps 200 --save ckpt.pt
    torchrun --nproc_per_node 2 examples/ddp_train.py --zero --resume ckpt.pt --steps 400
    torchrun --nproc_per_node 2 examples/ddp_train.py --bucket-view
    python examples/ddp_train.py            # one process, no torchrun needed

(``python -m torch.distributed.run`` is the same as ``torchrun``.)  With
``--device cuda`` each rank uses GPU ``LOCAL_RANK`` and the NCCL backend.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dml_optim
from dml_optim.job import toy
from dml_optim.training.distributed import load_zero_state_dict, zero_state_dict

#: --optimizer name -> (class, keyword arguments).
OPTIMIZERS = {
    "adam": (dml_optim.Adam, dict(lr=3e-3)),
    "dml-adam": (dml_optim.DmlAdam, dict(lr=3e-3)),
    "adagrad": (dml_optim.Adagrad, dict(lr=5e-2)),
    "momentum": (dml_optim.Momentum, dict(lr=5e-2, alpha=0.9)),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the dml_optim toy model with DistributedDataParallel (and optionally ZeRO).",
        epilog=__doc__.split("Run (", 1)[1].split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    parser.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch size, split across ranks (default: 256)")
    parser.add_argument("--zero", action="store_true", help="shard optimizer state with ZeroRedundancyOptimizer")
    parser.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    parser.add_argument("--seed", type=int, default=0, help="data and model seed (default: 0)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu uses gloo, cuda uses nccl")
    parser.add_argument("--save", metavar="PATH", help="rank 0 saves model and (consolidated) optimizer state at the end")
    parser.add_argument("--resume", metavar="PATH", help="start from a checkpoint written by --save")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be a positive integer, got {getattr(args, name)}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr: must be positive, got {args.lr}")
    return args


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes, or make a one-process group."""
    if "RANK" not in os.environ:  # plain `python ddp_train.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available in this torch build/machine")
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def batches(x, y, *, batch_size: int, steps: int, seed: int, start: int = 0):
    """Global batches ``start .. steps-1``: epochs of one shared seeded shuffle order each."""
    per_epoch = x.shape[0] // batch_size
    order = None
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        if i == 0 or order is None:
            order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        if step < start:
            continue
        idx = order[i * batch_size:(i + 1) * batch_size]
        yield step, x[idx], y[idx]


def make_optimizer(model, args):
    cls, kwargs = OPTIMIZERS[args.optimizer]
    if args.lr is not None:
        kwargs = dict(kwargs, lr=args.lr)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def same_on_all_ranks(model) -> bool:
    """Whether every rank holds bit-identical parameters (one all_gather of a checksum)."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    mine = torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)).sum()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(e, every[0]) for e in every)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    try:
        if args.batch_size % world:
            raise SystemExit(f"--batch-size: {args.batch_size} is not divisible by the world size {world}")
        log = print if rank == 0 else (lambda *a, **k: None)
        x, y, x_test, y_test = toy.make_dataset(args.seed, device=device)
        model = toy.make_model(args.seed, device=device)
        start = 0
        saved = None
        if args.resume:
            saved = torch.load(args.resume, map_location=device, weights_only=True)
            model.load_state_dict(saved["model"])
            start = int(saved["step"])
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=args.bucket_view)
        opt = make_optimizer(ddp, args)
        if saved is not None:
            if args.zero:
                load_zero_state_dict(opt, saved["optimizer"])  # not opt.load_state_dict: see docs/distributed.md
            else:
                opt.load_state_dict(saved["optimizer"])
        log(f"{world} process(es), {dist.get_backend()} on {device}, {type(opt).__name__}"
            f"{'(' + args.optimizer + ')' if args.zero else ''}, global batch {args.batch_size} "
            f"({args.batch_size // world} per rank), gradient_as_bucket_view={args.bucket_view}")
        t0 = time.perf_counter()
        running = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, count
        for step, xb, yb in batches(x, y, batch_size=args.batch_size, steps=args.steps, seed=args.seed, start=start):
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xb[rank::world]), yb[rank::world])
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                dist.all_reduce(running)  # mean over ranks and steps since the last line
                log(f"step {step + 1:5d}/{args.steps}  loss {running[0].item() / running[1].item():.4f}  "
                    f"{time.perf_counter() - t0:6.1f} s")
                running.zero_()
        identical = same_on_all_ranks(model)
        log(f"parameters identical on all ranks: {'yes' if identical else 'NO'}")
        log(f"held-out accuracy: {toy.accuracy(model, x_test, y_test):.4f} (chance {toy.chance_level():.2f})")
        if args.save:
            if args.zero:
                opt.consolidate_state_dict(to=0)  # a collective: every rank calls it
            if rank == 0:
                state = zero_state_dict(opt) if args.zero else opt.state_dict()
                torch.save({"model": model.state_dict(), "optimizer": state, "step": max(args.steps, start)}, args.save)
                log(f"saved {args.save}")
        dist.barrier()  # rank 0 hosts the rendezvous store: leave together
        return 0 if identical else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
