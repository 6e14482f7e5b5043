"""Runs examples/hydra/config/*.yaml through fabric_learner.configs and reports every rank.

``python hydra_configs.py --config-name ppo learner=fabric ...``: prints one RESULT line per rank
(world, updates, frames, a checksum of the full weights) so the test can check the ranks agree.
``FL_ALSO_CONFIGS=a2c,dqn`` runs those configs too, in the same processes and process group, with
the same command-line overrides, one after the other (one launch, several configs).
"""

from __future__ import annotations

import json
import os

import hydra

from fabric_learner.configs import instantiate_trainer

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "hydra", "config")


def train_and_report(cfg, name: str):
    trainer = instantiate_trainer(cfg)
    trainer.train()
    learner = trainer.learner
    weights = learner.get_weights(cpu_offload=False)  # a collective under FSDP: every rank calls it
    checksum = sum(float(t.double().sum()) for t in weights.values(True, True))
    print("RESULT " + json.dumps({"config": name, "rank": learner.global_rank, "world_size": learner.world_size,
                                  "learner": type(learner).__name__, "sharded": learner.capabilities.sharded,
                                  "updates": learner.num_updates, "frames": trainer.collected_frames,
                                  "stages": [s.name for s in learner.stages],
                                  "checksum": checksum}), flush=True)
    return learner


@hydra.main(config_path=CONFIGS, config_name="ppo", version_base="1.3")
def main(cfg) -> None:
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    learners = [train_and_report(cfg, hydra_cfg.job.config_name)]
    overrides = list(hydra_cfg.overrides.task)
    for name in filter(None, os.environ.get("FL_ALSO_CONFIGS", "").split(",")):
        # the group stays up between configs: the learners are closed together at the end
        learners.append(train_and_report(compose(config_name=name, overrides=overrides), name))
    for learner in learners:
        learner.close()


if __name__ == "__main__":
    main()
