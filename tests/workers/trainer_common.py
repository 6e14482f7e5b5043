"""A small deterministic environment and a DQN Trainer with a prioritized replay buffer.

Shared by the single-process tests and the 2-rank worker: every piece is seeded, so a run is a
pure function of (seed, rank), and a resumed run can be compared with an uninterrupted one.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from rl_cases import N_ACTIONS, OBS, make_loss
from tensordict import TensorDict
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import Composite, LazyTensorStorage, OneHot, TensorDictReplayBuffer, Unbounded
from torchrl.envs import EnvBase, StepCounter, TransformedEnv
from torchrl.modules import EGreedyModule
from torchrl.objectives import SoftUpdate
from torchrl.trainers import LogScalar, ReplayBufferTrainer, UpdateWeights

from fabric_learner.replay import TorchPrioritizedSampler
from fabric_learner.trainer import GlobalLogScalar, Trainer

NUM_ENVS, STEPS_PER_BATCH, MAX_STEPS = 4, 6, 5
FRAMES_PER_BATCH = NUM_ENVS * STEPS_PER_BATCH
RB_BATCH, OPTIM_STEPS, LR = 16, 3, 1e-2


class ChainEnv(EnvBase):
    """A stateless toy MDP: 4-d observation, 3 one-hot actions, deterministic dynamics.

    The whole state is the observation (carried in the tensordict), so a collector's in-flight
    tensordict can be checkpointed and restored. Resets draw from the env's own generator.
    """

    _supports_set_state = True

    def __init__(self, num_envs: int = NUM_ENVS, seed: int = 0):
        super().__init__(batch_size=torch.Size([num_envs]))
        n = (num_envs,)
        self.observation_spec = Composite(observation=Unbounded(shape=(*n, OBS)), shape=n)
        self.state_spec = Composite(observation=Unbounded(shape=(*n, OBS)), shape=n)
        self.action_spec = OneHot(N_ACTIONS, shape=(*n, N_ACTIONS))
        self.reward_spec = Unbounded(shape=(*n, 1))
        g = torch.Generator().manual_seed(1234)
        self.mix = torch.randn(OBS, OBS, generator=g) * 0.5
        self.push = torch.randn(N_ACTIONS, OBS, generator=g)
        self.rng = torch.Generator().manual_seed(seed)

    def _set_seed(self, seed):
        self.rng = torch.Generator().manual_seed(int(seed))

    def _reset(self, td, **kwargs):
        n = self.batch_size
        if kwargs.get("set_state") and td is not None and "observation" in td.keys():
            return td.select("observation").copy()
        obs = torch.randn(*n, OBS, generator=self.rng)
        return TensorDict({"observation": obs, "done": torch.zeros(*n, 1, dtype=torch.bool),
                           "terminated": torch.zeros(*n, 1, dtype=torch.bool)}, n)

    def _step(self, td):
        n = self.batch_size
        obs, action = td.get("observation"), td.get("action").to(torch.float32)
        nxt = torch.tanh(obs @ self.mix + action @ self.push)
        reward = (nxt[..., :1] - 0.1 * action[..., :1]).reshape(*n, 1)
        return TensorDict({"observation": nxt, "reward": reward, "done": torch.zeros(*n, 1, dtype=torch.bool),
                           "terminated": torch.zeros(*n, 1, dtype=torch.bool)}, n)


def make_env(seed: int = 0):
    return TransformedEnv(ChainEnv(seed=seed), StepCounter(max_steps=MAX_STEPS))


class RecordingLogger:
    """A torchrl-style logger that only remembers what it was asked to log."""

    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, step=None):
        self.calls.append((name, float(value), step))


def build_dqn(learner_factory, *, total_frames: int, save_file=None, seed: int = 0, record=None,
              save_interval: int = 10**9, logger=None, progress_bar: bool = False, own_policy_copy: bool = False,
              resume: bool = True, init_random_frames: int | None = None):
    """A DQN trainer: collector with epsilon-greedy exploration, prioritized replay, soft target updates.

    ``learner_factory(loss, optimizer_factory, policy)`` builds the learner. ``record`` (a list)
    receives ``(index, td_error)`` of every minibatch after the priority update.
    ``own_policy_copy``: the collector acts with a copy of the exploration policy (made before
    the learner is built, as a sharded learner empties the loss's own parameters), which the
    trainer refreshes from ``learner.get_weights`` after every batch; otherwise it runs the
    loss's own Q-network in place (shared memory, DDP/local), plus torchrl's ``UpdateWeights``.
    """
    import copy

    loss, qnet = make_loss("dqn", seed=0)  # same initial weights on every rank
    env = make_env()
    explore = TensorDictSequential(qnet, EGreedyModule(env.action_spec, eps_init=0.3, eps_end=0.3))
    acting = copy.deepcopy(explore) if own_policy_copy else explore
    updater = SoftUpdate(loss, tau=0.1)
    learner = learner_factory(loss, functools.partial(torch.optim.Adam, lr=LR), explore if own_policy_copy else qnet)
    collector = Collector(env, acting, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1,
                          auto_register_policy_transforms=False, init_random_frames=init_random_frames)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), sampler=TorchPrioritizedSampler(1000, alpha=0.7, beta=0.5),
                                priority_key="td_error", batch_size=RB_BATCH)
    trainer = Trainer(learner=learner, collector=collector, total_frames=total_frames, optim_steps_per_batch=OPTIM_STEPS,
                      target_net_updater=updater, seed=seed, progress_bar=progress_bar, logger=logger,
                      save_trainer_file=save_file, save_trainer_interval=save_interval, log_interval=0,
                      resume=resume)
    ReplayBufferTrainer(rb, flatten_tensordicts=True).register(trainer)
    if record is not None:
        trainer.register_op("post_loss", lambda batch: record.append((batch["index"].clone(), batch["td_error"].clone())))
    LogScalar(("next", "reward"), "reward").register(trainer)
    GlobalLogScalar(("next", "reward"), "reward_all_ranks").register(trainer)
    trainer.register_op("pre_steps_log", _LocalRewardStats(trainer))
    if not own_policy_copy:
        UpdateWeights(collector, 1).register(trainer)  # torchrl's hook keeps working alongside PublishWeights
    return trainer, learner, loss, qnet, rb, collector


def policy_frames(collector) -> list[int]:
    """A list that grows as ``collector`` runs: the frames of each step its policy acted in (a step at
    random, within ``init_random_frames``, adds nothing)."""
    steps = []
    greedy = next(m for m in collector.policy.modules() if isinstance(m, EGreedyModule))
    greedy.register_forward_hook(lambda module, args, out: steps.append(out.numel()))
    return steps


def record_update_outputs(trainer, learner) -> list[tuple[int, dict[str, float]]]:
    """A list that receives, for each ``learner.update`` the trainer makes on this rank, the frames the
    trainer had collected then (one value per batch) and the update's scalar outputs."""
    calls = []
    update = learner.update

    def recorded(batch):
        out = update(batch)
        calls.append((trainer.collected_frames, {k: out.get(k).item() for k in out.keys() if out.get(k).numel() == 1}))
        return out

    learner.update = recorded
    return calls


class _LocalRewardStats:
    """Remembers this rank's reward sum and count of the last batch (to check GlobalLogScalar)."""

    def __init__(self, trainer):
        trainer.local_reward = None

        def record(batch):
            r = batch["next", "reward"]
            trainer.local_reward = (r.sum().item(), r.numel())

        self.record = record

    def __call__(self, batch):
        self.record(batch)
        return None


def snapshot(trainer, learner, loss, qnet, rb, collector) -> dict:
    """Everything the tests compare between ranks and between runs."""
    from fabric_learner.weights import collector_policy

    sampler = rb._sampler
    n = len(rb)
    ckpt = learner.checkpoint()  # full state on every rank, also when sharded (a collective)
    acting = TensorDict.from_module(collector_policy(collector)).apply(lambda t: t.detach().clone())
    return {
        "params": {k: v.detach().clone() for k, v in ckpt["model"].items()},
        "optimizer": ckpt["optimizer"],
        "num_updates": learner.num_updates,
        "optim_count": trainer._optim_count,
        "collected_frames": trainer.collected_frames,
        "rb_len": n,
        "rb_obs": rb[:n]["observation"].clone() if n else None,
        "priorities": sampler._sum_tree.values[:n].clone(),
        "max_priority": sampler._max_priority[0],
        "alpha": sampler._alpha, "eps": sampler._eps,
        "collector_weights": acting,
        "learner_weights": learner.get_weights(cpu_offload=False),
        "rng": torch.get_rng_state(),
        "progress_bar": trainer.progress_bar,
        "logged": list(getattr(trainer.logger, "calls", [])),
        "local_reward": trainer.local_reward,
        "history": {k: list(v) for k, v in trainer._log_dict.items() if k.startswith("reward")},
    }


# ---- point 4: global normalisation and partitions -------------------------------------------------

EQ_N, EQ_MINIBATCH, EQ_EPOCHS, EQ_SEED = 32, 8, 2, 77


def make_global_ppo(seed: int = 0):
    """ClipPPOLoss (per-sample losses) wrapped in GlobalMeanLoss with a validity mask."""
    from rl_cases import HIDDEN, _gaussian_actor
    from torchrl.modules import MLP, IndependentNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    from fabric_learner.onpolicy import GlobalMeanLoss

    torch.manual_seed(seed)
    actor = _gaussian_actor(IndependentNormal)
    critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=[HIDDEN]), in_keys=["observation"])
    inner = ClipPPOLoss(actor, critic, entropy_coeff=0.01, normalize_advantage=False, reduction="none")
    return GlobalMeanLoss(inner, mask_key="valid"), actor


def make_naive_ppo(seed: int = 0):
    """The rank-local way: the loss normalises advantages and averages over the local valid entries."""
    from rl_cases import HIDDEN, _gaussian_actor
    from torchrl.modules import MLP, IndependentNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(seed)
    actor = _gaussian_actor(IndependentNormal)
    critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=[HIDDEN]), in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic, entropy_coeff=0.01, normalize_advantage=True)
    loss.loss_mask_key = "valid"
    return loss, actor


def equivalence_batch() -> TensorDict:
    """32 PPO samples; the first half has most samples valid, the second few (uneven counts)."""
    from rl_cases import make_batch

    batch = make_batch("ppo", n=EQ_N, seed=5)
    g = torch.Generator().manual_seed(6)
    u = torch.rand(EQ_N, generator=g)
    p = torch.cat([torch.full((EQ_N // 2,), 0.8), torch.full((EQ_N // 2,), 0.3)])
    batch["valid"] = u < p
    batch["advantage"] = batch["advantage"] * 3 + torch.arange(EQ_N, dtype=torch.float32).unsqueeze(-1) / 8
    return batch
