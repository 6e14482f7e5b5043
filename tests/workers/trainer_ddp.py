"""Trainer checks on 2 DDP ranks in one launch (plain ``python``: the learner starts rank 1 itself).

Usage: python trainer_ddp.py OUT_DIR
Writes OUT_DIR/rank{r}.pt with what tests/test_trainer.py compares.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import trainer_common as tc  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

from fabric_learner import FabricLearner  # noqa: E402
from fabric_learner.onpolicy import EpochPartitionSampler, normalize_advantage  # noqa: E402
from fabric_learner.weights import publish_from_rank0  # noqa: E402

WORLD = 2


def ddp(loss, optimizer, policy, **kwargs):
    return FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=WORLD,
                         strategy=DDPStrategy(timeout=timedelta(seconds=60)), **kwargs)


def dqn_runs(out_dir):
    """Uninterrupted run A; run B stops halfway and checkpoints; run C resumes B into a fresh trainer."""
    total = 6 * tc.FRAMES_PER_BATCH * WORLD
    record = []
    a = tc.build_dqn(ddp, total_frames=total, record=record)
    a[0].train()
    res = {"A": tc.snapshot(*a), "last_minibatch": record[-1], "record_len": len(record)}
    ckpt = os.path.join(out_dir, "trainer_ckpt")
    b = tc.build_dqn(ddp, total_frames=total // 2, save_file=ckpt)
    b[0].train()
    res["B"] = tc.snapshot(*b)
    c = tc.build_dqn(ddp, total_frames=total)
    c[0].load_from_file(ckpt)
    res["C_loaded"] = {"num_updates": c[1].num_updates, "collected_frames": c[0].collected_frames,
                       "optim_count": c[0]._optim_count}
    c[0].train()
    res["C"] = tc.snapshot(*c)
    res["ckpt_files"] = sorted(os.listdir(ckpt))
    return res, c[1]


def equivalence(rank):
    """Global normalisation, global masked means, partitions: rank r trains on half r of the batch."""
    out = {}
    for name, make in (("global", tc.make_global_ppo), ("naive", tc.make_naive_ppo)):
        loss, actor = make()
        learner = ddp(loss, torch.optim.Adam(loss.parameters(), lr=1e-2), actor)
        half = tc.equivalence_batch()[rank * tc.EQ_N // 2:(rank + 1) * tc.EQ_N // 2]
        sampler = EpochPartitionSampler(tc.EQ_MINIBATCH, seed=tc.EQ_SEED)
        norms = []
        for _ in range(tc.EQ_EPOCHS):
            sampler.start_epoch(half)
            while True:
                try:
                    mb = sampler(half)
                except StopIteration:
                    break
                mb = mb.clone()
                if name == "global":
                    normalize_advantage(mb, mask_key="valid")
                norms.append(learner.update(mb)["grad_norm"])
        out[name] = {"params": {k: v.detach().clone() for k, v in loss.named_parameters()},
                     "grad_norm": torch.stack(norms), "num_updates": learner.num_updates}
    return out


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, weights):  # the WeightSyncScheme sender-side call
        self.sent.append(weights.clone())


def main(out_dir):
    t0 = time.time()
    res, learner = dqn_runs(out_dir)
    rank = learner.global_rank
    res["rank"], res["world_size"] = rank, learner.world_size
    res["equivalence"] = equivalence(rank)
    rec = Recorder()
    returned = publish_from_rank0(learner, rec)
    res["published"] = {"sent": rec.sent, "returned_none": returned is None, "weights": learner.get_weights()}
    res["seconds"] = time.time() - t0
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    if hasattr(learner, "close"):
        learner.close()
    else:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
