"""Kill and resume: a run killed in the middle of a save, resumed in new processes.

Usage: python resume_checks.py first|resume WORLD OUT_DIR

``first`` trains SAC (a loss that draws random numbers) for SAVE_AT updates, saves, trains on to
STEPS and records the uninterrupted result; then it saves again and dies half-way through that
save. ``resume`` starts from other weights and another seed, loads the checkpoint (which must be
the complete first save) and trains the remaining updates. WORLD 1 runs LocalLearner, killed with
half its file written; WORLD 2 runs a DDP and an FSDP learner on 2 gloo ranks, each fed half a
batch, the FSDP save killed while rank 1 writes its shards; once its results are written,
``resume`` on 2 ranks saves the DDP learner again and dies with half the file written on rank 0.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy
from rl_cases import CLIP, LR, halves, make_batch, make_loss

from fabric_learner import FabricLearner, LocalLearner

SAVE_AT, STEPS = 2, 4
real_torch_save = torch.save
TIMEOUT = timedelta(seconds=90)


def build(kind, seed):
    loss, _ = make_loss("sac", seed=seed)
    opt = functools.partial(torch.optim.Adam, lr=LR)
    if kind == "local":
        return LocalLearner(loss, opt, clip_grad_norm=CLIP)
    strategy = DDPStrategy(timeout=TIMEOUT) if kind == "ddp" else "fsdp"
    return FabricLearner(loss, opt, clip_grad_norm=CLIP, accelerator="cpu", devices=2, strategy=strategy,
                         timeout=TIMEOUT)


def train(learner, steps, world):
    norms = []
    for step in steps:
        batch = make_batch("sac", n=16, seed=100 + step)
        norms.append(learner.update(halves(batch, learner.global_rank) if world > 1 else batch)["grad_norm"])
    return {"model": learner.checkpoint()["model"], "grad_norm": torch.stack(norms),
            "num_updates": learner.num_updates, "rng_after": torch.get_rng_state()}


def die_mid_save(kind, rank):
    """Make the next save of a ``kind`` learner kill this process half-way: with half the file
    written on rank 0 (one file: local, ddp), or while rank 1 writes its shards (fsdp)."""
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if kind != "fsdp" and rank == 0:
        real_save = torch.save

        def half_then_die(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            os.fsync(f.fileno())
            die()

        torch.save = half_then_die
    elif kind == "fsdp" and rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        fs.FileSystemWriter.write_data = die


def main(mode, world, out_dir):
    kinds = ["local"] if world == 1 else ["ddp", "fsdp"]
    rank, learners = 0, {}
    for kind in kinds:
        path = os.path.join(out_dir, f"{kind}.ckpt")
        if mode == "first":
            learner = build(kind, seed=3)
            rank = learner.global_rank
            torch.manual_seed(1234 + rank)
            train(learner, range(SAVE_AT), world)
            learner.save(path)
            result = train(learner, range(SAVE_AT, STEPS), world)
        else:
            learner = build(kind, seed=77)
            rank = learner.global_rank
            torch.manual_seed(999 + rank)
            learner.load(path)
            result = train(learner, range(SAVE_AT, STEPS), world)
        torch.save(result, os.path.join(out_dir, f"{kind}_{mode}_rank{rank}.pt"))
        if mode == "resume" and kind == "fsdp":
            learner.save(path)  # the next save: it must remove the version folder the kill left
        learners[kind] = learner
        if world > 1:
            learner.fabric.barrier()
    # the crash: no exit hook, no teardown; the rank that survives fails when its peer is gone.
    # ``first`` kills the last learner's save; on 2 ranks ``resume`` then kills DDP's save too.
    crash = kinds[-1] if mode == "first" else "ddp" if world > 1 else None
    if crash is not None:
        torch.save = real_torch_save
        die_mid_save(crash, rank)
        learners[crash].save(os.path.join(out_dir, f"{crash}.ckpt"))
        print(f"rank {rank}: the save was not interrupted", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
