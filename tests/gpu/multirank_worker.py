"""One rank of the tier's multi-rank check, under torchrun: ``python multirank_worker.py STRATEGY ACCELERATOR OUT``.

Each of 2 ranks trains PPO on its half of every batch (``rl_cases``'s schedule, SGD) under ``strategy``
("ddp" or "fsdp", one FSDP2 unit per layer); rank 0 writes the full weights and whether the ranks agree.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_cases import STEPS, flat_params, halves, make_batch, make_loss

from fabric_learner import FabricLearner, shard_loss

LR = 1e-2


def main(strategy: str, accelerator: str, out: str) -> None:
    if accelerator == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=functools.partial(shard_loss, min_unit_numel=1))
    learner = FabricLearner(make_loss("ppo")[0], functools.partial(torch.optim.SGD, lr=LR), strategy=strategy,
                            accelerator=accelerator, devices=2, timeout=120)
    rank = learner.global_rank
    for step in range(STEPS):
        torch.manual_seed(1000 * step)
        learner.update(halves(make_batch("ppo", n=16, seed=100 + step), rank, 2))
    with learner.full_parameters():
        params = flat_params(learner.loss_module)
    flat = torch.cat([v.flatten() for v in params.values()]).to(learner.fabric.device)
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        torch.save({"params": params, "ranks_agree": bool(torch.equal(gathered[0], gathered[1]))}, out)
    learner.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
