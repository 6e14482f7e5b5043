"""Where a FabricLearner's parameters live: one backend per placement, chosen from the strategy.

``replicated``: one device or DDP, every rank holds the whole loss. ``sharded``: FSDP2, each
rank holds a shard of what the loss trains. Both answer the same questions for
``FabricLearner`` (set-up, parameters, full weights, model and optimizer state, saving), so the
learner itself never branches on the placement.
"""

from fabric_learner.backends.replicated import ReplicatedBackend
from fabric_learner.backends.sharded import ShardedBackend, is_sharded_strategy

__all__ = ["ReplicatedBackend", "ShardedBackend", "is_sharded_strategy"]
