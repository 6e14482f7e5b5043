"""torchrl's algorithm trainers (PPO, A2C, SAC, TD3, DDPG, DQN, IQL, CQL) built small, and fed fixed data.

Imported by tests/test_from_torchrl.py for the one-process references, and run as the 2-rank
worker: ``python algorithm_trainers.py OUT_DIR STRATEGY`` launches 2 CPU ranks (Fabric) that
each build every trainer, drive it with ``learner_trainer`` on a ``FabricLearner`` under
STRATEGY, feed it this rank's half of the fixed batches through the trainer's own hooks
(value estimation, replay buffer, target updates, priorities), then run ``train()`` on real
environments for two batches; each rank saves what it saw to OUT_DIR/rank{r}.pt.

The data are laid out so that one process on the full batches sees exactly the union of the
ranks' data in every minibatch: replay buffers sample without replacement and without
shuffling, and the full flat batch interleaves the ranks' minibatch-sized blocks.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer
from torchrl.envs import Compose, GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, IndependentNormal, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
from torchrl.objectives import A2CLoss, ClipPPOLoss, CQLLoss, DDPGLoss, DQNLoss, IQLLoss, SACLoss, SoftUpdate, TD3Loss
from torchrl.trainers.algorithms import (
    A2CTrainer,
    CQLTrainer,
    DDPGTrainer,
    DQNTrainer,
    IQLTrainer,
    PPOTrainer,
    SACTrainer,
    TD3Trainer,
)
from torchrl.trainers.algorithms.td3 import TD3OptimizationStepper

ALGOS = ["ppo", "a2c", "sac", "td3", "ddpg", "dqn", "iql", "cql"]
# whether the loss is a pure function of weights and batch (else: ranks are compared with each other only)
DETERMINISTIC = {"ppo": True, "a2c": True, "sac": False, "td3": False, "ddpg": True, "dqn": True, "iql": True,
                 "cql": False}
ON_POLICY = ("ppo", "a2c")
B = 32  # minibatch of one process (each of 2 ranks takes B // 2)
K = 2  # off-policy minibatches per collected batch
ENVS, T = 4, 8  # on-policy batch: ENVS trajectories of T steps (one minibatch, EPOCHS epochs)
EPOCHS = 2
BATCHES = 3  # fixed batches fed
CLIP = 1.0
LR = 1e-3


def _env(algo, seed=None):
    name = "CartPole-v1" if algo == "dqn" else "Pendulum-v1"
    env = TransformedEnv(GymEnv(name), Compose(StepCounter(max_steps=50), RewardSum(in_keys=["reward"], out_keys=["reward_sum"])))
    if seed is not None:  # before the collector's first reset, so that its first observation is seeded too
        env.set_seed(seed)
    return env


def _gaussian(distribution, **kwargs):
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[32]), NormalParamExtractor())
    return ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                              in_keys=["loc", "scale"], distribution_class=distribution, return_log_prob=True,
                              **kwargs)


def _deterministic():
    return TensorDictModule(nn.Sequential(MLP(in_features=3, out_features=1, num_cells=[32]), nn.Tanh()),
                            in_keys=["observation"], out_keys=["action"])


def _qvalue():
    return ValueOperator(MLP(in_features=4, out_features=1, num_cells=[32]), in_keys=["observation", "action"])


def _value():
    return ValueOperator(MLP(in_features=3, out_features=1, num_cells=[32]), in_keys=["observation"])


def _replay(world_size, algo):
    size = (ENVS * T if algo in ON_POLICY else K * B) // world_size
    batch = size if algo in ON_POLICY else B // world_size
    return TensorDictReplayBuffer(storage=LazyTensorStorage(size), batch_size=batch,
                                  sampler=SamplerWithoutReplacement(drop_last=True, shuffle=False))


def build(algo: str, world_size: int = 1, seed: int = 0):
    """torchrl's ``<ALGO>Trainer``, small, with weights fixed by ``seed``; its replay buffer sized for
    one rank of ``world_size`` (minibatch ``B // world_size``)."""
    torch.manual_seed(seed)
    env = _env(algo)
    spec = env.action_spec
    frames = (ENVS * T if algo in ON_POLICY else K * B) // world_size
    common = dict(total_frames=2 * frames * world_size, frame_skip=1, clip_norm=CLIP, progress_bar=False, seed=seed,
                  replay_buffer=_replay(world_size, algo), save_trainer_file=None)
    env_fn = functools.partial(_env, algo, seed)
    greedy = None
    if algo in ON_POLICY:
        actor = _gaussian(IndependentNormal)
        if algo == "ppo":
            loss = ClipPPOLoss(actor, _value(), entropy_coeff=0.01, normalize_advantage=False)
        else:
            loss = A2CLoss(actor, _value(), entropy_coeff=0.01)
        policy = actor
    elif algo == "sac":
        actor = _gaussian(TanhNormal, spec=spec)
        loss, policy = SACLoss(actor, _qvalue(), num_qvalue_nets=2, action_spec=spec), actor
    elif algo == "td3":
        actor = _deterministic()
        loss, policy = TD3Loss(actor, _qvalue(), action_spec=spec, num_qvalue_nets=2), actor
    elif algo == "ddpg":
        actor = _deterministic()
        loss, policy = DDPGLoss(actor, _qvalue()), actor
    elif algo == "dqn":
        value = QValueActor(MLP(in_features=4, out_features=2, num_cells=[32]), in_keys=["observation"],
                            spec=spec, action_space="one_hot")
        loss = DQNLoss(value, action_space="one_hot", delay_value=True)
        greedy = EGreedyModule(spec, eps_init=1.0, eps_end=0.1, annealing_num_steps=1000)
        from tensordict.nn import TensorDictSequential

        policy = TensorDictSequential(value, greedy)
    elif algo == "iql":
        actor = _gaussian(TanhNormal, spec=spec)
        loss, policy = IQLLoss(actor, _qvalue(), _value(), num_qvalue_nets=2), actor
    elif algo == "cql":
        actor = _gaussian(TanhNormal, spec=spec)
        loss, policy = CQLLoss(actor, _qvalue(), action_spec=spec), actor
    else:
        raise KeyError(algo)
    collector = Collector(env_fn, policy, frames_per_batch=frames, total_frames=-1)
    env.close()
    updater = SoftUpdate(loss, tau=0.05) if algo not in ON_POLICY else None
    params = lambda prefix: [p for n, p in loss.named_parameters() if n.startswith(prefix)]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if algo in ON_POLICY:
            cls = PPOTrainer if algo == "ppo" else A2CTrainer
            return cls(collector=collector, optim_steps_per_batch=None, loss_module=loss,
                       optimizer=torch.optim.Adam(loss.parameters(), lr=LR), num_epochs=EPOCHS, **common)
        optimizer = torch.optim.Adam(loss.parameters(), lr=LR)
        off = dict(collector=collector, optim_steps_per_batch=None, loss_module=loss, target_net_updater=updater,
                   **common)
        if algo == "td3":
            stepper = TD3OptimizationStepper(torch.optim.Adam(params("actor_network_params"), lr=LR),
                                             torch.optim.Adam(params("qvalue_network_params"), lr=LR),
                                             policy_update_delay=2)
            return TD3Trainer(optimization_stepper=stepper, **off)
        if algo == "dqn":
            return DQNTrainer(optimizer=optimizer, greedy_module=greedy, **off)
        cls = {"sac": SACTrainer, "ddpg": DDPGTrainer, "iql": IQLTrainer, "cql": CQLTrainer}[algo]
        return cls(optimizer=optimizer, **off)


def _rank_data(algo: str, rank: int, step: int) -> TensorDict:
    """Rank ``rank``'s share of fixed batch ``step``: on-policy ``[ENVS/2, T]``, off-policy ``K * B / 2`` flat."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    obs_dim, act_dim = (4, 2) if algo == "dqn" else (3, 1)
    shape = [ENVS // 2, T] if algo in ON_POLICY else [K * B // 2]
    done = torch.zeros(*shape, 1, dtype=torch.bool)
    nxt = {"observation": torch.randn(*shape, obs_dim, generator=g), "reward": torch.randn(*shape, 1, generator=g),
           "done": done, "terminated": done.clone(), "truncated": done.clone(),
           "reward_sum": torch.randn(*shape, 1, generator=g), "step_count": torch.zeros(*shape, 1, dtype=torch.int64)}
    if algo == "dqn":
        action = nn.functional.one_hot(torch.randint(2, shape, generator=g), 2)
    else:
        action = torch.rand(*shape, act_dim, generator=g) * 3.6 - 1.8
    td = TensorDict({"observation": torch.randn(*shape, obs_dim, generator=g), "action": action, "next": nxt}, shape)
    if algo in ON_POLICY:
        td["action_log_prob"] = -torch.rand(*shape, generator=g) - 1.0
        td["next", "observation"][:, :-1] = td["observation"][:, 1:]  # trajectories
    return td


def data(algo: str, step: int, rank: int | None = None) -> TensorDict:
    """Fixed batch ``step``: this ``rank``'s half, or (``None``) the full batch of one process.

    The full off-policy batch interleaves the ranks' blocks of ``B / 2``, so that minibatch ``k``
    of one process (``B`` in order) is the union of the ranks' minibatches ``k``.
    """
    if rank is not None:
        return _rank_data(algo, rank, step)
    parts = [_rank_data(algo, r, step) for r in range(2)]
    if algo in ON_POLICY:
        return torch.cat(parts, 0)
    half = B // 2
    return torch.cat([p[k * half:(k + 1) * half] for k in range(K) for p in parts], 0)


def feed(trainer, batch: TensorDict) -> None:
    """One iteration of the trainer's loop on ``batch`` instead of a collected one (hooks and all)."""
    batch = trainer._process_batch_hook(batch)
    trainer.collected_frames += batch.numel() * getattr(trainer, "world_size", 1)
    trainer.optim_steps(batch)
    trainer._post_steps_hook()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the loss (targets included), detached copies."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def run_fed(trainer, algo: str, rank: int | None, steps: int = BATCHES) -> dict:
    """Feed the fixed batches; what each update output and the final state."""
    outputs = []
    learner = getattr(trainer, "learner", None)
    if learner is not None:
        update = learner.update

        def recording(batch):
            out = update(batch)
            outputs.append({k: v.clone() for k, v in out.items() if str(k).startswith("grad_norm")})
            return out

        learner.update = recording
    for step in range(steps):
        torch.manual_seed(step)  # the same draws on every rank and in the reference
        feed(trainer, data(algo, step, rank))
    greedy = getattr(trainer, "greedy_module", None)
    return {"outputs": outputs, "optim_count": trainer._optim_count,
            "updates": learner.num_updates if learner is not None else None,
            "eps": None if greedy is None else float(greedy.eps)}


def main(out_dir: str, strategy: str) -> None:
    from fabric_learner import FabricLearner
    from fabric_learner.from_torchrl import learner_trainer

    make = functools.partial(FabricLearner, accelerator="cpu", devices=2, strategy=strategy, timeout=120)
    results = {}
    rank = None
    for algo in ALGOS:
        trainer = learner_trainer(build(algo, world_size=2), make)
        learner = trainer.learner
        rank = learner.global_rank
        result = run_fed(trainer, algo, rank)
        result["model"] = {k: v.clone() for k, v in learner.checkpoint()["model"].items()}
        trainer.collector.shutdown()
        # a short run on the real environment, every hook live (collector, logging, weight publishing)
        trainer = learner_trainer(build(algo, world_size=2, seed=1), make)
        trainer.train()
        learner = trainer.learner
        result["train"] = {"frames": trainer.collected_frames, "updates": learner.num_updates,
                           "model": {k: v.clone() for k, v in learner.checkpoint()["model"].items()}}
        results[algo] = result
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
