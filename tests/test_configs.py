"""torchrl's Hydra trainer configs run on a learner, distributed by one config line.

Each config of examples/hydra/config (torchrl's PPO, A2C, Reinforce, DQN, SAC and TD3 trainers on
gymnasium envs) is run on 2 real gloo ranks under one of the launchers, for a few batches (some
configs share a launch): the ranks agree on the weights and count the frames of both.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from hydra.utils import instantiate
from multiproc import RELAY, WORKERS, fabric_run, forked_ranks, plain_python, run, torchrun

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.configs import FabricLearnerConfig, LocalLearnerConfig
from fabric_learner.from_torchrl import optimizer_factory

SCRIPT = os.path.join(WORKERS, "hydra_configs.py")


def test_learner_configs_instantiate_to_learner_factories():
    local = instantiate(LocalLearnerConfig(clip_grad_norm=0.5, grad_accum_steps=2))
    fabric = instantiate(FabricLearnerConfig(accelerator="cpu", strategy="fsdp", devices=2, precision="bf16-mixed",
                                             timeout=30.0, on_nonfinite="skip"))
    assert local.func is LocalLearner and local.keywords["clip_grad_norm"] == 0.5 and local.keywords["grad_accum_steps"] == 2
    assert fabric.func is FabricLearner
    assert {k: fabric.keywords[k] for k in ("accelerator", "strategy", "devices", "precision", "timeout", "on_nonfinite")} \
        == {"accelerator": "cpu", "strategy": "fsdp", "devices": 2, "precision": "bf16-mixed", "timeout": 30.0,
            "on_nonfinite": "skip"}


def test_the_learner_group_is_registered_beside_torchrls_configs():
    from hydra.core.config_store import ConfigStore

    groups = ConfigStore.instance().repo
    assert {"local.yaml", "fabric.yaml"} <= set(groups["learner"])
    assert {"ppo.yaml", "a2c.yaml", "reinforce.yaml", "dqn.yaml", "sac.yaml", "td3.yaml"} <= set(groups["trainer"])


def test_the_learners_optimizer_is_built_like_the_trainers():
    params = [torch.nn.Parameter(torch.zeros(2))]
    made = optimizer_factory(torch.optim.Adam(params, lr=3e-4, eps=1e-5))([torch.nn.Parameter(torch.zeros(3))])
    assert type(made) is torch.optim.Adam and made.defaults["lr"] == 3e-4 and made.defaults["eps"] == 1e-5
    two_groups = torch.optim.SGD([{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
    with pytest.raises(ValueError, match="2 parameter groups"):
        optimizer_factory(two_groups)


LAUNCHES = {
    # config, launcher, strategy, more configs run after it in the same launch: the launcher gives
    # the world, one config line the learner; one launch per launcher (every algorithm trainer runs
    # under both strategies in test_from_torchrl.py)
    "ppo-python-ddp": ("ppo", "python", "ddp", ["dqn"]),
    "sac-torchrun-fsdp": ("sac", "torchrun", "fsdp", ["dqn", "reinforce"]),
    "td3-fabric-run-fsdp": ("td3", "fabric-run", "fsdp", ["a2c"]),
}


@pytest.mark.parametrize("case", list(LAUNCHES))
def test_a_torchrl_trainer_config_runs_on_two_ranks_by_adding_a_learner(case):
    """Every config of examples/hydra/config: PPO, DQN, SAC, TD3, and torchrl's A2C and Reinforce
    configs (``trainer: a2c`` / ``trainer: reinforce``, PPO's networks), DQN under DDP and FSDP."""
    config, how, strategy, also = LAUNCHES[case]
    frames = 1024 if config == "ppo" else 512
    args = ["--config-name", config, "learner=fabric", f"trainer.total_frames={frames}"]
    # under torchrun and fabric run the ranks are forked from the test zygote (tests/zygote_rank.py); under plain
    # python rank 0 is, and it starts rank 1 itself (Lightning's command for a Hydra program)
    timeout, also_env = 240 + 120 * len(also), ",".join(also)
    if how == "python":
        proc = plain_python(SCRIPT, *args, f"learner.strategy={strategy}", "learner.devices=2",
                            "learner.accelerator=cpu", timeout=timeout, FL_ALSO_CONFIGS=also_env)
    else:
        cmd = (torchrun(RELAY, SCRIPT, *args, f"learner.strategy={strategy}") if how == "torchrun"
               else fabric_run(RELAY, SCRIPT, *args, strategy=strategy))
        proc = run(cmd, timeout=timeout, FL_ALSO_CONFIGS=also_env, **forked_ranks())
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", proc.stdout)]
    assert [r["config"] for r in results if r["rank"] == 0] == [config, *also], proc.stdout[-4000:]
    for name in (config, *also):
        ranks = sorted((r for r in results if r["config"] == name), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], (name, proc.stdout[-4000:])
        for r in ranks:
            assert r["world_size"] == 2 and r["learner"] == "FabricLearner" and r["sharded"] == (strategy == "fsdp")
            assert r["frames"] == frames and r["updates"] > 0
            assert r["stages"] == (["critic", "actor"] if name == "td3" else [])  # TD3's two optimizers
        assert ranks[0]["checksum"] == ranks[1]["checksum"] and ranks[0]["updates"] == ranks[1]["updates"], name
