"""Sharding plans: plain functions ``(module, mesh) -> module`` that decide where parameters live.

A plan never branches on the model: a new kind of model (a transformers decoder, a tensor-parallel
layout) is a new function over a named mesh, in the shape torchtitan's ``apply_fsdp``/``apply_tp``
take. A user's plan (``ModelParallelStrategy(parallelize_fn=...)``) stays in user code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner.sharding.mesh import whole_world

if TYPE_CHECKING:
    from fabric_learner.sharding.owner import ShardedLoss

#: Layers with fewer parameters than this share the ``ShardedLoss``'s unit (see ``shard_loss``).
MIN_UNIT_NUMEL = 1 << 20


def apply_fsdp(module: nn.Module, dp_mesh, min_unit_numel: int = MIN_UNIT_NUMEL) -> nn.Module:
    """``fully_shard`` over the data-parallel mesh ``dp_mesh``: each large layer unit, then the root.

    Units (``module.layer_units()``, when ``module`` is a ``ShardedLoss``) holding at least
    ``min_unit_numel`` parameters get a unit of their own, gathered only while the loss runs them;
    the rest is gathered together with the root for the whole call.

    Examples:
        A plan of one's own that shards over every rank and gives each layer its own unit:

        >>> from lightning.fabric.strategies import ModelParallelStrategy
        >>> from fabric_learner.sharding import apply_fsdp, whole_world
        >>> def every_layer_alone(module, mesh):
        ...     return apply_fsdp(module, whole_world(mesh), min_unit_numel=1)
        >>> strategy = ModelParallelStrategy(parallelize_fn=every_layer_alone)

        ``FabricLearner(loss, optimizer_factory, strategy=strategy, devices=2)`` then calls it on each
        rank with the ``ShardedLoss`` and Fabric's mesh (``fully_shard`` needs that process group).
    """
    from torch.distributed.fsdp import fully_shard

    for unit in getattr(module, "layer_units", list)():
        if sum(p.numel() for p in unit.parameters()) >= min_unit_numel:
            fully_shard(unit, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    return module


def shard_loss(module: nn.Module, mesh, min_unit_numel: int = MIN_UNIT_NUMEL) -> nn.Module:
    """The default ``parallelize_fn``: one FSDP2 unit per layer, then one for the rest.

    ``fully_shard`` on each of the ``ShardedLoss``'s layer units holding at least
    ``min_unit_numel`` parameters (1M: 4 MiB in float32; a critic ensemble's layer counts all its
    members), then on the ``ShardedLoss`` itself: a large layer is gathered when the loss reaches
    it and freed after, as in hand-written per-layer FSDP2, so no rank ever holds the whole model.
    Smaller layers (and what no layer holds, e.g. ``log_alpha``) are gathered together for the
    loss call: for the small networks RL often trains, one all-gather costs less than one per
    layer, as FSDP's size-based wrapping policies trade it.
    ``functools.partial(shard_loss, min_unit_numel=1)`` gives every layer its own unit.

    Examples:
        >>> import functools
        >>> from lightning.fabric.strategies import ModelParallelStrategy
        >>> from fabric_learner import shard_loss
        >>> strategy = ModelParallelStrategy(parallelize_fn=functools.partial(shard_loss, min_unit_numel=1))
        >>> # FabricLearner(loss, optimizer_factory, strategy=strategy, devices=2) shards every layer alone
    """
    return apply_fsdp(module, whole_world(mesh), min_unit_numel)


def check_sharded(module: ShardedLoss, world_size: int) -> None:
    """Raise at construction when the parallelize_fn's sharding would train wrongly.

    Every parameter must be sharded, and over all ``world_size`` ranks (each rank feeds its own
    batch, so gradients are averaged over all of them).

    Examples:
        A plan that forgot to shard is refused:

        >>> import torch
        >>> from fabric_learner.sharding import ShardedLoss, check_sharded
        >>> from fabric_learner.testing import dqn_example
        >>> owner = ShardedLoss(dqn_example()[0], torch.device("cpu"))
        >>> check_sharded(owner, world_size=1)
        Traceback (most recent call last):
            ...
        RuntimeError: The strategy's parallelize_fn left these parameters unsharded: [...]. It receives ...
    """
    plain = [name for name, p in module.named_loss_parameters() if not isinstance(p, DTensor)]
    narrow = [name for name, p in module.named_loss_parameters()
              if isinstance(p, DTensor) and p.device_mesh.size() != world_size]
    if narrow:
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded {narrow[:4]} over a mesh of "
            f"{module.param(narrow[0]).device_mesh.size()} ranks, but {world_size} ranks run: every "
            "rank feeds its own batch, so gradients must be averaged over all of them. Shard over the "
            "whole world (fabric_learner.whole_world(mesh)), or use strategy='fsdp'."
        )
    if plain:
        raise RuntimeError(
            f"The strategy's parallelize_fn left these parameters unsharded: {plain[:8]}. It receives a "
            "fabric_learner ShardedLoss holding the loss's trainable parameters; call "
            "torch.distributed.fsdp.fully_shard on it (or use strategy='fsdp' for the default)."
        )
