"""Train torchrl losses on one CPU, one GPU, or many GPUs under DDP or FSDP, unchanged.

The public names are imported on first use (PEP 562, ``fabric_learner.utils.lazy``): a process that needs
only part of the package (a collector node, a collector's driver) does not import Lightning or the
learner. ``from fabric_learner import X``, ``fabric_learner.X`` and ``fabric_learner.<submodule>`` work
as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_learner.utils.lazy import lazy
from fabric_learner.utils.quiet import quiet as _quiet

# each public name, by the module that defines it
_HOMES = {
    "AsyncCollection": "asynchronous", "VersionedPolicy": "asynchronous", "Capabilities": "learner",
    "FabricLearner": "fabric", "Learner": "learner", "LearnerLostError": "remote", "LearnerTimeoutError": "remote",
    "LocalLearner": "local", "RemoteCollectors": "remote", "RemoteLearner": "remote", "ShardedLoss": "sharding",
    "Stage": "step.stages", "TorchPrioritizedSampler": "replay", "Trainer": "trainer", "launcher": "launch.build",
    "shard_loss": "sharding", "whole_world": "sharding",
}
__all__ = ["AsyncCollection", "Capabilities", "FabricLearner", "Learner", "LearnerLostError", "LearnerTimeoutError",
           "LocalLearner", "RemoteCollectors", "RemoteLearner", "ShardedLoss", "Stage", "TorchPrioritizedSampler", "Trainer",
           "VersionedPolicy", "launcher", "shard_loss", "whole_world"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see
    from fabric_learner.asynchronous import AsyncCollection, VersionedPolicy
    from fabric_learner.fabric import FabricLearner
    from fabric_learner.launch.build import launcher
    from fabric_learner.learner import Capabilities, Learner
    from fabric_learner.local import LocalLearner
    from fabric_learner.remote import LearnerLostError, LearnerTimeoutError, RemoteCollectors, RemoteLearner
    from fabric_learner.replay import TorchPrioritizedSampler
    from fabric_learner.sharding import ShardedLoss, shard_loss, whole_world
    from fabric_learner.step.stages import Stage
    from fabric_learner.trainer import Trainer


__getattr__, __dir__ = lazy(globals(), _HOMES)


_quiet()
