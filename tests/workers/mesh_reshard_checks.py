"""The 2 x 2 mesh's checkpoint (written by mesh_checks.py) on 2 ranks: FSDP2 and DDP, in one 2-rank launch.

Usage: python mesh_reshard_checks.py MESH_OUT_DIR OUT_DIR
Writes OUT_DIR/rank{r}.pt: the full weights after loading the mesh's folder and one momentum-SGD step on
this rank's half of the step's global batch, under each strategy; and each learner's save
(OUT_DIR/fsdp2, a DCP folder; OUT_DIR/ddp2.pt), which mesh_trainer_checks.py loads into the mesh.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mesh_checks
import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss

TIMEOUT = timedelta(seconds=60)


def main(mesh_dir, out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    res = {}
    strategies = {"fsdp2": ModelParallelStrategy(functools.partial(shard_loss, min_unit_numel=1), timeout=TIMEOUT),
                  "ddp2": DDPStrategy(timeout=TIMEOUT)}
    for name, strategy in strategies.items():
        learner = FabricLearner(mesh_checks.make_loss(seed=3)[0], mesh_checks.momentum(), accelerator="cpu",
                                devices=2, strategy=strategy)
        learner.load(os.path.join(mesh_dir, "mesh"))
        learner.update(mesh_checks.whole(30)[rank * mesh_checks.N:(rank + 1) * mesh_checks.N])
        res[name] = mesh_checks.weights(learner)
        learner.save(os.path.join(out_dir, name if name == "fsdp2" else f"{name}.pt"))  # mesh_trainer_checks.py loads them
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
