"""Sharding plans: plain functions ``(module, mesh) -> module`` that decide where parameters live.

Plans are functions over a named mesh, in the shape torchtitan's ``apply_fsdp``/``apply_tp`` take;
what a model offers (its layers, a transformers model's decoder layers) is found by ``discovery``.
A user's plan (``ModelParallelStrategy(parallelize_fn=...)``) stays in user code.
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


def apply_fsdp(module: nn.Module, dp_mesh, min_unit_numel: int = MIN_UNIT_NUMEL, *,
               activation_checkpointing: bool = False, mp_policy=None) -> nn.Module:
    """``fully_shard`` over the data-parallel mesh ``dp_mesh``: each decoder layer, each large layer, then the root.

    Every decoder layer of a transformers model (``module.block_units()`` of a ``ShardedLoss``; for
    any other module, its submodules whose class a ``PreTrainedModel`` names in ``_no_split_modules``)
    is its own unit, whatever its size, resharded after its forward as FSDP2 does. Other layer units
    (``module.layer_units()`` outside those layers) holding at least ``min_unit_numel`` parameters get a
    unit of their own; the rest (embeddings, final norm and LM head of a small model, and layers that
    share a weight, as tied input and output embeddings do) is gathered with the root for the whole call.

    Args:
        module: the ``ShardedLoss`` a ``parallelize_fn`` receives, or a plain model (a frozen
            reference ``PreTrainedModel``), sharded in place.
        dp_mesh: a 1-D mesh of the data-parallel ranks (``whole_world(mesh)``), or ``None`` for the world.
        min_unit_numel: the size from which a layer outside the decoder layers gets its own unit.
        activation_checkpointing: recompute each decoder layer's forward in its backward instead of
            keeping its activations (a ``ShardedLoss``'s decoder layers only); gradients are unchanged.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit; ``None`` takes the one the
            learner derived from its precision (``module.mp_policy``, see ``precision_policy``), if any.

    Examples:
        A plan of one's own that shards over every rank, gives each layer its own unit and
        checkpoints each decoder layer's activations:

        >>> from lightning.fabric.strategies import ModelParallelStrategy
        >>> from fabric_learner.sharding import apply_fsdp, whole_world
        >>> def my_plan(module, mesh):
        ...     return apply_fsdp(module, whole_world(mesh), min_unit_numel=1, activation_checkpointing=True)
        >>> strategy = ModelParallelStrategy(parallelize_fn=my_plan)

        ``FabricLearner(loss, optimizer_factory, strategy=strategy, devices=2)`` then calls it on each
        rank with the ``ShardedLoss`` and Fabric's mesh (``fully_shard`` needs that process group).
    """
    from torch.distributed.fsdp import fully_shard

    from fabric_learner.sharding.discovery import decoder_blocks

    if mp_policy is None:
        mp_policy = getattr(module, "mp_policy", None)
    kwargs = {"mesh": dp_mesh, **({} if mp_policy is None else {"mp_policy": mp_policy})}
    owner = hasattr(module, "block_units")
    blocks = module.block_units() if owner else [block for _, block in decoder_blocks(module)]
    if activation_checkpointing and not owner:
        raise ValueError("activation_checkpointing=True applies to the decoder layers of a learner's ShardedLoss "
                         "(the module a parallelize_fn receives), not to a plain model; nothing was sharded. "
                         "Pass activation_checkpointing=False for a frozen model, which has no backward.")
    in_blocks = {id(unit) for block in blocks for unit in getattr(block, "layers", {}).values()}
    for block in blocks:
        if owner:
            block.__dict__["checkpointed"] = activation_checkpointing
            if any(unit.tied for unit in block.layers.values()):
                continue  # shares a weight with a layer outside it: gathered with the root
        fully_shard(block, reshard_after_forward=True, **kwargs)
    for unit in getattr(module, "layer_units", list)():
        if id(unit) not in in_blocks and not unit.tied and sum(p.numel() for p in unit.parameters()) >= min_unit_numel:
            fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    return module


def shard_loss(module: nn.Module, mesh, min_unit_numel: int = MIN_UNIT_NUMEL, *,
               activation_checkpointing: bool = False) -> nn.Module:
    """The default ``parallelize_fn``: one FSDP2 unit per decoder layer and per large layer, then one for the rest.

    ``fully_shard`` on each decoder layer of a transformers model in the loss (whatever its size),
    on each other layer unit holding at least ``min_unit_numel`` parameters (1M: 4 MiB in float32;
    a critic ensemble's layer counts all its members), then on the ``ShardedLoss`` itself: a large
    layer is gathered when the loss reaches it and freed after, as in hand-written per-layer FSDP2,
    so no rank ever holds the whole model. Smaller layers (and what no layer holds, e.g.
    ``log_alpha``) are gathered together for the loss call: for the small networks RL often trains,
    one all-gather costs less than one per layer, as FSDP's size-based wrapping policies trade it.
    ``functools.partial(shard_loss, min_unit_numel=1)`` gives every layer its own unit;
    ``functools.partial(shard_loss, activation_checkpointing=True)`` recomputes each decoder layer's
    activations in the backward. Under ``precision="bf16-mixed"``/``"bf16-true"`` every unit gets the
    learner's FSDP2 ``MixedPrecisionPolicy`` (see :func:`apply_fsdp`).

    Examples:
        >>> import functools
        >>> from lightning.fabric.strategies import ModelParallelStrategy
        >>> from fabric_learner import shard_loss
        >>> strategy = ModelParallelStrategy(parallelize_fn=functools.partial(shard_loss, min_unit_numel=1))
        >>> # FabricLearner(loss, optimizer_factory, strategy=strategy, devices=2) shards every layer alone
    """
    return apply_fsdp(module, whole_world(mesh), min_unit_numel, activation_checkpointing=activation_checkpointing)


def precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a Fabric precision, or ``None`` when parameters compute as stored.

    ``"bf16-mixed"``: parameters and their gradients stay float32 in the shards, each unit is
    gathered in bfloat16 for its forward and backward, and gradients are reduced in float32.
    ``"bf16-true"`` (``"16-true"``): Fabric has cast the parameters to bfloat16 (float16), so shards,
    gathers and gradients are in that dtype; the reduce-scatter runs in float32 before the cast.

    Examples:
        >>> from fabric_learner.sharding import precision_policy
        >>> policy = precision_policy("bf16-mixed")
        >>> policy.param_dtype, policy.reduce_dtype
        (torch.bfloat16, torch.float32)
        >>> precision_policy("32-true") is None
        True
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(str(precision))
    if low is None:
        return None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def check_sharded(module: ShardedLoss, world_size: int) -> None:
    """Raise at construction when the parallelize_fn's sharding would train wrongly; register its mesh.

    Every parameter must be sharded (a ``DTensor``), and over all data-parallel ranks: each of them
    feeds its own batch, so gradients must be averaged over all of them. Without tensor parallelism
    every rank is data-parallel. With it (parameters on a mesh with a ``"tp"``/``"tensor_parallel"``
    dimension, see ``sharding.mesh.ALIASES``), the data-parallel ranks are those of the mesh's other
    dimensions, and that mesh is registered (``use_mesh``), so the learner's sample and token counts
    and global means reduce over them only. Every parameter must then live on that one mesh (layers
    outside the tensor-parallel plan ``Replicate`` on its tensor-parallel dimension): torch's
    gradient norm cannot combine DTensors of different meshes.

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
    from fabric_learner.sharding.mesh import MODEL_PARALLEL, describe, tensor_parallel_size, use_mesh
    from fabric_learner.utils import compat as _compat

    params = list(module.named_loss_parameters())
    plain = [name for name, p in params if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(
            f"The strategy's parallelize_fn left these parameters unsharded: {plain[:8]}. It receives a "
            "fabric_learner ShardedLoss holding the loss's trainable parameters; call "
            "torch.distributed.fsdp.fully_shard on it (or use strategy='fsdp' for the default)."
        )
    tp = max((tensor_parallel_size(p.device_mesh) for _, p in params), default=1)
    data = world_size // tp
    narrow = [name for name, p in params if p.device_mesh.size() // tensor_parallel_size(p.device_mesh) != data]
    if narrow or world_size % tp:
        mesh = module.param(narrow[0]).device_mesh if narrow else None
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded {narrow[:4]} over a {describe(mesh) if mesh else 'mesh'}, but "
            f"{world_size} ranks run with {tp} tensor-parallel rank(s) per group, so {data} data-parallel ranks: "
            "every data-parallel rank feeds its own batch, so gradients must be averaged over all of them. "
            "fully_shard over the data-parallel ranks (fabric_learner.whole_world(mesh) without tensor "
            "parallelism, mesh['data_parallel'] with it), or use strategy='fsdp'."
        )
    if tp == 1:
        module.__dict__["mesh"] = None  # every rank feeds its own batch: "dp" is the whole world
        use_mesh(None)
        return
    # Compared by value: torch hands a parameter the equal mesh (same ranks and names) an earlier learner of
    # the process sliced, when its shape and placements match one of that learner's (a cache of its own).
    meshes = []
    for root in (_compat.root_mesh(p.device_mesh) for _, p in params if tensor_parallel_size(p.device_mesh) == tp):
        if not any(root == seen for seen in meshes):
            meshes.append(root)
    if len(meshes) != 1:
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded the loss's parameters over {len(meshes)} different meshes "
            f"({'; '.join(describe(m) for m in meshes)}); nothing was trained. Slice the data-parallel "
            "and tensor-parallel meshes of every parameter from the one mesh the parallelize_fn receives."
        )
    run_mesh = meshes[0]
    apart = [name for name, p in params if p.device_mesh != run_mesh]
    if apart:
        raise RuntimeError(
            f"The strategy's parallelize_fn left {apart[:4]} on the {describe(module.param(apart[0]).device_mesh)}, "
            f"the other parameters on the {describe(run_mesh)}: torch's gradient norm and clipping cannot combine "
            "DTensors of different meshes. Place every layer on the tensor-parallel mesh too "
            "(fabric_learner.sharding.parallelize_layers replicates the layers outside its plan by default)."
        )
    data_dims = [i for i, n in enumerate(run_mesh.mesh_dim_names) if n not in MODEL_PARALLEL]
    if all(p.placements[i].is_replicate() for _, p in params for i in data_dims):
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded every parameter along the tensor-parallel dimension of the "
            f"{describe(run_mesh)} and replicated it along the data-parallel one: that is HSDP over Lightning's "
            "mesh, whose second dimension the learner must take for tensor parallelism. For HSDP, fully_shard over "
            "init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=('replicate', 'shard')) "
            "(docs/meshes.md)."
        )
    module.__dict__["mesh"] = run_mesh  # registered again whenever this loss runs
    use_mesh(module.mesh)
