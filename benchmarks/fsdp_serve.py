"""What keeping the policy full under FSDP costs: time per update and memory per rank, 2 CPU ranks.

    python benchmarks/fsdp_serve.py --out benchmarks/results/fsdp_serve.json   # starts rank 1 itself

Two FSDP learners on identical PPO losses, one given ``policy=actor`` (served: the actor kept full and refreshed
after each step by one all-gather) and one not, take interleaved blocks of updates on the same batches; the ratio
of their median block times is the serving cost; memory is the served full copy per rank. For the standard PPO
workload and the 21M-parameter actor.
"""
from __future__ import annotations

import functools
import statistics
import time
from datetime import timedelta

import common
import harness
import torch
from lightning.fabric.strategies import ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss


def learner(workload: str, served: bool):
    loss, actor = common.make_loss(workload)
    strategy = ModelParallelStrategy(parallelize_fn=shard_loss, timeout=timedelta(minutes=5))
    return FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-4), policy=actor if served else None,
                         accelerator="cpu", devices=2, strategy=strategy), actor


def measure(workload: str, reps: int, block: int, batch: int) -> dict:
    (served, actor), (plain, _) = learner(workload, True), learner(workload, False)
    rank = served.global_rank
    batches = [common.make_batch(workload, n=batch, seed=10 * rank + i) for i in range(block)]
    times = {"served": [], "plain": []}
    for rep in range(reps + 1):  # the first block warms up
        for name in harness.rotation(rep, ["plain", "served"]):
            each = served if name == "served" else plain
            served.fabric.barrier()
            start = time.perf_counter()
            for b in batches:
                each.update(b.clone())
            if rep:
                times[name].append((time.perf_counter() - start) / block)
    served_bytes = sum(p.numel() * p.element_size() for p in actor.parameters())
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"workload": workload, "rank": rank, "ms_per_update": {k: v * 1e3 for k, v in median.items()},
            "ratio": median["served"] / median["plain"], "served_mib": served_bytes / 2**20,
            "actor_params": sum(p.numel() for p in actor.parameters()), "reps": reps, "block": block}


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--reps", type=int, default=9)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    rows = [measure("ppo", args.reps, 8, common.BATCH), measure("ppo_big_actor", args.reps, 2, 64)]
    if rows[0]["rank"] == 0:
        harness.write_result(args.out, {"rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "git": harness.git_head()})
        for r in rows:
            print(f"{r['workload']:>14}: served {r['ms_per_update']['served']:.2f} ms, not served "
                  f"{r['ms_per_update']['plain']:.2f} ms per update, ratio {r['ratio']:.3f}; served copy "
                  f"{r['served_mib']:.2f} MiB per rank ({r['actor_params']:,} actor parameters)", flush=True)


if __name__ == "__main__":
    main()
