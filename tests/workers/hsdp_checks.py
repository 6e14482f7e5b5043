"""HSDP (examples/ppo_hsdp.py) on 2 "nodes" of 2 ranks, each node started by its own torchrun.

Usage: torchrun --nnodes=2 --node-rank=N --nproc-per-node=2 ... hsdp_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt: one SGD step on this rank's quarter of the batch, and what the mesh looks like.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import torch
import torch.distributed as dist
from lightning.fabric.strategies import ModelParallelStrategy
from ppo_hsdp import hsdp
from ppo_tensor_parallel import make_batch, make_loss

from fabric_learner import FabricLearner
from fabric_learner.collectives import distributed_world_size, global_count

N = 4  # samples per rank


def main(out_dir):
    learner = FabricLearner(make_loss()[0], functools.partial(torch.optim.SGD, lr=0.1), accelerator="cpu", devices=2,
                            num_nodes=2, strategy=ModelParallelStrategy(hsdp))
    rank = learner.global_rank
    out = learner.update(make_batch(4 * N, seed=0)[rank * N:(rank + 1) * N])
    params = {n: (tuple(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements], p.device_mesh.mesh.tolist())
              for n, p in learner.sharded_module.named_loss_parameters()}
    res = {"weights": dict(learner.get_weights(cpu_offload=False).items(True, True)), "params": params,
           "grad_norm": out["grad_norm"], "dp_size": distributed_world_size(), "count": global_count(1).item()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
