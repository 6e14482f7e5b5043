"""PPO on torchrl's PendulumEnv under DDP: every rank collects its own rollouts and learns.

    python examples/ppo_pendulum.py                       # launches 2 CPU ranks itself (DDP)
    fabric run --accelerator=cpu --strategy=ddp --devices=2 examples/ppo_pendulum.py
    torchrun --nproc-per-node=2 examples/ppo_pendulum.py

The loss code is plain torchrl; only the FabricLearner line knows about distribution.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.data import Unbounded
from torchrl.envs import PendulumEnv, SerialEnv, StepCounter, Transform, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from fabric_learner import FabricLearner


class PendulumObservation(Transform):
    """``observation = [cos th, sin th, thdot]`` from the raw pendulum state."""

    def __init__(self):
        super().__init__(in_keys=["th", "thdot"], out_keys=["observation"])

    def _call(self, td):
        th, thdot = td.get("th"), td.get("thdot")
        return td.set("observation", torch.stack([th.cos(), th.sin(), thdot / 8.0], -1))

    def _reset(self, td, td_reset):
        return self._call(td_reset)

    def transform_observation_spec(self, spec):
        spec["observation"] = Unbounded(shape=(*spec.shape, 3), dtype=torch.float32, device=spec.device)
        return spec


def make_env(num_envs: int):
    def one():
        return TransformedEnv(PendulumEnv(), PendulumObservation())

    return TransformedEnv(SerialEnv(num_envs, one), StepCounter(max_steps=200))


def make_agent(action_spec):
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[64, 64], activation_class=nn.Tanh), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=action_spec, distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0}, return_log_prob=True,
    )
    critic = ValueOperator(MLP(in_features=3, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh), in_keys=["observation"])
    return actor, critic


def launcher_kwargs(args) -> dict:
    """No strategy arguments under `fabric run` / `torchrun`: the launcher decides."""
    if "LT_CLI_USED" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return {}
    return {"accelerator": "cpu", "strategy": args.strategy, "devices": args.devices}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=int(os.environ.get("DEMO_ITERATIONS", 10)))
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # same initial weights on every rank
    env = make_env(args.envs)
    actor, critic = make_agent(env.action_spec)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=1e-3, normalize_advantage=True)
    gae = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False)
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-3), policy=actor,
                            clip_grad_norm=0.5, **launcher_kwargs(args))
    rank, world = learner.global_rank, learner.world_size
    torch.manual_seed(args.seed + 1000 * rank)  # each rank explores differently
    env.set_seed(args.seed + 1000 * rank)

    steps_per_rollout, epochs, minibatch = 200, 4, 200
    start, first_reward = time.time(), None
    for it in range(args.iterations):
        with torch.no_grad():
            rollout = env.rollout(steps_per_rollout, actor, break_when_any_done=False)
            gae(rollout)
        reward = rollout["next", "reward"].sum(-2).mean()  # mean episode return on this rank
        reward = learner.fabric.all_reduce(reward, reduce_op="mean")
        first_reward = reward.item() if first_reward is None else first_reward
        flat = rollout.reshape(-1)
        for _ in range(epochs):
            for idx in torch.randperm(flat.shape[0]).split(minibatch):
                out = learner.update(flat[idx])
        if rank == 0 and (it % 5 == 0 or it == args.iterations - 1):
            print(f"iter {it:3d}  return {reward.item():8.1f}  loss_objective {out['loss_objective'].item():+.3f}"
                  f"  grad_norm {out['grad_norm'].item():.3f}", flush=True)
    if rank == 0:
        print(f"done: {world} rank(s), {learner.num_updates} updates, return {first_reward:.1f} -> "
              f"{reward.item():.1f} in {time.time() - start:.0f}s")
    learner.close() if hasattr(learner, "close") else None


if __name__ == "__main__":
    main()
