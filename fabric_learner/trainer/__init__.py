"""``fabric_learner.Trainer``: torchrl's Trainer driven by a Learner (``trainer``), its hooks
(``hooks``) and the Fabric logger adapter (``logging``)."""

from fabric_learner.trainer.hooks import GlobalLogScalar, LearnerStepper, LogThroughput
from fabric_learner.trainer.logging import FabricLoggerAdapter
from fabric_learner.trainer.trainer import CHECKPOINT_FORMAT, Trainer

__all__ = ["CHECKPOINT_FORMAT", "FabricLoggerAdapter", "GlobalLogScalar", "LearnerStepper", "LogThroughput", "Trainer"]
