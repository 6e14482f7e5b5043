"""PPO on a pendulum swing-up, rollout to update on every rank, through ``fabric_learner.Trainer``.

    python examples/ppo_pendulum.py                       # launches 2 CPU ranks itself (DDP)
    fabric run --accelerator=cpu --strategy=ddp --devices=2 examples/ppo_pendulum.py
    torchrun --nproc-per-node=2 examples/ppo_pendulum.py
    python examples/ppo_pendulum.py --devices 1           # one process
    python examples/ppo_pendulum.py --strategy fsdp       # FSDP2 (sharded parameters) on 2 CPU ranks
    torchrun --nproc-per-node=2 examples/ppo_pendulum.py --strategy fsdp   # the same options under any launcher
    python examples/ppo_pendulum.py --remote 2            # one process; the update on 2 Ray actors (RemoteLearner)

Launch options (``--accelerator --strategy --devices --num-nodes --precision``,
``fabric_learner.cli``): their defaults (2 CPU ranks, DDP) apply under plain ``python``; under
``fabric run``/``torchrun`` the launcher decides, and an option given must agree with it.

Every rank runs this same program: it collects its own rollouts (16 pendulums stepped as one
batch), computes GAE, and takes PPO epochs over minibatches that partition its own data
without replacement, with advantages normalised over all ranks' minibatches; DDP averages the
gradients. torchrl's Trainer loop drives it all (collector -> GAE -> EpochPartitionSampler ->
GlobalAdvantageNormalization -> learner.update), shows a progress bar on rank 0, logs losses,
grad norm, episode return and throughput to TensorBoard (``--logdir``) through Fabric's
TensorBoardLogger, and prints a summary. The environment is torchrl's own ``PendulumEnv`` (gym's
Pendulum-v1 dynamics in pure torch) stepping all ``--envs`` pendulums of a rank in one batched call.

With ``--remote N`` the program runs once, as a single-process torchrl script: one collector steps
the pendulums of all N ranks (``--envs`` x N), minibatches are ``--minibatch`` x N, and each update
runs on N Ray actors (``fabric_learner.RemoteLearner``, ``--strategy``), which split it; GAE reads
the group's critic and the collector acts with its actor after every batch. The learner is the one
line that changes (``pip install 'fabric_learner[ray]'``).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Unbounded
from torchrl.envs import BatchSizeTransform, Compose, PendulumEnv, StepCounter, Transform, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from torchrl.trainers import TrainerHookBase

from fabric_learner import FabricLearner, RemoteLearner
from fabric_learner.cli import DefaultsHelpFormatter, add_launch_arguments, launch_kwargs
from fabric_learner.onpolicy import (
    EpochPartitionSampler,
    GlobalAdvantageNormalization,
    LearnerValueEstimator,
    global_mean,
)
from fabric_learner.trainer import Trainer

MAX_STEPS = 200  # one episode: a batch holds exactly one episode per pendulum


class PendulumObservation(Transform):
    """Adds ``observation = [cos th, sin th, thdot / 8]`` from the pendulum's state ``th, thdot``."""

    def __init__(self):
        super().__init__(in_keys=["th", "thdot"], out_keys=["observation"])

    def _call(self, td):
        th, thdot = td["th"], td["thdot"]
        return td.set("observation", torch.stack([th.cos(), th.sin(), thdot / 8.0], -1))

    def _reset(self, td, td_reset):
        return self._call(td_reset)

    def transform_observation_spec(self, spec):
        spec["observation"] = Unbounded(shape=(*spec.shape, 3), dtype=torch.float32, device=spec.device)
        return spec


def _fresh_states(tensordict, tensordict_reset, env):
    """One random start per pendulum: the stateless base env draws a state for each row of ``params``."""
    base = env.base_env
    return base.reset(base.gen_params(batch_size=env.batch_size), set_state=False)


def make_env(num_envs: int):
    """torchrl's pure-torch ``PendulumEnv`` (gym's Pendulum-v1 dynamics), ``num_envs`` pendulums stepped as
    one batch: the env is stateless, so ``BatchSizeTransform`` gives it a batch size and every step is one
    batched call, where a ``SerialEnv`` would step them one by one."""
    return TransformedEnv(PendulumEnv(), Compose(
        BatchSizeTransform(batch_size=[num_envs], reset_func=_fresh_states, env_kwarg=True),
        PendulumObservation(), StepCounter(max_steps=MAX_STEPS)))


def make_agent(hidden: int = 64):
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[hidden, hidden], activation_class=nn.Tanh),
                        NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0}, return_log_prob=True,
    )
    critic = ValueOperator(MLP(in_features=3, out_features=1, num_cells=[hidden, hidden], activation_class=nn.Tanh),
                           in_keys=["observation"])
    return actor, critic


class EpisodeReturn(TrainerHookBase):
    """Logs the mean episode return over all ranks' pendulums and keeps the learning curve (rank 0)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.curve: list[tuple[int, float, float]] = []  # (global frames, mean return, seconds)
        self._t0 = time.perf_counter()

    def __call__(self, batch):
        returns = batch["next", "reward"].sum(-2)  # [envs, 1]: one full episode per pendulum
        value = global_mean(returns).item()
        self.curve.append((self.trainer.collected_frames, value, time.perf_counter() - self._t0))
        return {"episode_return": value, "log_pbar": True}

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="episode_return"):
        trainer.register_op("pre_steps_log", self)
        trainer.register_module(name, self)


def scale_reward(batch, scale: float):
    batch["next", "scaled_reward"] = batch["next", "reward"] * scale
    return batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--frames", type=int, default=int(os.environ.get("DEMO_FRAMES", 160_000)),
                   help="environment steps over all ranks together")
    p.add_argument("--envs", type=int, default=16, help="pendulums per rank (one episode each per batch)")
    p.add_argument("--epochs", type=int, default=10, help="passes over each collected batch")
    p.add_argument("--minibatch", type=int, default=800, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--gamma", type=float, default=0.9, help="discount factor")
    p.add_argument("--reward-scale", type=float, default=0.1, help="rewards are multiplied by this before learning")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--seed", type=int, default=0, help="seeds the networks, environments and sampling")
    p.add_argument("--logdir", default=os.environ.get("DEMO_LOGDIR", "runs"), help="TensorBoard root ('' for none)")
    p.add_argument("--checkpoint", default=None, help="trainer checkpoint folder, written at the end")
    p.add_argument("--resume", default=None, help="trainer checkpoint folder to resume from")
    p.add_argument("--plot", default=None,
                   help="write the learning curve to this PNG (rank 0; needs matplotlib: pip install -e .[bench])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--remote", type=int, default=0, metavar="N",
                   help="run once and update on N Ray actors (RemoteLearner, --strategy); 0: every rank runs this program")
    add_launch_arguments(p, accelerator="cpu", strategy="ddp", devices=2)  # plain python: 2 CPU ranks
    return p.parse_args(argv)


def build(args, learner_kwargs: dict):
    """The learner and the trainer with its hooks; every rank builds the same."""
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    if args.remote:  # one process collects what all the ranks would, in minibatches as large as theirs together
        args.envs, args.minibatch = args.envs * args.remote, args.minibatch * args.remote
    env = make_env(args.envs)
    actor, critic = make_agent()
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.0, critic_coeff=0.5, loss_critic_type="l2",
                       normalize_advantage=False)  # advantages are normalised over all ranks by the hook below
    gae = GAE(gamma=args.gamma, lmbda=0.95, value_network=critic, average_gae=False)
    gae.set_keys(reward="scaled_reward")  # learn on rewards scaled to about [-1.6, 0]; log the raw ones
    optimizer = functools.partial(torch.optim.Adam, lr=args.lr)
    if args.remote:
        learner = RemoteLearner(loss, optimizer, policy=actor, clip_grad_norm=args.clip, num_learners=args.remote,
                                strategy=args.strategy or "ddp", precision=args.precision or "32-true")
    else:
        learner = FabricLearner(loss, optimizer, policy=actor, clip_grad_norm=args.clip, **learner_kwargs)
    frames_per_batch = args.envs * MAX_STEPS
    # The collector runs the very actor the loss trains, under every strategy: DDP shares its
    # memory; FSDP keeps it (policy=) full and refreshed after every optimizer step; a RemoteLearner
    # copies the group's weights into it after every batch.
    collector = Collector(env, actor, frames_per_batch=frames_per_batch, total_frames=-1,
                          auto_register_policy_transforms=False)
    logger = None
    if args.logdir:
        from lightning.fabric.loggers import TensorBoardLogger

        logger = TensorBoardLogger(root_dir=args.logdir, name="ppo_pendulum")
    trainer = Trainer(
        learner=learner, collector=collector, total_frames=args.frames,
        optim_steps_per_batch=frames_per_batch // args.minibatch, num_epochs=args.epochs,
        logger=logger, log_interval=0, seed=args.seed, progress_bar=not args.no_progress,
        save_trainer_file=args.checkpoint, save_trainer_interval=10**12,
    )
    trainer.register_op("batch_process", functools.partial(scale_reward, scale=args.reward_scale))
    LearnerValueEstimator(learner, gae).register(trainer)  # GAE once per batch (with full weights under FSDP)
    EpochPartitionSampler(args.minibatch).register(trainer)  # pre_epoch + process_optim_batch
    GlobalAdvantageNormalization().register(trainer)  # process_optim_batch, after the sampler
    returns = EpisodeReturn(trainer)
    returns.register(trainer)
    return learner, trainer, returns


def plot(curve, path, world_size):  # rank 0, after training
    from _plot import learning_curve

    learning_curve(curve, path, title=f"PPO on Pendulum, fabric_learner.Trainer, DDP on {world_size} CPU ranks",
                   xlabel=f"environment steps (all {world_size} ranks)", ylabel="mean episode return (200 steps)")


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    learner, trainer, returns = build(args, {} if args.remote else launch_kwargs(args))
    if args.resume:
        trainer.load_from_file(args.resume)
    trainer.train()
    rank, world = learner.global_rank, learner.world_size
    if rank == 0:
        curve = returns.curve
        if args.remote:
            world, how = args.remote, f"as Ray actors ({args.strategy or 'ddp'}, RemoteLearner)"
        else:
            how = "sharded (FSDP)" if learner.capabilities.sharded else type(learner.fabric.strategy).__name__
        print(f"done: {world} rank(s) {how}, {learner.num_updates} updates, {trainer.collected_frames} frames, "
              f"episode return {curve[0][1]:.0f} -> {curve[-1][1]:.0f} in {time.perf_counter() - start:.0f}s", flush=True)
        if args.plot:
            plot(curve, args.plot, world)
    if hasattr(learner, "close"):
        learner.close()
    elif world > 1:
        learner.fabric.barrier()
        torch.distributed.destroy_process_group()
    return learner, trainer, returns


if __name__ == "__main__":
    main()
