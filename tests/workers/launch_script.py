"""A short training script run under each launcher by tests/test_launch.py.

FL_MODE=plain-ddp | plain-fsdp : the learner starts rank 1 itself (``python launch_script.py``)
FL_MODE=external               : no strategy arguments (``fabric run`` / ``torchrun``)
FL_STRATEGY=fsdp               : with FL_MODE=external, only the strategy is given (torchrun + FSDP)
FL_CLOSE=1                     : call learner.close() instead of relying on the exit hook
FL_FAIL_RANK=r                 : rank r raises after its second update
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from rl_cases import halves, make_batch, make_loss  # noqa: E402

from fabric_learner import FabricLearner  # noqa: E402


def main():
    mode = os.environ.get("FL_MODE", "external")
    kwargs = {}
    if mode.startswith("plain-"):
        kwargs = {"accelerator": "cpu", "devices": 2, "strategy": mode.split("-", 1)[1]}
    elif "FL_STRATEGY" in os.environ:  # torchrun: the world comes from the launcher, the strategy from code
        kwargs = {"strategy": os.environ["FL_STRATEGY"]}
    loss, _ = make_loss("dqn")
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=1.0, **kwargs)
    rank = learner.global_rank
    fail_rank = int(os.environ.get("FL_FAIL_RANK", "-1"))
    for step in range(3):
        if step == 2 and rank == fail_rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        learner.update(halves(make_batch("dqn", n=16, seed=step), rank))
    weights = learner.get_weights(cpu_offload=False)
    checksum = sum(float(t.double().sum()) for t in weights.values(True, True))
    print("RESULT " + json.dumps({"rank": rank, "world_size": learner.world_size,
                                  "sharded": learner.capabilities.sharded, "checksum": checksum,
                                  "updates": learner.num_updates}), flush=True)
    if os.environ.get("FL_CLOSE") == "1":
        learner.close()  # otherwise the exit hook tears down


if __name__ == "__main__":
    main()
