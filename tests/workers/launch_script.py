"""A short training script run under each launcher by tests/test_launch.py.

It trains two learners one after the other, DDP and FSDP in the order FL_FIRST gives, and
prints a RESULT line for each; the program then ends with both alive, so one exit tears down both.

FL_MODE=plain    : the learners start rank 1 themselves (``python launch_script.py``)
FL_MODE=external : ``fabric run`` / ``torchrun`` started the ranks; the first learner takes
                   the launcher's strategy (``fabric run --strategy=...``), or FL_STRATEGY
                   from code under torchrun, which only gives the world
FL_FIRST=ddp|fsdp: the first learner's strategy; the second uses the other one
FL_CLOSE=1       : close() both learners instead of relying on the exit hook
FL_FAIL_RANK=r   : rank r raises after its second update of the first learner
FL_BUSY_RANK0=s  : meanwhile rank 0 computes for s seconds (a sleep, in no collective) before its third update
FL_QUEUE=1       : every rank holds a multiprocessing queue (named semaphores, as collectors' queues do)
FL_TIMEOUT=none  : the first learner gets timeout=None (torch's default) instead of the default 5 minutes
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from rl_cases import group_timeouts, halves, make_batch, make_loss

from fabric_learner import FabricLearner, shard_loss


def train(kwargs, fail_rank=-1):
    loss, qnet = make_loss("dqn")
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-2), policy=qnet, clip_grad_norm=1.0,
                            **kwargs)
    rank = learner.global_rank
    acted = []
    for step in range(3):
        if step == 2 and rank == fail_rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        if step == 2 and rank == 0 and os.environ.get("FL_BUSY_RANK0"):
            time.sleep(float(os.environ["FL_BUSY_RANK0"]))
            print("rank 0 is done computing", flush=True)
        learner.update(halves(make_batch("dqn", n=16, seed=step), rank))
        with torch.no_grad():  # a rollout between updates: the policy the loss trains, in place, on every strategy
            acted.append(float(qnet(make_batch("dqn", n=4, seed=9).select("observation"))["action_value"].sum()))
    weights = learner.get_weights(cpu_offload=False)
    checksum = sum(float(t.double().sum()) for t in weights.values(True, True))
    print("RESULT " + json.dumps({"rank": rank, "world_size": learner.world_size,
                                  "sharded": learner.capabilities.sharded, "checksum": checksum,
                                  "updates": learner.num_updates, "acted": acted,
                                  "group_timeouts": group_timeouts()}), flush=True)
    return learner


def main():
    if os.environ.get("FL_QUEUE") == "1":
        import multiprocessing

        globals()["queue"] = multiprocessing.get_context("spawn").Queue()
    first = os.environ.get("FL_FIRST", "ddp")
    second = "ddp" if first == "fsdp" else "fsdp"
    plain = os.environ.get("FL_MODE", "external") == "plain"
    world = {"accelerator": "cpu", "devices": 2} if plain else {}
    if plain:
        given = {**world, "strategy": first}
    else:
        given = {"strategy": os.environ["FL_STRATEGY"]} if "FL_STRATEGY" in os.environ else {}
    # Given as strategy objects: under `fabric run` a strategy *name* that differs from --strategy
    # is refused (the launcher decides); an object is the script's explicit choice
    other = DDPStrategy() if second == "ddp" else ModelParallelStrategy(parallelize_fn=shard_loss)
    if os.environ.get("FL_TIMEOUT") == "none":
        given["timeout"] = None
    learners = [train(given, int(os.environ.get("FL_FAIL_RANK", "-1"))), train({**world, "strategy": other})]
    if os.environ.get("FL_CLOSE") == "1":
        # README, Ending a run: close() is idempotent, and the context manager closes too
        learners[0].close()
        learners[0].close()
        with learners[1] as learner:
            assert learner is learners[1]
        learners[1].close()
        for learner in learners:
            try:
                learner.update(make_batch("dqn", n=8))
            except RuntimeError as err:
                assert "closed" in str(err), err
            else:
                raise AssertionError("a closed learner took an update")
        print(f"CLOSED rank {learners[0].global_rank}", flush=True)


if __name__ == "__main__":
    main()
