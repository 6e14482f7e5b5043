"""Asynchronous collection on 2 ranks, rank 1's environment much slower; DDP then FSDP in one launch.

Usage: python async_checks.py OUT_DIR            writes OUT_DIR/rank{r}.pt (tests/test_async.py)
       python async_checks.py OUT_DIR stops      rank 1 ends its program mid-training; rank 0 must fail, naming itself
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import async_common as ac
import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss

WORLD = 2
SLOW = 0.1  # seconds per step on rank 1: a 24-frame batch takes 0.6 s there, a few ms on rank 0
LAG = 3  # = optim steps per batch: frames one round old are admitted, older ones dropped
TOTAL = 16 * ac.FRAMES_PER_BATCH
LEARNERS = []


def factory(strategy, timeout=60):
    def make(loss, optimizer, policy):
        if strategy == "ddp":
            s = DDPStrategy(timeout=timedelta(seconds=timeout))
        else:
            s = ModelParallelStrategy(parallelize_fn=shard_loss, timeout=timedelta(seconds=timeout))
        learner = FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=WORLD,
                                strategy=s)
        LEARNERS.append(learner)
        return learner
    return make


def delay_for(rank: int) -> float:
    return SLOW if rank == 1 else 0.0


def summary(trainer, learner, admissions, rb) -> dict:
    ckpt = learner.checkpoint()  # full weights on every rank, also when sharded (a collective)
    return {"params": {k: v.detach().clone() for k, v in ckpt["model"].items()},
            "num_updates": learner.num_updates, "optim_count": trainer._optim_count,
            "collected_frames": trainer.collected_frames, "stats": trainer.async_stats,
            "hook_frames": admissions.frames, "hook_max_lag": admissions.max_lag, "hook_batches": admissions.batches,
            "rb_len": len(rb)}


def in_step(strategy: str, rank: int) -> dict:
    """Rank 1 much slower: both ranks take the same updates; stale frames are dropped and counted."""
    t0 = time.time()
    built = ac.build(factory(strategy), total_frames=TOTAL, delay=delay_for(rank), max_policy_lag=LAG)
    built[0].train()
    return {**summary(*built), "seconds": time.time() - t0}


def resume(out_dir: str, rank: int) -> dict:
    """B trains half-way and saves; C, freshly built, loads B's folder and trains on to the end."""
    ckpt = os.path.join(out_dir, "async_ckpt")
    b = ac.build(factory("ddp"), total_frames=TOTAL // 2, delay=delay_for(rank), max_policy_lag=LAG, save_file=ckpt)
    b[0].train()
    res = {"B": summary(*b), "files": sorted(os.listdir(ckpt))}
    res["rank_file_async"] = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=False).get("async")
    c = ac.build(factory("ddp"), total_frames=TOTAL, delay=delay_for(rank), max_policy_lag=LAG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c[0].load_from_file(ckpt)
    res["warnings"] = [str(w.message) for w in caught]
    res["C_loaded"] = {"num_updates": c[1].num_updates, "collected_frames": c[0].collected_frames,
                       "params": {k: v.clone() for k, v in c[1].checkpoint()["model"].items()}, "rb_len": len(c[3])}
    c[0].train()
    res["C"] = summary(*c)
    return res


def stops(rank: int) -> None:
    """Rank 1 ends its program after its third round (its collector shut down first, so no process
    outlives it); rank 0 must fail in the next round's collective, naming itself and the round."""
    trainer, learner, _, _ = ac.build(factory("ddp"), total_frames=10**6, delay=delay_for(rank))

    def leave():
        if rank == 1 and trainer.async_stats["rounds"] >= 3:
            print("rank 1 ends its program", flush=True)
            trainer.collector.shutdown()
            os._exit(0)
    trainer.register_op("post_steps", leave)
    trainer.train()


def main(out_dir: str, scenario: str | None = None) -> None:
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    if scenario == "stops":
        stops(rank)
        return
    t0 = time.time()
    res = {"ddp": in_step("ddp", rank)}
    res["fsdp"] = in_step("fsdp", rank)
    res["resume"] = resume(out_dir, rank)
    res["rank"], res["world_size"] = LEARNERS[0].global_rank, LEARNERS[0].world_size
    res["seconds"] = time.time() - t0
    torch.save(res, os.path.join(out_dir, f"rank{res['rank']}.pt"))
    for each in LEARNERS:
        each.close()


if __name__ == "__main__":
    # The collectors' environment processes by fork: torchrl's default, spawn, imports torch and
    # torchrl again in each (seconds per collector on 2 shared cores); what is tested does not depend on it.
    import multiprocessing

    if os.environ.get("FL_SPAWN") != "1":
        multiprocessing.set_start_method("fork", force=True)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
