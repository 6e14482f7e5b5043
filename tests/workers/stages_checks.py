"""Several optimizers (stages) on 2 ranks under DDP and FSDP, in one launch (forked from tests/zygote.py;
plain ``python`` runs it too).

Usage: python stages_checks.py OUT_DIR   -> OUT_DIR/rank{r}.pt, compared by tests/test_stages.py
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from rl_cases import halves, make_batch, make_loss
from test_stages import STAGES

from fabric_learner import FabricLearner, LocalLearner, shard_loss

TIMEOUT = timedelta(seconds=90)
STEPS = 6


def strategy(name):
    return DDPStrategy(timeout=TIMEOUT) if name == "ddp" else \
        ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)


def run(name, case, stages, rank, out_dir):
    learner = FabricLearner(make_loss(case)[0], stages=STAGES[stages](), accelerator="cpu", devices=2,
                            strategy=strategy(name))
    norms = []
    for step in range(STEPS):
        torch.manual_seed(step)  # the same draws on both ranks, as in the one-process reference
        out = learner.update(halves(make_batch(case, n=16, seed=800 + step), rank))
        norms.append({k: out[k] for k in out.keys() if str(k).startswith("grad_norm")})
        if step == 2:  # a checkpoint mid-run, reloaded into a fresh learner that carries on
            path = os.path.join(out_dir, f"{name}_{stages}" + ("" if name == "fsdp" else ".pt"))
            learner.save(path)
            fresh = FabricLearner(make_loss(case, seed=5)[0], stages=STAGES[stages](), accelerator="cpu", devices=2,
                                  strategy=strategy(name))
            fresh.load(path)
            learner = fresh
    return {"model": learner.checkpoint()["model"], "norms": norms, "num_updates": learner.num_updates}


def reshard(rank, out_dir):
    """SAC's three stages (the scalar temperature among them) through checkpoints of each kind: FSDP 2 ranks
    -> DDP 2 ranks -> FSDP 2 ranks, and one process -> FSDP 2 ranks -> FSDP 2 ranks. Every state as
    ``checkpoint()`` reads it just after a save or load, for tests/test_stages.py to compare."""
    def build(name, seed):
        return FabricLearner(make_loss("sac", seed=seed)[0], stages=STAGES["sac_stages"](), accelerator="cpu",
                             devices=2, strategy=strategy(name))

    def step(learner, s):
        torch.manual_seed(s)
        learner.update(halves(make_batch("sac", n=16, seed=900 + s), rank))

    def state(learner):
        full = learner.checkpoint()
        return {k: full[k] for k in ("model", "optimizer", "num_updates")}

    out, path = {}, functools.partial(os.path.join, out_dir)
    a = build("fsdp", 0)
    for s in range(2):
        step(a, s)
    a.save(path("staged_fsdp"))
    out["fsdp_saved"] = state(a)
    b = build("ddp", 5)
    b.load(path("staged_fsdp"))
    out["ddp_loaded"] = state(b)
    step(b, 2)
    b.save(path("staged_ddp.pt"))
    out["ddp_saved"] = state(b)
    c = build("fsdp", 6)
    c.load(path("staged_ddp.pt"))
    out["fsdp_loaded"] = state(c)
    if rank == 0:
        local = LocalLearner(make_loss("sac", seed=7)[0], stages=STAGES["sac_stages"]())
        torch.manual_seed(0)
        local.update(make_batch("sac", n=16, seed=950))
        local.save(path("staged_local.pt"))
    torch.distributed.barrier()
    d = build("fsdp", 8)
    d.load(path("staged_local.pt"))
    out["fsdp_from_local"] = state(d)
    step(d, 3)
    d.save(path("staged_fsdp_again"))
    out["fsdp_again_saved"] = state(d)
    e = build("fsdp", 9)
    e.load(path("staged_fsdp_again"))  # the folder of a learner that had loaded a file
    out["fsdp_again_loaded"] = state(e)
    return out


def target_updater(rank):
    """A SoftUpdate built right after the learner, as the README's Trainer example builds it, stepped after
    each update; then a second one built once the learner has trained."""
    from torchrl.objectives import SoftUpdate

    out = {}
    for name in ("ddp", "fsdp"):
        loss = make_loss("ddpg")[0]
        learner = FabricLearner(loss, stages=STAGES["ddpg_stages"](), accelerator="cpu", devices=2,
                                strategy=strategy(name))
        updater = SoftUpdate(loss, tau=0.5)
        for step in range(3):
            torch.manual_seed(step)
            learner.update(halves(make_batch("ddpg", n=16, seed=700 + step), rank))
            with learner.full_parameters():
                updater.step()
        out[name] = learner.checkpoint()["model"]
        try:
            SoftUpdate(loss, tau=0.5)
            out[name + "_late"] = None
        except RuntimeError as err:
            out[name + "_late"] = str(err)
    return out


def main(out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    for name in ("ddp", "fsdp"):
        for case, stages in (("ddpg", "ddpg_stages"), ("ddpg", "ddpg_method_stages"), ("td3", "td3_stages"),
                             ("sac", "sac_stages")):
            results[(name, stages)] = run(name, case, stages, rank, out_dir)
    results["reshard"] = reshard(rank, out_dir)
    results["target_updater"] = target_updater(rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
