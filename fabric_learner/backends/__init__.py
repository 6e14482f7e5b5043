"""Where a FabricLearner's parameters live: one backend per placement, chosen from the strategy.

``replicated``: one device or DDP, every rank holds the whole loss. ``sharded``: FSDP2, each rank
holds a shard of what the loss trains. Both implement ``base.Backend``, so the learner never
branches on the placement; ``backend_for`` picks one from the strategy's class.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import ModelParallelStrategy, Strategy

from fabric_learner.backends.base import Backend, Counters, Resumed, Setup
from fabric_learner.backends.replicated import ReplicatedBackend
from fabric_learner.backends.sharded import ShardedBackend

__all__ = ["Backend", "Counters", "ReplicatedBackend", "Resumed", "Setup", "ShardedBackend", "backend_for",
           "register_backend"]

_BACKENDS: dict[type, type] = {}


def register_backend(strategy_type: type, backend: type) -> None:
    """Use ``backend`` for strategies of ``strategy_type`` (and its subclasses without their own).

    Examples:
        >>> from lightning.fabric.strategies import DDPStrategy
        >>> from fabric_learner.backends import ReplicatedBackend, backend_for, register_backend
        >>> class MyDDP(DDPStrategy): ...
        >>> class MyBackend(ReplicatedBackend): ...
        >>> register_backend(MyDDP, MyBackend)
        >>> backend_for(MyDDP()).__name__, backend_for(DDPStrategy()).__name__
        ('MyBackend', 'ReplicatedBackend')
    """
    _BACKENDS[strategy_type] = backend


def backend_for(strategy: Any) -> type:
    """The backend class registered for the nearest class of ``strategy``'s MRO.

    Examples:
        >>> from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
        >>> from fabric_learner.backends import backend_for
        >>> backend_for(SingleDeviceStrategy()).__name__, backend_for(DDPStrategy()).__name__
        ('ReplicatedBackend', 'ReplicatedBackend')
        >>> backend_for(ModelParallelStrategy(parallelize_fn=lambda module, mesh: module)).__name__
        'ShardedBackend'
    """
    for cls in type(strategy).__mro__:
        if cls in _BACKENDS:
            return _BACKENDS[cls]
    raise TypeError(f"No fabric_learner backend for the strategy {type(strategy).__name__}; nothing was launched. "
                    "Use a Fabric strategy (single device, DDP or ModelParallelStrategy).")


register_backend(Strategy, ReplicatedBackend)
register_backend(ModelParallelStrategy, ShardedBackend)
