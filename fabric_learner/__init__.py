"""Train torchrl losses on one CPU, one GPU, or many GPUs under DDP or FSDP, unchanged."""

from fabric_learner import _warnings
from fabric_learner._launch import launcher
from fabric_learner._stages import Stage
from fabric_learner.asynchronous import AsyncCollection, VersionedPolicy
from fabric_learner.fabric import FabricLearner
from fabric_learner.learner import Capabilities, Learner
from fabric_learner.local import LocalLearner
from fabric_learner.remote import LearnerLostError, LearnerTimeoutError, RemoteCollectors, RemoteLearner
from fabric_learner.replay import TorchPrioritizedSampler
from fabric_learner.sharding import ShardedLoss, shard_loss, whole_world
from fabric_learner.trainer import Trainer

__all__ = ["AsyncCollection", "Capabilities", "FabricLearner", "Learner", "LearnerLostError", "LearnerTimeoutError",
           "LocalLearner", "RemoteCollectors", "RemoteLearner", "ShardedLoss", "Stage", "TorchPrioritizedSampler", "Trainer",
           "VersionedPolicy", "launcher", "shard_loss", "whole_world"]
__version__ = "0.1.0"

_warnings.quiet()
