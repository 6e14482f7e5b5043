"""Trainer checks on 2 ranks, DDP then FSDP, in one launch (forked from
tests/zygote.py; plain ``python`` runs it too).

Usage: python trainer_ddp.py OUT_DIR
Writes OUT_DIR/rank{r}.pt with what tests/test_trainer.py compares.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import functools

import torch
import trainer_common as tc
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss
from fabric_learner.onpolicy import EpochPartitionSampler, normalize_advantage
from fabric_learner.weights import publish_from_rank0

WORLD = 2


TIMEOUT = timedelta(seconds=60)


LEARNERS = []  # every learner built, closed in order on every rank at the end


def ddp(loss, optimizer, policy, **kwargs):
    learner = FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=WORLD,
                            strategy=DDPStrategy(timeout=TIMEOUT), **kwargs)
    LEARNERS.append(learner)
    return learner


def fsdp(loss, optimizer, policy, **kwargs):
    learner = FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=WORLD,
                            strategy=ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT), **kwargs)
    LEARNERS.append(learner)
    return learner


def dqn_runs(out_dir, make, name, own_policy_copy=False):
    """Uninterrupted run A; run B stops halfway and checkpoints; run C resumes B into a fresh trainer."""
    total = 6 * tc.FRAMES_PER_BATCH * WORLD
    record = []
    kw = {"own_policy_copy": own_policy_copy}
    a = tc.build_dqn(make, total_frames=total, record=record, logger=tc.RecordingLogger(), progress_bar=True, **kw)
    seeded = torch.initial_seed()  # what Trainer(seed=0) seeded this rank's torch with
    outputs = tc.record_update_outputs(a[0], a[1])
    a[0].train()
    res = {"A": tc.snapshot(*a), "last_minibatch": record[-1], "record_len": len(record),
           "sharded": a[1].capabilities.sharded, "seeded": seeded, "A_update_outputs": outputs}
    ckpt = os.path.join(out_dir, f"trainer_ckpt_{name}")
    b = tc.build_dqn(make, total_frames=total // 2, save_file=ckpt, **kw)
    b[0].train()
    res["B"] = tc.snapshot(*b)
    c = tc.build_dqn(make, total_frames=total, **kw)
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
    for name, make, strategy in (("global", tc.make_global_ppo, ddp), ("naive", tc.make_naive_ppo, ddp),
                                 ("global_fsdp", tc.make_global_ppo, fsdp)):
        loss, actor = make()
        learner = strategy(loss, functools.partial(torch.optim.Adam, lr=1e-2), actor)
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
                if name.startswith("global"):
                    normalize_advantage(mb, mask_key="valid")
                norms.append(learner.update(mb)["grad_norm"])
        out[name] = {"params": {k: v for k, v in learner.checkpoint()["model"].items()
                                if k in dict(loss.named_parameters())},
                     "grad_norm": torch.stack(norms), "num_updates": learner.num_updates}
    return out


def stops(rank):
    """A stop requested on rank 1 only, and a collector that runs dry on rank 1 only, end both ranks."""
    out = {}
    trainer = tc.build_dqn(ddp, total_frames=10**6)[0]

    def request(batch):
        if rank == 1 and trainer.collected_frames >= 2 * tc.FRAMES_PER_BATCH * WORLD:
            trainer.request_stop("rank 1 had enough")

    trainer.register_op("post_steps_log", request)
    trainer.train()
    out["request_stop"] = trainer.collected_frames
    trainer = tc.build_dqn(ddp, total_frames=10**6)[0]
    if rank == 1:  # this rank's collector yields 3 batches, the other's never ends
        trainer.collector.total_frames = 3 * tc.FRAMES_PER_BATCH
    trainer.train()
    out["collector_dry"] = trainer.collected_frames
    return out


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, weights):  # the WeightSyncScheme sender-side call
        self.sent.append(weights.clone())


def resized(make):
    """The one-process trainer fixture (tests/fixtures/checkpoints/trainer) resumed on 2 ranks, then trained on."""
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoints", "trainer")
    # a warm-up of one batch per rank: 2 batches over both ranks, which the fixture's run (48 frames) took
    trainer, learner, _, _, rb, collector = tc.build_dqn(make, total_frames=4 * tc.FRAMES_PER_BATCH * WORLD,
                                                         init_random_frames=tc.FRAMES_PER_BATCH)
    acted = tc.policy_frames(collector)
    trainer.load_from_file(fixture)
    out = {"rb_obs": rb[: len(rb)]["observation"].clone(), "rb_len": len(rb),
           "priorities": rb._sampler._sum_tree.values[: len(rb)].clone(),
           "collected_frames": trainer.collected_frames, "num_updates": learner.num_updates,
           "optim_count": trainer._optim_count}
    trainer.train()
    out["after"] = {"collected_frames": trainer.collected_frames, "num_updates": learner.num_updates,
                    "params": {k: v for k, v in learner.checkpoint()["model"].items()}, "policy_frames": sum(acted)}
    return out


def main(out_dir):
    t0 = time.time()
    res, learner = dqn_runs(out_dir, ddp, "ddp")
    res["fsdp"], sharded = dqn_runs(out_dir, fsdp, "fsdp")  # the same program: only the strategy differs
    rank = learner.global_rank
    res["rank"], res["world_size"] = rank, learner.world_size
    res["equivalence"] = equivalence(rank)
    for name, which in (("published", learner), ("published_fsdp", sharded)):
        rec = Recorder()
        returned = publish_from_rank0(which, rec)  # a collective under FSDP
        res[name] = {"sent": rec.sent, "returned_none": returned is None,
                     "weights": which.get_weights(cpu_offload=False)}
    res["stops"] = stops(rank)
    res["resized"] = {"ddp": resized(ddp), "fsdp": resized(fsdp)}
    res["seconds"] = time.time() - t0
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    for each in LEARNERS:
        each.close()


if __name__ == "__main__":
    main(sys.argv[1])
