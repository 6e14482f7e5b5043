"""Train torchrl losses on one CPU, one GPU, or many GPUs under DDP or FSDP, unchanged.

The public names are imported on first use (PEP 562): a process that needs only part of the package (a
collector node, a collector's driver, a process torchrl spawns for its workers) does not pay for
Lightning's import, about 2 s of CPU in every fresh interpreter. ``from fabric_learner import X`` and
``fabric_learner.X`` behave as if everything had been imported at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fabric_learner import _warnings

# each public name, by the module that defines it
_HOMES = {
    "AsyncCollection": "asynchronous", "VersionedPolicy": "asynchronous", "Capabilities": "learner",
    "FabricLearner": "fabric", "Learner": "learner", "LearnerLostError": "remote", "LearnerTimeoutError": "remote",
    "LocalLearner": "local", "RemoteCollectors": "remote", "RemoteLearner": "remote", "ShardedLoss": "sharding",
    "Stage": "_stages", "TorchPrioritizedSampler": "replay", "Trainer": "trainer", "launcher": "_launch",
    "shard_loss": "sharding", "whole_world": "sharding",
}
__all__ = ["AsyncCollection", "Capabilities", "FabricLearner", "Learner", "LearnerLostError", "LearnerTimeoutError",
           "LocalLearner", "RemoteCollectors", "RemoteLearner", "ShardedLoss", "Stage", "TorchPrioritizedSampler", "Trainer",
           "VersionedPolicy", "launcher", "shard_loss", "whole_world"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see
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


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:  # a submodule not imported yet, as `import fabric_learner.llm` would give it
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_warnings.quiet()
