"""torchrl's own loops for the learning benchmark (``benchmarks/learning.py``): the "torchrl" contender.

The loops torchrl's sota recipes write, by hand, in one process, over the recipes' own pieces
(``examples/ppo_mujoco.py``, ``examples/sac_mujoco.py``), so that only the loop and the optimisation step differ
from the learner's contenders: ``ppo_loop`` (``sota-implementations/ppo/ppo_mujoco.py`` as
``tests/test_ppo_recipe.py`` rewrites it) and ``sac_loop`` (``sota-implementations/sac/sac.py``). Each batch is
recorded before its updates, as the Trainer's ``pre_steps_log`` hook does; ``sac_loop`` also stops at a time budget
and resumes from its checkpoint, as the learners' Trainer does.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch
from tensordict import TensorDictBase

Record = Callable[[int, TensorDictBase], None]


def ppo_loop(args, record: Record) -> dict:
    """The PPO recipe's loop for ``args.frames`` frames (whole batches); returns its counts."""
    import ppo_mujoco as recipe

    torch.manual_seed(args.seed)
    actor, critic = recipe.make_models(recipe.make_env(args.env))
    loss_module, gae = recipe.make_loss(actor, critic)
    actor_optim = torch.optim.Adam(actor.parameters(), lr=args.lr, eps=1e-5)
    critic_optim = torch.optim.Adam(critic.parameters(), lr=args.lr, eps=1e-5)
    env = recipe.make_env(args.env)
    env.set_seed(args.seed)  # the collector resets it on creation
    collector = recipe.Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=-1,
                                 max_frames_per_traj=-1, auto_register_policy_transforms=False)
    torch.manual_seed(collector.set_seed(args.seed, static_seed=False))  # as the Trainer's seed= on one rank
    buffer = recipe.TensorDictReplayBuffer(storage=recipe.LazyTensorStorage(args.frames_per_batch),
                                           sampler=recipe.SamplerWithoutReplacement(), batch_size=args.minibatch)
    batches = args.frames // args.frames_per_batch
    total = batches * args.epochs * (args.frames_per_batch // args.minibatch)
    frames = updates = 0
    try:
        for i, data in enumerate(collector):
            frames += data.numel()
            record(frames, data)
            for _ in range(args.epochs):
                with torch.no_grad():
                    data = gae(data)
                buffer.extend(data.reshape(-1))
                for minibatch in buffer:
                    lr = args.lr * (1 - updates / total) if args.anneal_lr else args.lr
                    for optim in (actor_optim, critic_optim):
                        for group in optim.param_groups:
                            group["lr"] = lr
                    out = loss_module(minibatch)
                    (out["loss_objective"] + out["loss_entropy"]).backward()
                    out["loss_critic"].backward()
                    for optim in (actor_optim, critic_optim):
                        optim.step()
                        optim.zero_grad()
                    updates += 1
            if i + 1 == batches:
                break
    finally:
        collector.shutdown()
    return {"frames": frames, "updates": updates, "world_size": 1}


def sac_loop(args, recorder, *, budget_s: float = float("inf"), checkpoint: Path | None = None) -> dict:
    """The SAC recipe's loop for ``args.frames`` frames (whole batches); returns its counts and ``finished``.

    Past ``budget_s`` seconds of this call it stops after a batch and saves, at ``checkpoint``, what
    continues it: the loss's weights and targets, the optimizers, the replay buffer, the counters, the
    RNG states and ``recorder``'s curve; called again with that file there, it resumes from it. The
    environments start new episodes on resuming (at most 8 episodes in flight are cut short).
    """
    import numpy as np
    import sac_mujoco as recipe
    from torchrl.objectives import group_optimizers

    cfg = recipe.RECIPE
    torch.manual_seed(args.seed)
    env = recipe.make_env(args.env, args.envs)
    actor, qvalue = recipe.make_models(env)
    loss_module, target_updater = recipe.make_loss(actor, qvalue)
    env.set_seed(args.seed)
    collector = recipe.make_collector(env, actor, args.init_random_frames, {**cfg, "frames_per_batch": args.frames_per_batch})
    torch.manual_seed(collector.set_seed(args.seed, static_seed=False))
    buffer = recipe.make_buffer(args.frames + args.frames_per_batch)
    optimizer = group_optimizers(
        recipe.make_optimizer(list(loss_module.actor_network_params.flatten_keys().values())),
        recipe.make_optimizer(list(loss_module.qvalue_network_params.flatten_keys().values())),
        torch.optim.Adam([loss_module.log_alpha], lr=3.0e-4))
    batches = args.frames // args.frames_per_batch
    num_updates = int(args.frames_per_batch * cfg["utd_ratio"])
    frames = updates = done_batches = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        loss_module.load_state_dict(state["loss"])
        optimizer.load_state_dict(state["optimizer"])
        buffer.load_state_dict(state["buffer"])
        recorder.load_state_dict(state["recorder"])
        frames, updates, done_batches = state["frames"], state["updates"], state["batches"]
        collector.init_random_frames = max(0, args.init_random_frames - frames)  # the warm-up left
        collector.set_seed(args.seed + done_batches, static_seed=False)
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
    start = time.perf_counter()
    finished = done_batches >= batches
    try:
        for data in collector:
            if finished:
                break
            data = data.reshape(-1)
            frames += data.numel()
            recorder.record(frames, data)
            buffer.extend(data)
            if frames >= args.init_random_frames:
                for _ in range(num_updates):
                    loss_td = loss_module(buffer.sample())
                    (loss_td["loss_actor"] + loss_td["loss_qvalue"] + loss_td["loss_alpha"]).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    target_updater.step()
                    updates += 1
            done_batches += 1
            finished = done_batches >= batches
            if finished:
                break
            if time.perf_counter() - start > budget_s and checkpoint is not None:
                checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"loss": loss_module.state_dict(), "optimizer": optimizer.state_dict(),
                            "buffer": buffer.state_dict(), "recorder": recorder.state_dict(), "frames": frames,
                            "updates": updates, "batches": done_batches, "torch_rng": torch.get_rng_state(),
                            "numpy_rng": np.random.get_state()}, str(checkpoint) + ".tmp")
                os.replace(str(checkpoint) + ".tmp", checkpoint)
                break
    finally:
        collector.shutdown()
    return {"frames": frames, "updates": updates, "world_size": 1, "finished": finished}
