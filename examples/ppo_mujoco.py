"""torchrl's PPO MuJoCo recipe (Schulman et al. 2017), ported onto a learner and ``fabric_learner.Trainer``.

    python examples/ppo_mujoco.py                                   # 2 CPU ranks under DDP
    python examples/ppo_mujoco.py --devices 1                       # one process
    torchrun --nproc-per-node=2 examples/ppo_mujoco.py --strategy fsdp
    fabric run --accelerator=cpu --strategy=ddp --devices=2 examples/ppo_mujoco.py --frames 200000

The recipe is torchrl's ``sota-implementations/ppo/ppo_mujoco.py`` with its published
hyper-parameters (``config_mujoco.yaml``): HalfCheetah, observations normalised (``VecNorm``)
and clipped, 64-64 tanh networks with orthogonal initialisation and a state-independent scale,
2048 frames per batch, 10 epochs of 64-sample minibatches drawn without replacement, GAE
(gamma 0.99, lambda 0.95) recomputed before every epoch, the clipped objective (epsilon 0.2,
advantages normalised per minibatch, critic coefficient 0.25, no entropy bonus), Adam (lr 3e-4,
eps 1e-5) with the learning rate annealed linearly to 0 over the run, no gradient clipping.

What the port changes: the loop is torchrl's Trainer driving ``learner.update`` (hooks below);
the recipe's two Adams (actor, critic) are one Adam over both networks, which is the same
update (Adam works element by element, and the two losses touch disjoint parameters); the
environment is ``HalfCheetah-v5`` (gymnasium 1.x; the recipe names v4); storage is in memory.
Under DDP every rank collects its own 2048 frames per batch, so a batch holds ``2048 x ranks``
frames and the run takes ``1 / ranks`` as many updates, the learning rate annealed over them.
To run the recipe's own updates on N ranks instead, share its batch between them:
``--frames-per-batch 2048/N --minibatch 64/N --advantage-norm global`` (each update averages the
ranks' gradients over 64 samples, advantages standardised over all of them, as one process does).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from tensordict.nn import AddStateIndependentNormalScale, TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import ClipTransform, DoubleToFloat, ExplorationType, GymEnv, RewardSum, StepCounter, TransformedEnv, VecNorm
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from torchrl.trainers import TrainerHookBase

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter, add_launch_arguments, launch_kwargs
from fabric_learner.onpolicy import GlobalAdvantageNormalization, LearnerValueEstimator, global_mean
from fabric_learner.trainer import Trainer

# the recipe's published hyper-parameters (torchrl config_mujoco.yaml)
RECIPE = dict(env="HalfCheetah-v5", frames=1_000_000, frames_per_batch=2048, lr=3e-4, anneal_lr=True, gamma=0.99,
              minibatch=64, epochs=10, gae_lambda=0.95, clip_epsilon=0.2, critic_coef=0.25, entropy_coef=0.0,
              loss_critic_type="l2")


# ---- the recipe's pieces: environment, networks, loss -------------------------------------------


def make_env(name: str = RECIPE["env"]):
    """The gymnasium task, observations normalised (slow running statistics) and clipped to [-10, 10]."""
    env = TransformedEnv(GymEnv(name))
    env.append_transform(VecNorm(in_keys=["observation"], decay=0.99999, eps=1e-2))
    env.append_transform(ClipTransform(in_keys=["observation"], low=-10, high=10))
    env.append_transform(RewardSum())
    env.append_transform(StepCounter())
    if env.observation_spec["observation"].dtype is torch.float64:
        env.append_transform(DoubleToFloat(in_keys=["observation"]))
    return env


def _mlp(n_in: int, n_out: int, gain: float) -> MLP:
    net = MLP(in_features=n_in, out_features=n_out, num_cells=[64, 64], activation_class=torch.nn.Tanh)
    for layer in net.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.orthogonal_(layer.weight, gain)
            layer.bias.data.zero_()
    return net


def make_models(env):
    """Actor (TanhNormal over the action box, learned state-independent scale) and critic, 64-64 tanh."""
    n_obs = env.observation_spec["observation"].shape[-1]
    action = env.action_spec_unbatched
    n_act = action.shape[-1]
    loc_scale = torch.nn.Sequential(_mlp(n_obs, n_act, 1.0), AddStateIndependentNormalScale(n_act, scale_lb=1e-8))
    actor = ProbabilisticActor(
        TensorDictModule(loc_scale, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=env.full_action_spec_unbatched, distribution_class=TanhNormal,
        distribution_kwargs={"low": action.space.low, "high": action.space.high, "tanh_loc": False},
        return_log_prob=True, default_interaction_type=ExplorationType.RANDOM,
    )
    critic = ValueOperator(_mlp(n_obs, 1, 0.01), in_keys=["observation"])
    return actor, critic


def make_loss(actor, critic, cfg: dict = RECIPE, normalize_advantage: bool = True):
    loss = ClipPPOLoss(actor_network=actor, critic_network=critic, clip_epsilon=cfg["clip_epsilon"],
                       loss_critic_type=cfg["loss_critic_type"], entropy_coeff=cfg["entropy_coef"],
                       critic_coeff=cfg["critic_coef"], normalize_advantage=normalize_advantage)
    gae = GAE(gamma=cfg["gamma"], lmbda=cfg["gae_lambda"], value_network=critic, average_gae=False)
    return loss, gae


def make_optimizer(lr: float = RECIPE["lr"]):
    return functools.partial(torch.optim.Adam, lr=lr, eps=1e-5)


# ---- the recipe's loop as Trainer hooks ------------------------------------------------------


class EpochMinibatches(TrainerHookBase):
    """Before each epoch, the batch (GAE just recomputed) fills the buffer; each step draws the
    next minibatch without replacement, as the recipe's ``for batch in data_buffer``."""

    def __init__(self, buffer: TensorDictReplayBuffer) -> None:
        self.buffer = buffer

    def extend(self, batch):
        self.buffer.extend(batch.reshape(-1))
        return batch

    def sample(self, batch):
        return self.buffer.sample()

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="epoch_minibatches"):
        trainer.register_op("pre_epoch", self.extend)
        trainer.register_op("process_optim_batch", self.sample)
        trainer.register_module(name, self)


class AnnealLR(TrainerHookBase):
    """Before every update: ``lr = lr0 * (1 - updates_done / total_updates)``, as the recipe."""

    def __init__(self, learner, lr: float, total_updates: int) -> None:
        self.learner, self.lr, self.total = learner, lr, total_updates

    def __call__(self, batch):
        alpha = 1.0 - self.learner.num_updates / self.total
        optimizer = getattr(self.learner.optimizer, "optimizer", self.learner.optimizer)
        for group in optimizer.param_groups:
            group["lr"] = self.lr * alpha
        return batch

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="anneal_lr"):
        trainer.register_op("process_optim_batch", self)
        trainer.register_module(name, self)


class EpisodeReward(TrainerHookBase):
    """Mean return of the episodes that ended in this batch, over all ranks; keeps the curve (rank 0)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.curve: list[tuple[int, float, float]] = []  # (global frames, mean return, seconds)
        self._t0 = time.perf_counter()

    def __call__(self, batch):
        done = batch["next", "done"]
        value = global_mean(batch["next", "episode_reward"], done)
        if not torch.isfinite(value):
            return {}
        self.curve.append((self.trainer.collected_frames, value.item(), time.perf_counter() - self._t0))
        return {"episode_reward": value.item(), "log_pbar": True}

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return

    def register(self, trainer, name="episode_reward"):
        trainer.register_op("pre_steps_log", self)
        trainer.register_module(name, self)


def build(args, learner_kwargs: dict, learner_cls=FabricLearner):
    """The learner and the trainer; every rank builds the same."""
    torch.manual_seed(args.seed)
    actor, critic = make_models(make_env(args.env))  # a proof environment, as the recipe
    loss, gae = make_loss(actor, critic, normalize_advantage=args.advantage_norm == "rank")
    learner = learner_cls(loss, make_optimizer(args.lr), policy=actor, **learner_kwargs)
    fpb, world = args.frames_per_batch, learner.world_size
    batches = args.frames // (fpb * world)
    per_epoch = fpb // args.minibatch
    env = make_env(args.env)
    env.set_seed(args.seed + 1000 * learner.global_rank)  # the collector resets it on creation: seed it first
    collector = Collector(env, actor, frames_per_batch=fpb, total_frames=-1, max_frames_per_traj=-1,
                          auto_register_policy_transforms=False)
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(fpb), sampler=SamplerWithoutReplacement(),
                                    batch_size=args.minibatch)
    logger = None
    if args.logdir:
        from lightning.fabric.loggers import TensorBoardLogger

        logger = TensorBoardLogger(root_dir=args.logdir, name="ppo_mujoco")
    trainer = Trainer(learner=learner, collector=collector, total_frames=batches * fpb * world,
                      optim_steps_per_batch=per_epoch, num_epochs=args.epochs, logger=logger, log_interval=0,
                      seed=args.seed, progress_bar=not args.no_progress)
    LearnerValueEstimator(learner, gae, stage="pre_epoch").register(trainer)  # GAE before every epoch
    EpochMinibatches(buffer).register(trainer)
    if args.advantage_norm == "global":
        GlobalAdvantageNormalization().register(trainer)  # after the sampler: each minibatch over all ranks
    if args.anneal_lr:
        AnnealLR(learner, args.lr, batches * args.epochs * per_epoch).register(trainer)
    returns = EpisodeReward(trainer)
    returns.register(trainer)
    return learner, trainer, returns


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--env", default=RECIPE["env"], help="gymnasium environment")
    p.add_argument("--frames", type=int, default=RECIPE["frames"], help="environment steps over all ranks")
    p.add_argument("--frames-per-batch", type=int, default=RECIPE["frames_per_batch"], help="per rank")
    p.add_argument("--minibatch", type=int, default=RECIPE["minibatch"], help="frames per optimizer update, per rank")
    p.add_argument("--epochs", type=int, default=RECIPE["epochs"], help="passes over each collected batch")
    p.add_argument("--advantage-norm", choices=("rank", "global"), default="rank",
                   help="standardise a minibatch's advantages on its rank (the recipe's loss) or over all ranks")
    p.add_argument("--lr", type=float, default=RECIPE["lr"], help="Adam's learning rate at the start")
    p.add_argument("--no-anneal-lr", dest="anneal_lr", action="store_false",
                   help="keep the learning rate constant (the recipe lowers it linearly to 0 over the run)")
    p.add_argument("--seed", type=int, default=0, help="seeds the networks, environments and sampling")
    p.add_argument("--logdir", default="", help="TensorBoard root ('' for none)")
    p.add_argument("--plot", default=None,
                   help="write the learning curve to this PNG (rank 0; needs matplotlib: pip install -e .[bench])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_launch_arguments(p, accelerator="cpu", strategy="ddp", devices=2)
    return p.parse_args(argv)


def plot(curve, path, title):
    from _plot import learning_curve

    learning_curve(curve, path, title=title, xlabel="environment steps (all ranks)",
                   ylabel="mean training episode return")


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    learner, trainer, returns = build(args, launch_kwargs(args))
    trainer.train()
    seconds = time.perf_counter() - start
    if learner.global_rank == 0:
        curve = returns.curve
        how = "sharded (FSDP)" if learner.capabilities.sharded else type(learner.fabric.strategy).__name__
        first, last = (curve[0][1], curve[-1][1]) if curve else (float("nan"), float("nan"))
        print(f"done: {learner.world_size} rank(s) {how}, {learner.num_updates} updates, {trainer.collected_frames} "
              f"frames, episode return {first:.0f} -> {last:.0f} in {seconds:.0f}s "
              f"({trainer.collected_frames / seconds:.0f} frames/s)", flush=True)
        if args.plot and curve:
            plot(curve, args.plot, f"PPO recipe on {args.env}, {learner.world_size} CPU rank(s), {how}")
    learner.close()
    return learner, trainer, returns


if __name__ == "__main__":
    main()
