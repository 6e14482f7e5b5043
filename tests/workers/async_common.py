"""A DQN Trainer with asynchronous collection: the collector steps its environment in another
process (torchrl's ``AsyncCollector``) and acts with a :class:`VersionedPolicy` copy of the policy.

Shared by tests/test_async.py (one process) and tests/workers/async_checks.py (2 ranks).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch
import trainer_common as tc
from rl_cases import make_loss
from tensordict.nn import TensorDictSequential
from torchrl.collectors import AsyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import StepCounter, TransformedEnv
from torchrl.modules import EGreedyModule
from torchrl.objectives import SoftUpdate
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner import AsyncCollection, VersionedPolicy
from fabric_learner.trainer import GlobalLogScalar, Trainer

FRAMES_PER_BATCH, RB_BATCH, OPTIM_STEPS, LR = tc.FRAMES_PER_BATCH, tc.RB_BATCH, tc.OPTIM_STEPS, tc.LR


class SlowChainEnv(tc.ChainEnv):
    """``ChainEnv`` that sleeps ``delay`` seconds per step: a much slower environment."""

    def __init__(self, delay: float = 0.0, seed: int = 0):
        super().__init__(seed=seed)
        self.delay = delay

    def _step(self, td):
        if self.delay:
            time.sleep(self.delay)
        return super()._step(td)


def make_env(delay: float = 0.0):
    return TransformedEnv(SlowChainEnv(delay), StepCounter(max_steps=tc.MAX_STEPS))


class Admissions:
    """A ``batch_process`` hook (registered first): what reached the batch hooks, with the lag of each frame."""

    def __init__(self, trainer):
        self.trainer, self.frames, self.max_lag, self.batches = trainer, 0, 0, 0

    def __call__(self, batch):
        mask = batch.get(("collector", "mask"))
        lag = self.trainer.learner.num_updates - batch.get("policy_version")[mask]
        self.frames += int(mask.sum())
        self.max_lag = max(self.max_lag, int(lag.max()) if lag.numel() else 0)
        self.batches += 1
        return None


def build(learner_factory, *, total_frames: int, delay: float = 0.0, max_policy_lag=None, max_queued_batches: int = 2,
          save_file=None, save_interval: int = 10**9, seed: int = 0, optim_steps: int = OPTIM_STEPS,
          collector_factory=None):
    """``(trainer, learner, admissions, replay_buffer)``; ``learner_factory(loss, optimizer_factory, policy)``.

    ``collector_factory(make_env, acting_policy)`` builds the collector (default: torchrl's ``AsyncCollector``).
    """
    loss, qnet = make_loss("dqn", seed=0)
    spec = tc.make_env().action_spec
    explore = TensorDictSequential(qnet, EGreedyModule(spec, eps_init=0.3, eps_end=0.3))
    acting = VersionedPolicy(copy.deepcopy(explore))  # the collector's own copy, before a sharded learner empties qnet
    learner = learner_factory(loss, functools.partial(torch.optim.Adam, lr=LR), explore)
    if collector_factory is None:
        collector = AsyncCollector(functools.partial(make_env, delay), acting, frames_per_batch=FRAMES_PER_BATCH,
                                   total_frames=-1)
    else:
        collector = collector_factory(functools.partial(make_env, delay), acting)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=RB_BATCH)
    trainer = Trainer(learner=learner, collector=collector, total_frames=total_frames, optim_steps_per_batch=optim_steps,
                      target_net_updater=SoftUpdate(loss, tau=0.1), seed=seed, progress_bar=False,
                      save_trainer_file=save_file, save_trainer_interval=save_interval, log_interval=0,
                      async_collection=AsyncCollection(max_policy_lag=max_policy_lag,
                                                       max_queued_batches=max_queued_batches))
    admissions = Admissions(trainer)
    trainer.register_op("batch_process", admissions)
    ReplayBufferTrainer(rb, flatten_tensordicts=True).register(trainer)
    GlobalLogScalar(("next", "reward"), "reward_all_ranks").register(trainer)
    return trainer, learner, admissions, rb
