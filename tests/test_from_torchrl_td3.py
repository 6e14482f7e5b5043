"""torchrl's TD3Trainer driven by a learner: its TD3OptimizationStepper becomes two stages."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, ValueOperator
from torchrl.objectives import SoftUpdate, TD3Loss
from torchrl.trainers.algorithms.td3 import TD3OptimizationStepper, TD3Trainer

from fabric_learner import LocalLearner
from fabric_learner.from_torchrl import learner_trainer


def td3_trainer(clip_norm=1.0):
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter(max_steps=50))
    actor = TensorDictModule(nn.Sequential(MLP(in_features=3, out_features=1, num_cells=[32]), nn.Tanh()),
                             in_keys=["observation"], out_keys=["action"])
    qvalue = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[32]), in_keys=["observation", "action"])
    loss = TD3Loss(actor, qvalue, action_spec=env.action_spec, num_qvalue_nets=2)
    params = lambda prefix: [p for n, p in loss.named_parameters() if n.startswith(prefix)]  # noqa: E731
    stepper = TD3OptimizationStepper(torch.optim.Adam(params("actor_network_params"), lr=1e-3),
                                     torch.optim.Adam(params("qvalue_network_params"), lr=1e-3), policy_update_delay=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TD3Trainer(collector=Collector(env, actor, frames_per_batch=32, total_frames=-1),
                          total_frames=32 * 3, frame_skip=1, optim_steps_per_batch=4, loss_module=loss,
                          optimization_stepper=stepper, target_net_updater=SoftUpdate(loss, tau=0.05),
                          replay_buffer=TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=16),
                          clip_norm=clip_norm, progress_bar=False, enable_logging=False, log_rewards=False,
                          log_actions=False)


def test_td3_trainer_runs_on_a_learner_with_the_actor_stepped_every_second_update():
    torchrl_trainer = td3_trainer()
    trainer = learner_trainer(torchrl_trainer, LocalLearner, progress_bar=False)
    learner = trainer.learner
    assert [s.name for s in learner.stages] == ["critic", "actor"] and learner.stages[1].every == 2
    assert [s.clip_grad_norm for s in learner.stages] == [1.0, 1.0]
    actor = {k: v.clone() for k, v in learner.loss_module.state_dict().items() if k.startswith("actor_network_params")}
    steps = {"critic": 0, "actor": 0}
    original = learner._optimizer_step

    def count(optimizer=None):
        for name, each in learner.optimizer.by_stage.items():
            steps[name] += each is optimizer
        original(optimizer)

    learner._optimizer_step = count
    trainer.train()
    assert learner.num_updates == 12 and steps == {"critic": 12, "actor": 6}
    now = learner.loss_module.state_dict()
    assert any(not torch.equal(now[k], v) for k, v in actor.items())
    trainer.collector.shutdown()


def test_a_trainer_clipping_by_value_is_refused_by_name():
    torchrl_trainer = td3_trainer()
    torchrl_trainer.clip_grad_norm = False
    with pytest.raises(NotImplementedError, match="by value"):
        learner_trainer(torchrl_trainer, LocalLearner, progress_bar=False)
    torchrl_trainer.collector.shutdown()
