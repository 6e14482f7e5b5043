"""The SAC MuJoCo recipe on a learner (examples/sac_mujoco.py) acts as torchrl's own loop does.

The reference is the benchmark's ``torchrl`` contender (benchmarks/learning.py ``sac_loop``:
torchrl's sota-implementations/sac/sac.py by hand); the recipe runs torchrl's ``SACTrainer`` through
``learner_trainer`` on a one-process ``FabricLearner``, as the benchmark's ``learner`` contender does.
With the same seed, every batch collected after updates holds the same actions and observations,
which needs the same replay data and the same updates bit for bit: a random warm-up frame missing
from the buffer (torchrl 0.14.1's ``SACTrainer`` stores batches only once updates begin) changes the
actions of the first batch collected after an update.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from multiproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import learning
import sac_mujoco as recipe

from fabric_learner import FabricLearner

# 4 batches of 100 frames from 2 environments, the first 2 random; 100 updates after each of the last 3
ARGV = ["--frames", "400", "--frames-per-batch", "100", "--init-random-frames", "200", "--envs", "2", "--seed", "5",
        "--no-progress"]


class _Batches:
    """What each collected batch held, flattened: frames so far, actions, next observations."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def record(self, frames: int, batch) -> None:
        batch = batch.reshape(-1)
        self.seen.append((frames, batch.get("action").clone(), batch.get(("next", "observation")).clone()))


def test_the_recipe_on_a_learner_collects_the_same_batches_as_torchrls_loop():
    loop = _Batches()
    counts = learning.sac_loop(recipe.parse_args(ARGV), loop)

    args = recipe.parse_args(ARGV)
    trainer = recipe.build(args, functools.partial(FabricLearner, accelerator="cpu", devices=1, strategy="auto"),
                           world=1, rank=0)
    ours = _Batches()
    trainer.register_op("pre_steps_log", lambda batch: ours.record(trainer.collected_frames, batch) or {})
    trainer.train()
    learner = trainer.learner
    try:
        assert learner.num_updates == counts["updates"] == 300
        assert len(trainer._modules["replay_buffer"].replay_buffer) == 400  # the warm-up's 200 frames included
        assert [f for f, _, _ in ours.seen] == [f for f, _, _ in loop.seen] == [100, 200, 300, 400]
        for (frames, action, obs), (_, ref_action, ref_obs) in zip(ours.seen, loop.seen):
            assert torch.equal(action, ref_action), f"the actions of the batch ending at {frames} frames differ"
            assert torch.equal(obs, ref_obs), f"the observations of the batch ending at {frames} frames differ"
    finally:
        learner.close()
