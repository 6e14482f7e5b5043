"""torchrl's SAC MuJoCo recipe (Haarnoja et al. 2018) as torchrl's ``SACTrainer``, driven by a learner.

    python examples/sac_mujoco.py --frames 20000 --devices 1        # one process
    python examples/sac_mujoco.py --frames 20000                    # 2 CPU ranks under DDP
    python examples/sac_mujoco.py --strategy fsdp --frames 20000    # 2 CPU ranks under FSDP

The recipe's pieces are torchrl's ``sota-implementations/sac`` with its published
hyper-parameters (``config.yaml``): HalfCheetah, 8 environments per collector, 1000 frames per
batch, the first 25,000 frames with random actions, a replay buffer of 1M transitions, minibatches
of 256, one update per collected frame (``utd_ratio`` 1), gamma 0.99, an L2 critic loss, Adam (lr
3e-4, eps 1e-8, no weight decay), Polyak averaging 0.995 of the two target critics, alpha starting
at 1.0 (learned), 256-256 ReLU networks, a TanhNormal actor with a biased-softplus scale (bias
1.0, lower bound 0.1).

What differs from torchrl's script, and why:

- the loop is torchrl's ``SACTrainer`` (its replay buffer, target-update and logging hooks) handed
  to a learner by ``fabric_learner.from_torchrl.learner_trainer``;
- torchrl's script takes ``env_per_collector x frames_per_batch x utd_ratio`` = 8,000 updates per
  batch of 1,000 frames (8 per frame); here ``utd_ratio`` means what it says, 1 update per frame
  (1,000 per batch), which is also what SAC's paper does; 8 per frame would take a 2-core CPU
  most of a day per 300k-frame run;
- the recipe's three Adams (actor, critics, alpha, alike here) are one Adam over all three, the
  same update: Adam works element by element and the three losses reach disjoint parameters;
- the replay buffer is registered the way torchrl's ``ReplayBufferTrainer.register`` does it,
  storing each batch as it arrives: torchrl 0.14.1's ``SACTrainer`` extends its buffer in its
  ``pre_epoch`` hook, which runs only with the updates, so the 25,000 random warm-up frames never
  reach the buffer and the first updates sample the first 1,000 frames (the recipe stores them all);
- the 8 environments step in this process (``SerialEnv``), not in 8 worker processes
  (``ParallelEnv``): the same transitions, without 8 processes fighting over 2 cores; the
  replay buffer is in memory, sized to the run, without prefetching threads;
- ``HalfCheetah-v5`` (gymnasium 1.x; the recipe names v4).

Ranks: every rank collects its own 1000 frames per batch with its own 8 environments (a batch
holds ``1000 x ranks`` frames), keeps its own replay buffer, and takes the recipe's 1000 updates of
256 samples per batch, each update averaging gradients over the ranks (``256 x ranks`` samples):
the run takes ``1 / ranks`` as many updates. The random warm-up is split between the ranks
(``25,000 / ranks`` each), so the run's random frames, like its total frames, do not depend on
the number of ranks.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import warnings

import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import DoubleToFloat, ExplorationType, GymEnv, InitTracker, RewardSum, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import set_exploration_type
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter, add_launch_arguments, launch_kwargs

# torchrl's sota-implementations/sac/config.yaml (utd_ratio: see the module docstring)
RECIPE = dict(env="HalfCheetah-v5", frames=300_000, envs=8, frames_per_batch=1000, init_random_frames=25_000,
              buffer_size=1_000_000, utd_ratio=1.0, gamma=0.99, loss_function="l2", lr=3e-4, weight_decay=0.0,
              batch_size=256, target_update_polyak=0.995, alpha_init=1.0, adam_eps=1e-8, hidden_sizes=(256, 256),
              default_policy_scale=1.0, scale_lb=0.1, max_episode_steps=1000)


# ---- the recipe's pieces: environment, networks, loss, buffer, optimizer -------------------------


def make_env(name: str = RECIPE["env"], envs: int = RECIPE["envs"], max_steps: int = RECIPE["max_episode_steps"]):
    """``envs`` copies of the task stepped in this process, with the recipe's transforms (episode
    start flags, a step limit, float32 observations, the running episode return ``episode_reward``)."""
    env = TransformedEnv(SerialEnv(envs, functools.partial(GymEnv, name)) if envs > 1 else GymEnv(name))
    for transform in (InitTracker(), StepCounter(max_steps), DoubleToFloat(), RewardSum()):
        env.append_transform(transform)
    return env


def make_models(env, cfg: dict = RECIPE):
    """Actor (TanhNormal over the action box, scale ``biased_softplus`` bounded below) and one critic
    Q(observation, action), ReLU MLPs of the recipe's sizes, materialised by one forward pass."""
    action = env.action_spec_unbatched
    n_act = action.shape[-1]
    net = torch.nn.Sequential(
        MLP(num_cells=list(cfg["hidden_sizes"]), out_features=2 * n_act, activation_class=torch.nn.ReLU),
        NormalParamExtractor(scale_mapping=f"biased_softplus_{cfg['default_policy_scale']}", scale_lb=cfg["scale_lb"]))
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]), in_keys=["loc", "scale"],
        spec=action, distribution_class=TanhNormal,
        distribution_kwargs={"low": action.space.low, "high": action.space.high, "tanh_loc": False},
        default_interaction_type=ExplorationType.RANDOM, return_log_prob=False)
    qvalue = ValueOperator(MLP(num_cells=list(cfg["hidden_sizes"]), out_features=1, activation_class=torch.nn.ReLU),
                           in_keys=["action", "observation"])
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        td = env.fake_tensordict()
        actor(td)
        qvalue(td)
    return actor, qvalue


def make_loss(actor, qvalue, cfg: dict = RECIPE):
    """SAC with two critics and their Polyak-averaged targets, the actor not delayed; and its target updater."""
    loss = SACLoss(actor_network=actor, qvalue_network=qvalue, num_qvalue_nets=2, loss_function=cfg["loss_function"],
                   delay_actor=False, delay_qvalue=True, alpha_init=cfg["alpha_init"])
    loss.make_value_estimator(gamma=cfg["gamma"])
    return loss, SoftUpdate(loss, eps=cfg["target_update_polyak"])


def make_buffer(capacity: int, cfg: dict = RECIPE) -> TensorDictReplayBuffer:
    """The recipe's uniform replay buffer, in memory, of ``capacity`` transitions (at most the recipe's)."""
    return TensorDictReplayBuffer(storage=LazyTensorStorage(min(capacity, cfg["buffer_size"])),
                                  batch_size=cfg["batch_size"])


def make_optimizer(params, cfg: dict = RECIPE) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], eps=cfg["adam_eps"])


def make_collector(env, actor, rank_init_random: int, cfg: dict = RECIPE) -> Collector:
    return Collector(env, actor, frames_per_batch=cfg["frames_per_batch"], total_frames=-1,
                     init_random_frames=rank_init_random, auto_register_policy_transforms=False)


# ---- the recipe as torchrl's SACTrainer on a learner -----------------------------------------------


def build(args, learner_factory, *, world: int, rank: int, save_trainer_file: str | None = None):
    """torchrl's ``SACTrainer`` for this rank of ``world``, handed to a learner built by ``learner_factory``
    (``(loss, optimizer_factory, **kw) -> Learner``). Returns the ``fabric_learner.Trainer``.

    ``rank`` and ``world`` are needed before the learner exists: they seed this rank's environments
    before the collector's first reset and split the random warm-up. With ``save_trainer_file`` the
    trainer checkpoints there when it stops (a stop request, or the end) and resumes from it when
    built again; the replay buffer is part of the checkpoint.
    """
    from torchrl.trainers.algorithms import SACTrainer

    from fabric_learner.from_torchrl import learner_trainer

    cfg = {**RECIPE, "frames_per_batch": args.frames_per_batch, "init_random_frames": args.init_random_frames}
    torch.manual_seed(args.seed)
    env = make_env(args.env, args.envs)
    actor, qvalue = make_models(env, cfg)
    loss, target_updater = make_loss(actor, qvalue, cfg)
    env.set_seed(args.seed + 1000 * rank)  # the collector resets it on creation: seed it first
    collector = make_collector(env, actor, args.init_random_frames // world, cfg)
    batches = args.frames // (args.frames_per_batch * world)
    buffer = make_buffer(args.frames // world + args.frames_per_batch, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "SACTrainer is an experimental/prototype feature"
        trainer = SACTrainer(
            collector=collector, total_frames=batches * args.frames_per_batch * world, frame_skip=1,
            optim_steps_per_batch=int(args.frames_per_batch * cfg["utd_ratio"]), loss_module=loss,
            optimizer=make_optimizer(loss.parameters(), cfg), clip_norm=None, progress_bar=False, seed=args.seed,
            replay_buffer=None,  # registered below: see the module docstring
            target_net_updater=target_updater, save_trainer_file=save_trainer_file, save_trainer_interval=10**15,
            log_interval=args.frames_per_batch * world, log_rewards=False, log_actions=False)
    trainer.replay_buffer = buffer  # what its utd_ratio log reads
    out = learner_trainer(trainer, learner_factory, progress_bar=not args.no_progress)
    # torchrl's own registration of a buffer: every batch stored as it arrives (the warm-up's included), the
    # buffer part of the trainer's checkpoint, so that a resume continues from the same data
    ReplayBufferTrainer(buffer, flatten_tensordicts=True, iterate=True).register(out)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--env", default=RECIPE["env"], help="gymnasium environment")
    p.add_argument("--envs", type=int, default=RECIPE["envs"], help="environments per collector (per rank)")
    p.add_argument("--frames", type=int, default=RECIPE["frames"], help="environment steps over all ranks")
    p.add_argument("--frames-per-batch", type=int, default=RECIPE["frames_per_batch"], help="per rank")
    p.add_argument("--init-random-frames", type=int, default=RECIPE["init_random_frames"], help="over all ranks")
    p.add_argument("--seed", type=int, default=0, help="seeds the networks, environments and sampling")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_launch_arguments(p, accelerator="cpu", strategy="ddp", devices=2)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kwargs = launch_kwargs(args)
    # needed before the learner exists (see build): under torchrun from its variables, else from --devices
    world = int(os.environ.get("WORLD_SIZE", kwargs.get("devices") if isinstance(kwargs.get("devices"), int) else 1))
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))  # LOCAL_RANK: the ranks FabricLearner starts
    start = time.perf_counter()
    trainer = build(args, functools.partial(FabricLearner, **kwargs), world=world, rank=rank)
    trainer.train()
    learner = trainer.learner
    if learner.global_rank == 0:
        print(f"done: {learner.world_size} rank(s), {learner.num_updates} updates, {trainer.collected_frames} frames "
              f"in {time.perf_counter() - start:.0f}s", flush=True)
    learner.close()


if __name__ == "__main__":
    main()
