"""The training loop's stall for an asynchronous sharded save vs a synchronous save, 2 CPU ranks.

    python benchmarks/async_save.py --out benchmarks/results/async_save.json   # starts rank 1 itself

The blocks, the stall and its goal (at most 0.3 of a blocking save): benchmarks/README.md, "Asynchronous save".
"""
from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import common
import harness
import torch
from lightning.fabric.strategies import ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss

GOAL = 0.3
WORKLOAD = "ppo_big_actor"


def parser():
    p = harness.parser(__doc__, "async_save.json")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per update")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    harness.set_one_thread()
    loss, _ = common.make_loss(WORKLOAD)
    n_params = common.count_params(loss)
    strategy = ModelParallelStrategy(parallelize_fn=shard_loss, timeout=timedelta(minutes=10))
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-5), accelerator="cpu", devices=2,
                            strategy=strategy)
    rank, fabric = learner.global_rank, learner.fabric
    root = fabric.broadcast(tempfile.mkdtemp(prefix="async_save_") if rank == 0 else None, src=0)
    batches = common.make_batches(WORKLOAD, count=8, seed=1 + 100 * rank, n=args.batch)

    def steps(count: int, start: int) -> list[float]:
        times = []
        for i in range(start, start + count):
            t0 = time.perf_counter()
            learner.update(batches[i % len(batches)])
            times.append(time.perf_counter() - t0)
        return times

    # warm-up: steps, a sync save, and an async save followed by steps until every rank's write ended: M steps
    step_times = steps(3, 0)
    learner.save(os.path.join(root, "sync"))
    handle = learner.save(os.path.join(root, "async"), blocking=False)
    needed = 0
    while True:
        steps(1, needed)
        needed += 1
        done = torch.tensor([0.0 if handle.done() else 1.0])
        torch.distributed.all_reduce(done)
        if done.item() == 0 or needed >= 40:
            break
    learner.wait_for_save()
    m = fabric.broadcast(needed + 2 if rank == 0 else None, src=0)
    samples: dict[str, list[float]] = {"sync": [], "async": [], "plain": [], "async_call": [], "async_wait": []}
    steps_until_done: list[int] = []
    cpu: dict[str, list[float]] = {"sync": [], "async": [], "plain": []}  # this process's CPU seconds, all threads
    for rep in range(args.reps):
        for name in harness.order_for(rep, ["sync", "async", "plain"]):
            fabric.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "sync":
                learner.save(os.path.join(root, "sync"))
            elif name == "async":
                handle = learner.save(os.path.join(root, "async"), blocking=False)
                t_call, finished_at = time.perf_counter() - t0, None
                for i in range(m):
                    steps(1, i)
                    if finished_at is None and handle.done():
                        finished_at = i + 1
                t_wait0 = time.perf_counter()
                learner.wait_for_save()
                samples["async_wait"].append(time.perf_counter() - t_wait0)
                samples["async_call"].append(t_call)
                steps_until_done.append(finished_at or m + 1)
            else:
                steps(m, 0)
            fabric.barrier()
            samples[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    stall = [a - p for a, p in zip(samples["async"], samples["plain"])]
    gathered = harness.gathered({"rank": rank, "samples_s": samples, "stall_s": stall,
                                 "ratio": [s / y for s, y in zip(stall, samples["sync"])],
                                 "steps_until_done": steps_until_done, "cpu_s": cpu,
                                 "cpu_stall_s": [a - p for a, p in zip(cpu["async"], cpu["plain"])]})
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)

        def worst(get) -> list[float]:  # the loop runs at the pace of its slowest rank: per repetition, the larger
            return [max(get(g)[r] for g in gathered) for r in range(args.reps)]

        stall_max, sync_max = worst(lambda g: g["stall_s"]), worst(lambda g: g["samples_s"]["sync"])
        cpu_extra, cpu_sync = worst(lambda g: g["cpu_stall_s"]), worst(lambda g: g["cpu_s"]["sync"])
        ci = harness.bootstrap_ci(stall_max, sync_max)
        result = {
            "what": "training-loop stall of save(blocking=False) vs the time of save(), FSDP on 2 CPU ranks",
            "workload": f"{WORKLOAD}: ClipPPOLoss, actor MLP [2048]*6 + critic [64,64], {n_params / 1e6:.1f}M "
                        f"parameters, Adam, {args.batch} samples per rank per update",
            "steps_overlapping_each_async_save": m, "reps": args.reps,
            "median_s": {"sync_save": statistics.median(sync_max), "async_stall": statistics.median(stall_max),
                         "async_save_call": statistics.median(samples["async_call"]),
                         "async_wait_at_end": statistics.median(samples["async_wait"]),
                         "plain_steps_block": statistics.median(samples["plain"]),
                         "one_step": statistics.median(step_times)},
            "stall_over_sync": harness.paired_ratio(stall_max, sync_max), "ci95": list(ci), "goal": GOAL,
            "verdict": harness.verdict(ci, GOAL),
            "cpu_time": {
                "what": "the same blocks in process CPU seconds (all threads of a rank, the writer's included): "
                        "the stall when no spare core runs the writer; insensitive to waiting for a core",
                "median_s": {"sync_save": statistics.median(cpu_sync), "async_extra": statistics.median(cpu_extra)},
                "extra_over_sync": harness.paired_ratio(cpu_extra, cpu_sync),
                "ci95": list(harness.bootstrap_ci(cpu_extra, cpu_sync))},
            "per_rank": gathered,
            "machine": {"cpus": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
                        "load_avg_at_end": os.getloadavg(), "torch": torch.__version__},
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        harness.write_result(args.out, result)
        harness.show({k: result[k] for k in ("median_s", "stall_over_sync", "ci95", "verdict", "cpu_time")})
    learner.close()


if __name__ == "__main__":
    main()
