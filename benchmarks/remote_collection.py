"""Collection apart from learning: frames/s with 1, 2 and 4 collector processes against in-process collection.

    python benchmarks/remote_collection.py [--repeats 3] [--batches 30] [--step-ms 2] [--out ...]

Contenders, rotated, each a fresh process, and the bound each is read against: docs/remote.md.
"""
from __future__ import annotations

import copy
import functools
import os
import statistics
import time

import harness
import torch
from common import SleepPerStep
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner import AsyncCollection, LocalLearner, RemoteCollectors, Trainer, VersionedPolicy

FRAMES_PER_BATCH = 64
CONTENDERS = ("in-process", "remote-1", "remote-2", "remote-4")


def make_env(step_ms: float):
    """CartPole-v1 whose steps sleep ``step_ms`` milliseconds each (importable by the collectors)."""
    return TransformedEnv(GymEnv("CartPole-v1"), SleepPerStep(step_ms / 1000)).append_transform(StepCounter(500))


def tree_cpu_seconds() -> float:
    """CPU seconds of this process and every live descendant (driver, collectors, their nodes), from /proc."""
    parents, times = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in mine:
                mine.add(child)
                frontier.append(child)
    return sum(times.get(pid, 0.0) for pid in mine)


def one_run(contender: str, batches: int, step_ms: float, port: int) -> dict:
    """One contender's run in this process: its steady frames/s, start-up, CPU per frame and collectors' stats."""
    torch.manual_seed(0)
    env_fn = functools.partial(make_env, step_ms)
    spec = env_fn().action_spec
    qnet = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64]), in_keys=["observation"], spec=spec,
                       action_space="one_hot")
    loss = DQNLoss(qnet, action_space="one_hot", delay_value=True)
    loss.make_value_estimator(gamma=0.99)
    explore = TensorDictSequential(qnet, EGreedyModule(spec, eps_init=0.1, eps_end=0.1))
    learner = LocalLearner(loss, functools.partial(torch.optim.Adam, lr=1e-3), policy=explore)
    collectors = 0 if contender == "in-process" else int(contender.split("-")[1])
    collector = RemoteCollectors(env_fn, VersionedPolicy(copy.deepcopy(explore)), frames_per_batch=FRAMES_PER_BATCH,
                                 collectors=collectors, address=f"127.0.0.1:{port}", local=True,
                                 collector_kwargs={"auto_register_policy_transforms": False}) if collectors else \
        Collector(env_fn(), explore, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1,
                  auto_register_policy_transforms=False)
    total = batches * FRAMES_PER_BATCH * max(collectors, 1)
    trainer = Trainer(learner=learner, collector=collector, total_frames=total, optim_steps_per_batch=1,
                      progress_bar=False, async_collection=AsyncCollection() if collectors else None)
    ReplayBufferTrainer(TensorDictReplayBuffer(storage=LazyTensorStorage(total), batch_size=64),
                        flatten_tensordicts=True).register(trainer)
    arrivals: list[tuple[float, int, float]] = []  # (time, frames, CPU seconds of the whole process tree)
    trainer.register_op("batch_process",
                        lambda batch: arrivals.append((time.perf_counter(), batch.numel(), tree_cpu_seconds())))
    start = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    (first, _, cpu_first), (last, _, cpu_last) = arrivals[0], arrivals[-1]
    steady = sum(n for _, n, _ in arrivals[1:])  # frames that arrived after the first batch, within [first, last]
    return {"contender": contender, "collectors": collectors, "frames": trainer.collected_frames,
            "steady_fps": steady / (last - first), "startup_s": first - start, "wall_s": end - start,
            "cpu_per_frame_ms": 1000 * (cpu_last - cpu_first) / steady,
            "remote": collector.stats() if collectors else None}


def parser():
    p = harness.parser(__doc__, "remote_collection.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="of: " + ",".join(CONTENDERS))
    p.add_argument("--contender", help="one run of this contender, in this process (a child)")
    p.add_argument("--port", type=int, default=0, help="the child's driver port")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.contender:  # one run in a fresh process: the process tree whose CPU time it reads is the run's own
        harness.set_one_thread()
        return harness.write_json(args.out, one_run(args.contender, args.batches, args.step_ms, args.port))
    names = args.contenders.split(",")
    runs = harness.rotated(names, args.repeats, lambda name: harness.launch(
        [__file__, "--contender", name, "--batches", args.batches, "--step-ms", args.step_ms, "--port",
         harness.free_port()], what=name), lambda run: f"{run['steady_fps']:.0f} frames/s steady")
    for i, run in enumerate(runs):
        run["repeat"] = i // len(names)
    summary, cores = {}, os.cpu_count() or 1
    base_fps = statistics.median(r["steady_fps"] for r in runs if r["contender"] == "in-process")
    for name in names:
        mine = [r for r in runs if r["contender"] == name]
        fps = statistics.median(r["steady_fps"] for r in mine)
        cpu_frame = statistics.median(r["cpu_per_frame_ms"] for r in mine) / 1000
        m = max(mine[0]["collectors"], 1)
        bound = min(m * base_fps, cores / cpu_frame)
        summary[name] = {"steady_fps": fps, "vs_in_process": fps / base_fps, "bound_fps": bound,
                         "vs_bound": fps / bound, "bound_is": "M x in-process" if m * base_fps <= cores / cpu_frame
                         else f"{cores} cores", "startup_s": statistics.median(r["startup_s"] for r in mine),
                         "cpu_per_frame_ms": 1000 * cpu_frame}
    harness.show(summary)
    harness.write_result(args.out, {"config": {"step_ms": args.step_ms, "batches": args.batches, "repeats": args.repeats,
                                               "frames_per_batch": FRAMES_PER_BATCH, "cores": cores},
                                    "provenance": harness.provenance(), "machine": harness.machine(),
                                    "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
