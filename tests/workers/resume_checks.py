"""Kill and resume: a run SIGKILLed after a checkpoint, resumed in new processes.

Usage: python resume_checks.py first|resume WORLD OUT_DIR

``first`` trains SAC (a loss that draws random numbers) for SAVE_AT updates, saves, trains on to
STEPS and records the uninterrupted result; then every rank SIGKILLs itself. ``resume`` starts
from other weights and another seed, loads the checkpoint and trains the remaining updates. WORLD
1 runs LocalLearner; WORLD 2 runs DDP and FSDP learners on 2 gloo ranks, each fed half a batch.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402
from rl_cases import CLIP, LR, halves, make_batch, make_loss  # noqa: E402

from fabric_learner import FabricLearner, LocalLearner  # noqa: E402

SAVE_AT, STEPS = 2, 4
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


def main(mode, world, out_dir):
    kinds = ["local"] if world == 1 else ["ddp", "fsdp"]
    rank = 0
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
        if world > 1:
            learner.fabric.barrier()
    if mode == "first":  # the crash: no exit hook, no teardown, on every rank
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
