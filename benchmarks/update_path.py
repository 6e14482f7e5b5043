"""The package's files an update runs through, found by running updates: what the published timings time.

    python benchmarks/update_path.py        # prints one path a line, relative to the repository root

tests/test_claims.py holds the published tables to be no older than the last change to any of them.
"""
from __future__ import annotations

import functools
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RL_WARNINGS", "False")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PACKAGE = os.path.join(ROOT, "fabric_learner") + os.sep
# on the path but not run here: compile=True's wrapper (the table's compile rows), since compiling takes a minute
NOT_RUN = ["fabric_learner/step/compile.py"]


def update_path() -> list[str]:
    import torch
    from lightning.fabric.strategies import ModelParallelStrategy
    from rl_cases import make_batch, make_loss

    from fabric_learner import FabricLearner, LocalLearner, Stage, shard_loss
    from fabric_learner.testing import grpo_batch, grpo_example

    files, active = set(), []

    def hook(frame, event, arg) -> None:
        if active and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            files.add(os.path.relpath(frame.f_code.co_filename, ROOT).replace(os.sep, "/"))

    def updates(learner, batches) -> None:
        learner.update(batches[0].clone())  # the warm-up: first-call set-up is not the step
        active.append(True)
        try:
            for batch in batches[1:]:
                learner.update(batch.clone())
        finally:
            active.clear()

    torch.manual_seed(0)
    sys.setprofile(hook)
    try:
        batches = {case: [make_batch(case, n=8, seed=s) for s in range(3)] for case in ("ppo", "dqn", "sac")}
        for case in ("ppo", "dqn"):
            updates(LocalLearner(make_loss(case)[0], clip_grad_norm=1.0), batches[case])
            updates(FabricLearner(make_loss(case)[0], clip_grad_norm=1.0, accelerator="cpu", devices=1), batches[case])
        updates(LocalLearner(make_loss("ppo")[0], grad_accum_steps=2), batches["ppo"] * 2)
        adam = functools.partial(torch.optim.Adam, lr=1e-3)
        stages = [Stage("critic", "qvalue_network_params", adam, loss="loss_qvalue"),
                  Stage("actor", "actor_network_params", adam, loss="loss_actor"),
                  Stage("alpha", "log_alpha", adam, loss="loss_alpha")]
        updates(LocalLearner(make_loss("sac")[0], None, stages=stages), batches["sac"])
        loss, policy, _ = grpo_example()
        updates(LocalLearner(loss), [grpo_batch(policy, [3, 5], seed=s) for s in range(3)])
        fsdp = ModelParallelStrategy(parallelize_fn=functools.partial(shard_loss, min_unit_numel=1))
        learner = FabricLearner(make_loss("ppo")[0], adam, strategy=fsdp, accelerator="cpu", devices=1)
        updates(learner, batches["ppo"])
        learner.close()
    finally:
        sys.setprofile(None)
    return sorted(files | set(NOT_RUN))


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print("\n".join(update_path()))
    sys.stdout.flush()
    os._exit(0)  # the gloo group of the one-rank FSDP learner is left for the exit to end
