"""The Trainer with torchrl's standard environments, from start to a clean exit (issue #21).

Usage: python env_matrix.py OUT_DIR WORLD [NAME ...]   (NAME: run only the cases whose name contains it)
WORLD=1 runs every case in one process (FabricLearner, one device); WORLD=2 starts the second
rank itself and runs half the cases under DDP, then the other half under FSDP (see ``cases``). After each case every rank writes
OUT_DIR/{mode}-{case}-rank{r}.pt, so a case that crashes or hangs leaves its own file missing.
Each case is bounded in time: past CASE_LIMIT seconds the process dumps its stacks and exits
(the test's launcher then kills whatever it left behind).
"""

from __future__ import annotations

import copy
import faulthandler
import functools
import os
import sys
import time
from datetime import timedelta

import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import (
    CatTensors,
    Compose,
    GymEnv,
    ParallelEnv,
    PendulumEnv,
    RewardScaling,
    RewardSum,
    SerialEnv,
    StepCounter,
    TransformedEnv,
    UnsqueezeTransform,
)
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner import FabricLearner, shard_loss
from fabric_learner.onpolicy import LearnerValueEstimator
from fabric_learner.trainer import Trainer

CASE_LIMIT = 60  # seconds per case before the process gives up with a stack dump
FRAMES, MINIBATCH, OPTIM_STEPS, HIDDEN = 16, 8, 2, 8
WORKERS = 2  # sub-envs of a batched env, workers of a multi-process collector


def gym():
    return GymEnv("Pendulum-v1")


def torch_pendulum():
    """torchrl's pure-torch (stateless) PendulumEnv with a 2-d ``observation`` (cos/sin-free, th and thdot)."""
    return TransformedEnv(PendulumEnv(), Compose(
        UnsqueezeTransform(dim=-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
        CatTensors(in_keys=["th", "thdot"], dim=-1, out_key="observation", del_keys=False)))


def step_limit(env, steps: int = 12):
    return TransformedEnv(env, StepCounter(max_steps=steps))


# name -> (obs size, collector class, env factory or list of them, stateless env)
ENVS = {
    "gym": (3, Collector, lambda: step_limit(gym()), False),
    "transformed_stack": (3, Collector, lambda: TransformedEnv(
        step_limit(gym()), Compose(RewardSum(), RewardScaling(loc=0.0, scale=0.1))), False),
    "serial_gym": (3, Collector, lambda: step_limit(SerialEnv(WORKERS, gym)), False),
    "parallel_gym": (3, Collector, lambda: step_limit(ParallelEnv(WORKERS, gym, mp_start_method="fork")), False),
    "torch_pendulum": (2, Collector, lambda: step_limit(torch_pendulum()), True),
    "serial_torch_pendulum": (2, Collector, lambda: step_limit(SerialEnv(WORKERS, torch_pendulum)), True),
    "parallel_torch_pendulum": (2, Collector, lambda: step_limit(
        ParallelEnv(WORKERS, torch_pendulum, mp_start_method="fork")), True),
    "multi_sync_gym": (3, MultiSyncCollector, [lambda: step_limit(gym())] * WORKERS, False),
    "multi_async_gym": (3, MultiAsyncCollector, [lambda: step_limit(gym())] * WORKERS, False),
}
# A collector that runs dry before the Trainer's total_frames, and one the Trainer outlasts.
ENDS = {"collector_dry_first": (2, 10**6), "trainer_ends_first": (10**6, 2)}
RESUMED = ("serial_gym", "parallel_gym", "serial_torch_pendulum")
MODES = {1: ("local",), 2: ("ddp", "fsdp")}


def cases(mode: str) -> list[tuple[str, str, str | None]]:
    """``(case name, env name, end)`` run under ``mode``; ``end`` is ``None`` for a resume case.

    One process runs every case. Two ranks run each case under one strategy, taking turns so
    that every environment kind, end and resume runs under DDP and under FSDP once (a launch
    of both strategies over every case took 40 s of CI for no behaviour the halves miss).
    """
    runs = [(f"{env}-{end}", env, end, i + j) for i, env in enumerate(ENVS) for j, end in enumerate(ENDS)]
    runs += [(f"resume-{env}", env, None, i) for i, env in enumerate(RESUMED)]
    return [(case, env, end) for case, env, end, turn in runs if mode == "local" or MODES[2][turn % 2] == mode]


LEARNERS = []  # closed together at the end: closing the last one ends the process group


def make_learner(mode: str, loss, actor):
    optim = functools.partial(torch.optim.Adam, lr=1e-3)
    if mode == "local":
        return FabricLearner(loss, optim, policy=actor, accelerator="cpu", devices=1)
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    timeout = timedelta(seconds=CASE_LIMIT)
    strategy = DDPStrategy(timeout=timeout) if mode == "ddp" else \
        ModelParallelStrategy(parallelize_fn=shard_loss, timeout=timeout)
    learner = FabricLearner(loss, optim, policy=actor, accelerator="cpu", devices=2, strategy=strategy)
    LEARNERS.append(learner)
    return learner


def build(mode: str, env_name: str, *, collector_batches: int, trainer_batches: int, save_file=None):
    """A PPO trainer as a new user writes it: GAE per batch, replay buffer without replacement."""
    obs, collector_cls, make_env, _ = ENVS[env_name]
    torch.manual_seed(0)
    net = nn.Sequential(MLP(in_features=obs, out_features=2, num_cells=[HIDDEN]), NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=TanhNormal,
                               distribution_kwargs={"low": -2.0, "high": 2.0}, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=obs, out_features=1, num_cells=[HIDDEN]), in_keys=["observation"])
    acting = copy.deepcopy(actor) if mode == "fsdp" else actor  # a sharded loss holds no full weights
    loss = ClipPPOLoss(actor, critic)
    learner = make_learner(mode, loss, actor)
    world = learner.world_size
    env = make_env if isinstance(make_env, list) else make_env()
    collector = collector_cls(env, acting, frames_per_batch=FRAMES, total_frames=FRAMES * collector_batches)
    trainer = Trainer(learner=learner, collector=collector, total_frames=FRAMES * trainer_batches * world,
                      optim_steps_per_batch=OPTIM_STEPS, progress_bar=False, seed=0, log_throughput=False,
                      save_trainer_file=save_file, save_trainer_interval=10**9)
    LearnerValueEstimator(learner, GAE(gamma=0.99, lmbda=0.95, value_network=critic)).register(trainer)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(FRAMES), sampler=SamplerWithoutReplacement(),
                                batch_size=MINIBATCH)
    ReplayBufferTrainer(rb, flatten_tensordicts=True).register(trainer)
    return trainer, learner


def summary(trainer, learner) -> dict:
    return {"rank": learner.global_rank, "collected_frames": trainer.collected_frames,
            "num_updates": learner.num_updates,
            "params": {k: v.detach().clone() for k, v in learner.get_weights(cpu_offload=False)
                       .items(include_nested=True, leaves_only=True)}}


def end_to_end(mode: str, env_name: str, end: str) -> dict:
    collector_batches, trainer_batches = ENDS[end]
    trainer, learner = build(mode, env_name, collector_batches=collector_batches, trainer_batches=trainer_batches)
    trainer.train()
    out = summary(trainer, learner)
    out["state_after_train"] = sorted(trainer.state_dict())  # readable once the collector is shut down
    return out


def resume(mode: str, env_name: str, out_dir: str) -> dict:
    """A: 4 batches uninterrupted; B: 2 batches then a checkpoint; C: B's checkpoint resumed to 4."""
    ckpt = os.path.join(out_dir, f"ckpt-{mode}-{env_name}")
    out = {}
    for run, batches, save in (("A", 4, None), ("B", 2, ckpt), ("C", 4, None)):
        trainer, learner = build(mode, env_name, collector_batches=10**6, trainer_batches=batches, save_file=save)
        if run == "C":
            trainer.load_from_file(ckpt)
            out["C_loaded"] = {"collected_frames": trainer.collected_frames, "num_updates": learner.num_updates}
        trainer.train()
        out[run] = summary(trainer, learner)
    out["rank"] = out["A"]["rank"]
    saved = torch.load(os.path.join(ckpt, f"rank{out['rank']}.pt"), weights_only=False)
    out["saved_carrier"] = saved["carrier"] is not None
    out["saved_env_rng"] = len(saved["rng"]["env"])
    return out


def main(out_dir: str, world: int, only: list[str]) -> None:
    for mode in MODES[world]:
        for case, env, end in cases(mode):
            if only and not any(name in case for name in only):
                continue
            faulthandler.dump_traceback_later(CASE_LIMIT, exit=True)
            t0 = time.monotonic()
            result = end_to_end(mode, env, end) if end is not None else resume(mode, env, out_dir)
            faulthandler.cancel_dump_traceback_later()
            rank = result["rank"]
            result["seconds"] = time.monotonic() - t0
            torch.save(result, os.path.join(out_dir, f"{mode}-{case}-rank{rank}.pt"))
            print(f"{mode} {case} rank {rank}: {result['seconds']:.1f}s", flush=True)
    for learner in LEARNERS:
        learner.close()


if __name__ == "__main__":
    # Worker processes by fork (torchrl's default, spawn, imports torch and torchrl again in each
    # one: seconds per worker on 2 shared cores); the Trainer's part does not depend on it.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
