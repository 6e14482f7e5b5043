"""The ported PPO MuJoCo recipe (examples/ppo_mujoco.py) updates exactly as torchrl's original loop.

The reference below is the recipe's loop as torchrl's sota-implementations/ppo/ppo_mujoco.py
writes it (collect, then per epoch: GAE, refill the buffer, minibatches without replacement,
learning rate annealed before each update, the actor and critic losses backpropagated
separately into two Adams), rewritten here; the port runs the same networks on LocalLearner and
fabric_learner.Trainer. With the same seeds the first 20 updates give the same losses and weights.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from multiproc import ROOT
from tensordict import TensorDict

sys.path.insert(0, os.path.join(ROOT, "examples"))
import ppo_mujoco as recipe

from fabric_learner import LocalLearner

UPDATES = 20
SEED = 3


def _args(*extra):
    # one batch of the published size; 10 epochs x 32 minibatches of 64, lr annealed over them
    return recipe.parse_args(["--frames", "2048", "--seed", str(SEED), "--no-progress", "--devices", "1", *extra])


def original_recipe_loop(args, n_updates):
    """torchrl's recipe loop, in this test's words; returns per-update losses and the weights after ``n_updates``."""
    torch.manual_seed(args.seed)
    actor, critic = recipe.make_models(recipe.make_env(args.env))
    loss_module, gae = recipe.make_loss(actor, critic)
    actor_optim = torch.optim.Adam(actor.parameters(), lr=args.lr, eps=1e-5)
    critic_optim = torch.optim.Adam(critic.parameters(), lr=args.lr, eps=1e-5)
    collector = torch_collector(args, actor)
    torch.manual_seed(collector.set_seed(args.seed, static_seed=False))  # what the Trainer's seed= does on rank 0
    buffer = recipe.TensorDictReplayBuffer(storage=recipe.LazyTensorStorage(args.frames_per_batch),
                                           sampler=recipe.SamplerWithoutReplacement(), batch_size=args.minibatch)
    total = (args.frames // args.frames_per_batch) * args.epochs * (args.frames_per_batch // args.minibatch)
    losses, done = [], 0
    for data in collector:
        for _ in range(args.epochs):
            with torch.no_grad():
                data = gae(data)
            buffer.extend(data.reshape(-1))
            for minibatch in buffer:
                lr = args.lr * (1 - done / total)
                for optim in (actor_optim, critic_optim):
                    for group in optim.param_groups:
                        group["lr"] = lr
                out = loss_module(minibatch)
                (out["loss_objective"] + out["loss_entropy"]).backward()
                out["loss_critic"].backward()
                for optim in (actor_optim, critic_optim):
                    optim.step()
                    optim.zero_grad()
                losses.append({k: float(v.detach()) for k, v in out.items() if k.startswith("loss_")})
                done += 1
                if done == n_updates:
                    collector.shutdown()
                    return losses, TensorDict.from_module(loss_module).clone()
    raise AssertionError("the batch ran out before the updates did")


def torch_collector(args, actor):
    env = recipe.make_env(args.env)
    env.set_seed(args.seed)  # as the port: the collector resets the env on creation
    return recipe.Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=-1,
                            max_frames_per_traj=-1, auto_register_policy_transforms=False)


def ported_recipe(args, n_updates):
    learner, trainer, _ = recipe.build(args, {}, learner_cls=LocalLearner)
    losses, snapshot = [], {}
    update = learner.update

    def recorded(batch):  # records what the Trainer's steps return; the step itself is the learner's
        out = update(batch)
        if len(losses) < n_updates:
            losses.append({k: float(v.detach()) for k, v in out.items() if k.startswith("loss_")})
            if len(losses) == n_updates:
                snapshot["weights"] = TensorDict.from_module(learner.loss_module).clone()
        return out

    learner.update = recorded
    trainer.train()
    return losses, snapshot["weights"], learner


# "global": the advantages standardised by fabric_learner's hook over all ranks (here one) instead of by the loss
@pytest.mark.parametrize("advantage_norm", ["rank", "global"])
def test_the_ported_recipe_updates_as_the_original_loop_for_20_updates(advantage_norm):
    ref_losses, ref_weights = original_recipe_loop(_args(), UPDATES)
    losses, weights, learner = ported_recipe(_args("--advantage-norm", advantage_norm), UPDATES)
    assert learner.num_updates == 10 * 32  # the whole batch: 10 epochs of 2048 / 64 minibatches
    assert len(losses) == UPDATES and losses[0].keys() == ref_losses[0].keys()
    for i, (ours, theirs) in enumerate(zip(losses, ref_losses)):
        for key in theirs:
            assert abs(ours[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (i, key, ours[key], theirs[key])
    assert ref_losses[0] != ref_losses[-1]  # they really trained
    for key, ref in ref_weights.items(True, True):
        torch.testing.assert_close(weights[key], ref, rtol=1e-5, atol=1e-6, msg=f"weight {key}")
