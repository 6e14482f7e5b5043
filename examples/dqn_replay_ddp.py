"""DQN with a prioritized replay buffer under DDP, through ``fabric_learner.Trainer``.

    python examples/dqn_replay_ddp.py                     # launches 2 CPU ranks itself (DDP)
    fabric run --accelerator=cpu --strategy=ddp --devices=2 examples/dqn_replay_ddp.py
    torchrun --nproc-per-node=2 examples/dqn_replay_ddp.py
    python examples/dqn_replay_ddp.py --strategy fsdp      # the same program under FSDP2
    torchrun --nproc-per-node=2 examples/dqn_replay_ddp.py --strategy fsdp   # the same options, any launcher

    python examples/dqn_replay_ddp.py --collectors 2        # collectors apart, on a second command line:
    python -m fabric_learner.collect --connect 127.0.0.1:29710   # twice, on this host or others
    python examples/dqn_replay_ddp.py --collectors 2 --local-collectors   # the same, started by the learner
    python examples/dqn_replay_ddp.py --remote 2           # one process; the update on 2 Ray actors (RemoteLearner)

Off-policy, every rank running this same program: each rank steps its own cart-poles with an
epsilon-greedy Q-network, writes the transitions into its *own* prioritized replay buffer,
samples its own minibatches and feeds them to ``learner.update``; DDP averages the gradients,
so every rank holds the same Q-network. torchrl's hooks do the rest, unchanged:
``ReplayBufferTrainer`` (extend, sample, and the priority update from DQN's ``td_error``,
which ``fabric_learner.Trainer`` runs after each update), a ``SoftUpdate`` target network,
epsilon annealing, reward logging. The collector acts with the Q-network the loss trains
(shared memory under DDP; under FSDP the learner keeps its ``policy=`` full and refreshed after
every step), so it always uses the newest weights.

The environment is gymnasium's CartPole-v1 through torchrl's ``GymEnv``, ``--envs`` of them in
a ``SerialEnv`` on each rank. Episodes end when the pole falls or after 500 steps; the mean
length of the episodes that ended is the score.

With ``--collectors N`` the cart-poles step in N collector processes apart from the learner ranks
(``fabric_learner.RemoteCollectors``, on torchrl's distributed collectors): each rank serves its share,
collects asynchronously (``AsyncCollection``: frames more than ``--max-lag`` updates old are dropped)
and publishes the epsilon-greedy policy, epsilon included, after every round.

With ``--remote N`` the program runs once, as a single-process torchrl script with one collector
(``--envs`` x N cart-poles) and one prioritized replay buffer, sampling ``--batch`` x N: each update
runs on N Ray actors (``fabric_learner.RemoteLearner``, ``--strategy``), DQN's ``td_error`` comes
back into the sampled batch for the priorities, the ``SoftUpdate`` moves the ranks' target network
(the Trainer runs it inside ``learner.full_parameters()``), and the collector's Q-network takes the
group's weights after every batch (epsilon stays this process's).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time

import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate
from torchrl.trainers import ReplayBufferTrainer, TrainerHookBase

from fabric_learner import AsyncCollection, FabricLearner, RemoteCollectors, RemoteLearner, VersionedPolicy
from fabric_learner.cli import DefaultsHelpFormatter, add_launch_arguments, launch_kwargs
from fabric_learner.onpolicy import global_mean
from fabric_learner.replay import prioritized_sampler
from fabric_learner.trainer import Trainer

MAX_STEPS = 500


def make_env(num_envs: int):
    """``num_envs`` gymnasium CartPole-v1 environments stepped in this process, episodes capped at 500 steps."""
    return TransformedEnv(SerialEnv(num_envs, functools.partial(GymEnv, "CartPole-v1")), StepCounter(max_steps=MAX_STEPS))


class EpisodeLength(TrainerHookBase):
    """Mean length of the episodes that ended in this batch, over all ranks (a collective)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.curve: list[tuple[int, float]] = []

    def __call__(self, batch):
        done = batch["next", "done"].squeeze(-1)
        length = global_mean(batch["next", "step_count"].squeeze(-1).float(), done)
        if not bool(global_mean(done.float()) > 0):
            return {}
        self.curve.append((self.trainer.collected_frames, length.item()))
        return {"episode_length": length.item(), "log_pbar": True}

    def state_dict(self):
        return {"curve": list(self.curve)}

    def load_state_dict(self, state_dict):
        self.curve = [tuple(x) for x in state_dict.get("curve", [])]

    def register(self, trainer, name="episode_length"):
        trainer.register_op("pre_steps_log", self)
        trainer.register_module(name, self)


class PublishQNetwork(TrainerHookBase):
    """``--remote``: after each batch the collector's Q-network takes the group's weights (its epsilon stays here)."""

    def __init__(self, learner, qnet):
        self.learner, self.qnet = learner, qnet

    def __call__(self):
        self.learner.get_weights().to_module(self.qnet)

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="publish_q_network"):
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)


class AnnealEpsilon(TrainerHookBase):
    """Steps the epsilon-greedy schedule by each rank's share of the frames collected since the last call."""

    def __init__(self, egreedy: EGreedyModule, trainer):
        self.egreedy, self.trainer, self.seen = egreedy, trainer, 0

    def __call__(self):
        frames = self.trainer.collected_frames
        self.egreedy.step((frames - self.seen) // self.trainer.learner.world_size)
        self.seen = frames

    def state_dict(self):
        return {}  # eps lives in the policy's buffers: the collector's state carries it

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="anneal_epsilon"):
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--frames", type=int, default=int(os.environ.get("DQN_FRAMES", 30_000)),
                   help="environment steps over all ranks together")
    p.add_argument("--envs", type=int, default=8, help="cart-poles per rank")
    p.add_argument("--steps", type=int, default=8, help="steps per env per collected batch")
    p.add_argument("--updates", type=int, default=8, help="optimizer steps per collected batch")
    p.add_argument("--batch", type=int, default=128, help="replay minibatch per rank")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the networks, environments and sampling")
    p.add_argument("--logdir", default="runs", help="TensorBoard root ('' for none)")
    p.add_argument("--checkpoint", default=None, help="trainer checkpoint folder, written every 10k frames")
    p.add_argument("--resume", default=None, help="trainer checkpoint folder to resume from")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--collectors", type=int, default=0, help="collector processes apart from the ranks (0: in-process)")
    p.add_argument("--collect-address", default="127.0.0.1:29710", help="HOST:PORT where collectors connect")
    p.add_argument("--local-collectors", action="store_true", help="start the collectors here, as child processes")
    p.add_argument("--max-lag", type=int, default=64, help="with --collectors: oldest policy admitted, in updates")
    p.add_argument("--remote", type=int, default=0, metavar="N",
                   help="run once and update on N Ray actors (RemoteLearner, --strategy); 0: every rank runs this program")
    add_launch_arguments(p, accelerator="cpu", strategy="ddp", devices=2)  # plain python: 2 CPU ranks
    return p.parse_args(argv)


def build(args, learner_kwargs: dict):
    torch.manual_seed(args.seed)
    if args.remote:  # one process collects and samples what all the ranks would together
        if args.collectors:
            raise SystemExit("--remote runs the collector in this process: leave --collectors out")
        args.envs, args.batch = args.envs * args.remote, args.batch * args.remote
    env = make_env(args.envs)
    qnet = QValueActor(MLP(in_features=4, out_features=2, num_cells=[128, 128]), in_keys=["observation"],
                       spec=env.action_spec, action_space="one_hot")
    loss = DQNLoss(qnet, action_space="one_hot", delay_value=True, double_dqn=True, loss_function="smooth_l1")
    loss.make_value_estimator(gamma=0.99)
    frames_per_batch = args.envs * args.steps
    egreedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=args.frames // 3)
    explore = TensorDictSequential(qnet, egreedy)
    remote = args.collectors > 0
    acting = VersionedPolicy(copy.deepcopy(explore)) if remote else None  # before a sharded learner empties qnet
    # in-process, the collector acts with the loss's own Q-network; apart, the learner publishes explore's weights
    optimizer = functools.partial(torch.optim.Adam, lr=args.lr)
    if args.remote:
        learner = RemoteLearner(loss, optimizer, policy=qnet, clip_grad_norm=10.0, num_learners=args.remote,
                                strategy=args.strategy or "ddp", precision=args.precision or "32-true")
    else:
        learner = FabricLearner(loss, optimizer, policy=explore if remote else qnet, clip_grad_norm=10.0,
                                **learner_kwargs)
    egreedy.annealing_num_steps = args.frames // learner.world_size // 3
    if remote:
        collector = RemoteCollectors(functools.partial(make_env, args.envs), acting, frames_per_batch=frames_per_batch,
                                     collectors=args.collectors, address=args.collect_address,
                                     local=args.local_collectors)
    else:
        collector = Collector(env, explore, frames_per_batch=frames_per_batch, total_frames=-1,
                              init_random_frames=1000, auto_register_policy_transforms=False)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(50_000), priority_key="td_error", batch_size=args.batch,
                                sampler=prioritized_sampler(50_000, alpha=0.6, beta=0.4))
    logger = None
    if args.logdir:
        from lightning.fabric.loggers import TensorBoardLogger

        logger = TensorBoardLogger(root_dir=args.logdir, name="dqn_cartpole")
    trainer = Trainer(learner=learner, collector=collector, total_frames=args.frames, optim_steps_per_batch=args.updates,
                      target_net_updater=SoftUpdate(loss, tau=0.01), logger=logger, log_interval=2_000,
                      seed=args.seed, progress_bar=not args.no_progress, save_trainer_file=args.checkpoint,
                      save_trainer_interval=10_000,
                      async_collection=AsyncCollection(max_policy_lag=args.max_lag) if remote else None,
                      publish_weights=not args.remote)  # --remote: PublishQNetwork, below
    if args.remote:
        PublishQNetwork(learner, qnet).register(trainer)
    ReplayBufferTrainer(rb, flatten_tensordicts=True).register(trainer)  # extend, sample, update priorities
    AnnealEpsilon(egreedy, trainer).register(trainer)
    lengths = EpisodeLength(trainer)
    lengths.register(trainer)
    return learner, trainer, lengths


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    learner, trainer, lengths = build(args, {} if args.remote else launch_kwargs(args))
    if args.resume:
        trainer.load_from_file(args.resume)
    trainer.train()
    if learner.global_rank == 0:
        curve = lengths.curve
        first = sum(v for _, v in curve[:5]) / max(len(curve[:5]), 1)
        last = sum(v for _, v in curve[-5:]) / max(len(curve[-5:]), 1)
        if args.remote:
            world, how = args.remote, f"as Ray actors ({args.strategy or 'ddp'}, RemoteLearner)"
        else:
            world = learner.world_size
            how = "sharded (FSDP)" if learner.capabilities.sharded else type(learner.fabric.strategy).__name__
        print(f"done: {world} rank(s) {how}, {learner.num_updates} updates, {trainer.collected_frames} frames, "
              f"episode length {first:.0f} -> {last:.0f} in {time.perf_counter() - start:.0f}s", flush=True)
        if args.collectors:
            print(f"collection: {trainer.async_stats}, rank 0's collectors: {trainer.collector.stats()}", flush=True)
    learner.close()


if __name__ == "__main__":
    main()
