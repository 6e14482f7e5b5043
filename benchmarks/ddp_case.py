"""Multi-rank benchmark worker (cases b, e-DDP and f): launched by ``run.py`` through torchrun.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 benchmarks/ddp_case.py --out r.json

The contenders live in the same launch and take turns, each repetition in a random order,
the same on every rank (`harness.order_for`), with a barrier around every timed block; each is
five copies taking turns (`harness.rotating`), and each block's CPU seconds are summed over the ranks:
- case b: ``FabricLearner(strategy="ddp")`` vs a hand-written ``DistributedDataParallel`` loop
  over the same loss (wrapped in ``SumLoss``), same seeds, same per-rank batches, and a second,
  identical hand loop as an A/A control;
- case e: ``get_weights()`` of a 20M+ parameter policy vs the raw clone, on every rank;
- case f: the per-update times give the updates/second per rank at this world size.
Rank 0 writes the results as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RL_WARNINGS", "False")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import harness
import torch
import torch.distributed as dist
from tensordict import TensorDict

from fabric_learner import FabricLearner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workloads", default=",".join(common.WORKLOADS))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gw-reps", type=int, default=0, help="get_weights repetitions (0: skip case e)")
    p.add_argument("--gw-inner", type=int, default=2)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    harness.set_one_thread()
    t_start = time.perf_counter()

    results: dict = {"updates": {}, "get_weights": None}
    rank = world = None
    for name in [w for w in args.workloads.split(",") if w]:
        batches = common.make_batches(name, seed=1 + 7919 * int(os.environ.get("RANK", "0")))
        learners, hands = [], []

        def learner():
            built = FabricLearner(common.make_loss(name, seed=0)[0], None, clip_grad_norm=common.CLIP,
                                  accelerator="cpu", strategy="ddp")
            learners.append(built)
            return built

        def hand():
            hands.append(common.HandDDP(common.make_loss(name, seed=0)[0]))
            return hands[-1]

        contenders = {
            "FabricLearner(ddp)": harness.rotating(learner, batches),
            "hand DDP": harness.rotating(hand, batches),
            # A/A control: the same loop again
            "hand DDP (twin)": harness.rotating(lambda: common.HandDDP(common.make_loss(name, seed=0)[0]), batches),
        }
        rank, world = learners[0].global_rank, learners[0].world_size
        cpu: dict[str, list[float]] = {}
        samples = harness.interleaved(contenders, reps=args.reps, inner=args.inner, warmup=args.warmup,
                                      sync=dist.barrier, cpu=cpu)
        # Each learner copy and the hand copy beside it took the same steps on the same batches; DQN is
        # deterministic, so their weights must still agree (PPO's and SAC's losses sample: they drift apart).
        same = None
        if name == "dqn":
            same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                       for copy, h in zip(learners, hands, strict=True)
                       for a, b in zip(copy.loss_module.parameters(), h.ddp.module.loss.parameters(), strict=True))
        # the work of a block is what every rank spent on it: their CPU seconds, summed
        cpu = harness.summed_over_ranks(cpu)
        results["updates"][name] = {"samples_s": samples, "cpu_s": cpu, "same_weights": same,
                                    "threads": torch.get_num_threads()}

    if args.gw_reps:
        loss_g, policy = common.make_loss("ppo_big_actor", seed=0)
        learner = FabricLearner(loss_g, None, policy=policy, accelerator="cpu", strategy="ddp")
        rank, world = learner.global_rank, learner.world_size
        contenders = {
            "FabricLearner(ddp).get_weights": lambda i: learner.get_weights(),
            "raw TensorDict.from_module(policy).data.clone()": lambda i: TensorDict.from_module(policy).data.clone(),
            "raw {k: v.detach().clone() for state_dict}": lambda i: {
                k: v.detach().clone() for k, v in policy.state_dict().items()
            },
        }
        cpu = {}
        samples = harness.interleaved(contenders, reps=args.gw_reps, inner=args.gw_inner, warmup=1,
                                      sync=dist.barrier, cpu=cpu)
        results["get_weights"] = {"samples_s": samples, "cpu_s": cpu, "policy_params": common.count_params(policy)}

    results.update(rank=rank, world_size=world, wall_s=time.perf_counter() - t_start)
    if dist.is_initialized():
        dist.barrier()
        if rank == 0:
            harness.write_json(args.out, results, indent=None)
        dist.barrier()
        dist.destroy_process_group()
    elif rank in (0, None):
        harness.write_json(args.out, results, indent=None)


if __name__ == "__main__":
    main()
