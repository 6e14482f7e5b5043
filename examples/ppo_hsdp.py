"""PPO with HSDP: parameters replicated across nodes and sharded within each node (FSDP2 on a 2-D mesh).

Every rank feeds its own batch (all ranks are data-parallel); gradients are reduce-scattered within a
node and all-reduced across nodes, so the slower inter-node link carries one shard per rank instead
of all parameters. The partition rule is this file's ``hsdp``: ``fully_shard`` over a
``("replicate", "shard")`` mesh of (nodes, ranks per node). The learner sees no tensor-parallel
dimension on the parameters, so its counts and means reduce over every rank.

Run two "nodes" of 2 CPU ranks on one machine (one command per node)::

    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=29512 \\
        examples/ppo_hsdp.py
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=29512 \\
        examples/ppo_hsdp.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ppo_tensor_parallel import make_batch, make_loss

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter
from fabric_learner.sharding import apply_fsdp


def hsdp(module: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn``: each layer replicated across nodes, sharded within one.

    Lightning's mesh has one row per node (``data_parallel`` = nodes, ``tensor_parallel`` = ranks per
    node with its automatic sizes); the same layout, named for HSDP, is what ``fully_shard`` needs.
    """
    hsdp_mesh = init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=("replicate", "shard"))
    return apply_fsdp(module, hsdp_mesh, min_unit_numel=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--updates", type=int, default=5, help="optimizer updates")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and update")
    args = parser.parse_args()
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", 2)))
    learner = FabricLearner(make_loss()[0], functools.partial(torch.optim.Adam, lr=1e-3), accelerator="cpu",
                            devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)), num_nodes=nodes,
                            strategy=ModelParallelStrategy(hsdp))
    for step in range(args.updates):
        out = learner.update(make_batch(args.batch, seed=1000 * step + learner.global_rank))
    if learner.global_rank == 0:
        print(f"done: {learner.world_size} ranks, {args.updates} updates, loss_objective "
              f"{out['loss_objective'].item():.4f}")
    learner.close()


if __name__ == "__main__":
    main()
