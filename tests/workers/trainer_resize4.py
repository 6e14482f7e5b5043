"""A 2-rank Trainer checkpoint resumed on 4 ranks, DDP then FSDP, in one launch.

Usage: python trainer_resize4.py CKPT_DIR OUT_DIR
CKPT_DIR holds ``trainer_ckpt_ddp`` and ``trainer_ckpt_fsdp`` (run B of trainer_ddp.py, 2 ranks).
Writes OUT_DIR/rank{r}.pt with each rank's replay share, counters and weights after the load,
and its weights after training on.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import torch
import trainer_common as tc
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss

WORLD = 4
TIMEOUT = timedelta(seconds=120)
LEARNERS = []


def make(strategy):
    def build(loss, optimizer, policy):
        learner = FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu",
                                devices=WORLD, strategy=strategy())
        LEARNERS.append(learner)
        return learner
    return build


STRATEGIES = {"ddp": lambda: DDPStrategy(timeout=TIMEOUT),
              "fsdp": lambda: ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)}


def resumed(name, ckpt):
    # run B saved after 3 batches of 2 ranks; 2 more batches of 4 ranks follow
    total = 3 * tc.FRAMES_PER_BATCH * 2 + 2 * tc.FRAMES_PER_BATCH * WORLD
    trainer, learner, _, _, rb, _ = tc.build_dqn(make(STRATEGIES[name]), total_frames=total, resume=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.load_from_file(ckpt)
    out = {"rb_obs": rb[: len(rb)]["observation"].clone(), "rb_len": len(rb),
           "priorities": rb._sampler._sum_tree.values[: len(rb)].clone(),
           "collected_frames": trainer.collected_frames, "num_updates": learner.num_updates,
           "warnings": [str(w.message) for w in caught if "rank" in str(w.message)],
           "params": dict(learner.checkpoint()["model"])}
    trainer.train()
    out["after"] = {"collected_frames": trainer.collected_frames, "num_updates": learner.num_updates,
                    "params": dict(learner.checkpoint()["model"])}
    return out, learner


def main(ckpt_dir, out_dir):
    res = {}
    for name in ("ddp", "fsdp"):
        res[name], learner = resumed(name, os.path.join(ckpt_dir, f"trainer_ckpt_{name}"))
    res["rank"], res["world_size"] = learner.global_rank, learner.world_size
    torch.save(res, os.path.join(out_dir, f"rank{learner.global_rank}.pt"))
    for each in LEARNERS:
        each.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
