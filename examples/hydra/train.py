"""torchrl's Hydra trainer configs on a learner: one process, DDP or FSDP by one config line.

    python examples/hydra/train.py                                      # PPO on Pendulum-v1, torchrl's trainer as is
    python examples/hydra/train.py learner=local                        # the same, on LocalLearner
    python examples/hydra/train.py learner=fabric learner.strategy=ddp learner.devices=2 learner.accelerator=cpu
    fabric run --accelerator=cpu --strategy=fsdp --devices=2 examples/hydra/train.py learner=fabric
    torchrun --nproc-per-node=2 examples/hydra/train.py learner=fabric learner.strategy=fsdp
    python examples/hydra/train.py --config-name dqn learner=fabric ... # DQN on CartPole-v1

The configs are torchrl's (``trainer: ppo`` / ``trainer: dqn``, its env, network, loss, collector,
replay buffer and optimizer groups) plus ``learner: null`` in the defaults, which the command
line turns into a learner; ``fabric_learner.configs`` registers the ``learner`` group.
"""

from __future__ import annotations

import hydra

from fabric_learner.configs import instantiate_trainer


@hydra.main(config_path="config", config_name="ppo", version_base="1.3")
def main(cfg) -> None:
    trainer = instantiate_trainer(cfg)
    trainer.train()
    learner = getattr(trainer, "learner", None)
    if learner is None:
        print(f"done: torchrl's {type(trainer).__name__}, {trainer.collected_frames} frames", flush=True)
        return
    if learner.global_rank == 0:
        how = "one process" if not hasattr(learner, "fabric") else (
            "sharded (FSDP)" if learner.capabilities.sharded else type(learner.fabric.strategy).__name__)
        print(f"done: {learner.world_size} rank(s) {type(learner).__name__} {how}, {learner.num_updates} updates, "
              f"{trainer.collected_frames} frames", flush=True)
    if hasattr(learner, "close"):
        learner.close()


if __name__ == "__main__":
    main()
