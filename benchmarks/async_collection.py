"""Asynchronous against synchronous collection on 2 DDP ranks: DQN on CartPole, same total frames.

    python benchmarks/async_collection.py [--repeats 3] [--frames 6000] [--out benchmarks/results/async_collection.json]

Contenders and figures: benchmarks/README.md, "Asynchronous collection".
"""
from __future__ import annotations

import copy
import functools
import os
import platform
import resource
import statistics
import time
from datetime import timedelta

import harness
import torch
from lightning.fabric.strategies import DDPStrategy
from tensordict.nn import TensorDictSequential
from torchrl.collectors import AsyncCollector, Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner import AsyncCollection, FabricLearner, Trainer, VersionedPolicy

FRAMES_PER_BATCH, OPTIM_STEPS, RB_BATCH, LR, LAG, EPS = 50, 10, 128, 1e-3, 20, 0.1


def make_env():
    return TransformedEnv(GymEnv("CartPole-v1"), StepCounter())


def evaluate(qnet, episodes: int = 5) -> float:
    """The mean return of greedy episodes."""
    env = make_env()
    env.set_seed(12345)
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        returns = [float(env.rollout(500, qnet)["next", "reward"].sum()) for _ in range(episodes)]
    env.close()
    return statistics.mean(returns)


def worker(mode: str, frames: int, out: str) -> None:
    """One run (``FabricLearner(devices=2)`` starts rank 1): rank 0 writes its rates, return, memory and stats."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = make_env().action_spec
    qnet = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"], spec=spec)
    loss = DQNLoss(qnet, action_space=spec, delay_value=True)
    explore = TensorDictSequential(qnet, EGreedyModule(spec, eps_init=EPS, eps_end=EPS))
    acting = copy.deepcopy(explore)
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=LR), policy=explore, accelerator="cpu",
                            devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)), clip_grad_norm=10.0)
    collector = AsyncCollector(make_env, VersionedPolicy(acting), frames_per_batch=FRAMES_PER_BATCH, total_frames=-1) \
        if mode == "async" else Collector(make_env(), explore, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1)
    trainer = Trainer(learner=learner, collector=collector, total_frames=frames, optim_steps_per_batch=OPTIM_STEPS,
                      target_net_updater=SoftUpdate(loss, tau=0.02), seed=1, progress_bar=False, log_interval=0,
                      **({"async_collection": AsyncCollection(max_policy_lag=LAG)} if mode == "async" else {}))
    ReplayBufferTrainer(TensorDictReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=RB_BATCH),
                        flatten_tensordicts=True).register(trainer)
    samples = []
    trainer.register_op("post_steps", lambda: samples.append(
        (time.perf_counter(), trainer.collected_frames, learner.num_updates, harness.status_mib("VmRSS"))))
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    if learner.global_rank == 0:
        quarter = max(1, len(samples) // 4)
        (t_a, f_a, u_a, _), (t_b, f_b, u_b, _) = samples[0], samples[-1]
        harness.write_json(out, {
            "mode": mode, "seconds": seconds, "frames": trainer.collected_frames, "updates": learner.num_updates,
            # steady state: from the end of the first batch's round to the end of the last
            "fps": (f_b - f_a) / (t_b - t_a), "updates_per_s": (u_b - u_a) / (t_b - t_a),
            "first_round_s": t_a - t0,  # includes an asynchronous collector's worker start-up
            "fps_whole_train": trainer.collected_frames / seconds, "final_return": evaluate(qnet),
            "rss_first_quarter_mb": max(s[3] for s in samples[:quarter]),
            "rss_last_quarter_mb": max(s[3] for s in samples[-quarter:]),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "async": trainer.async_stats if mode == "async" else None}, indent=None)
    learner.close()


def parser():
    p = harness.parser(__doc__, "async_collection.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--frames", type=int, default=6000, help="total frames over both ranks")
    p.add_argument("--worker", choices=("sync", "async"), help="one run of a contender")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.frames, args.out)
    every = harness.rotated(["sync", "async"], args.repeats, lambda mode: harness.launch(
        [__file__, "--worker", mode, "--frames", args.frames], timeout_s=1200, what=f"{mode} run"),
        lambda r: f"{r['fps']:.0f} frames/s, {r['updates_per_s']:.0f} updates/s, return {r['final_return']:.0f}")
    runs = {m: [r for r in every if r["mode"] == m] for m in ("sync", "async")}
    keys = ("fps", "updates_per_s", "final_return", "seconds", "first_round_s", "fps_whole_train",
            "rss_first_quarter_mb", "rss_last_quarter_mb")
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in runs.items()}
    ratios = {k: medians["async"][k] / medians["sync"][k] for k in ("fps", "updates_per_s", "fps_whole_train")}
    harness.write_result(args.out, {
        "what": "2 DDP ranks (gloo, CPU, 1 thread each), DQN MLP [64,64] on CartPole-v1, same total frames",
        "settings": {"total_frames": args.frames, "frames_per_batch": FRAMES_PER_BATCH, "optim_steps_per_batch":
                     OPTIM_STEPS, "batch_size": RB_BATCH, "lr": LR, "max_policy_lag": LAG, "epsilon": EPS,
                     "repeats": args.repeats},
        "medians": medians, "async_over_sync": ratios, "runs": runs,
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version()},
        "git_head": harness.git_head(short=False)})
    harness.show({"medians": medians, "async_over_sync": ratios})


if __name__ == "__main__":
    main()
