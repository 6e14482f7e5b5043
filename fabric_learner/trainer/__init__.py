"""``fabric_learner.Trainer``: torchrl's Trainer driven by a Learner (``trainer``: construction and the
loop), what its ranks agree on (``ranks``), its checkpoints (``checkpoints``), the asynchronous loop
(``async_loop``), its hooks (``hooks``) and the Fabric logger adapter (``logging``)."""

from fabric_learner.checkpoint.trainer_state import CHECKPOINT_FORMAT
from fabric_learner.trainer.hooks import GlobalLogScalar, LearnerStepper, LogThroughput
from fabric_learner.trainer.logging import FabricLoggerAdapter
from fabric_learner.trainer.trainer import Trainer

__all__ = ["CHECKPOINT_FORMAT", "FabricLoggerAdapter", "GlobalLogScalar", "LearnerStepper", "LogThroughput", "Trainer"]
