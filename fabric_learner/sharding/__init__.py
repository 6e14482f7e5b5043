"""How a torchrl loss is cut for FSDP2, independent of any backend.

``discovery`` finds a loss's networks and stacked ensembles, ``routing`` sends each layer's call
through its unit, ``owner`` holds the shards (``ShardedLoss``), ``plans`` are the functions that
shard it over a mesh, and ``mesh`` names the mesh's dimensions for collectives.
"""

from fabric_learner.sharding.mesh import (
    DATA_PARALLEL,
    TENSOR_PARALLEL,
    data_parallel_rank,
    process_group,
    use_mesh,
    whole_world,
)
from fabric_learner.sharding.owner import ShardedLoss
from fabric_learner.sharding.plans import apply_fsdp, check_sharded, precision_policy, shard_loss
from fabric_learner.sharding.tensor_parallel import parallelize_layers

__all__ = ["DATA_PARALLEL", "TENSOR_PARALLEL", "ShardedLoss", "apply_fsdp", "check_sharded", "data_parallel_rank",
           "parallelize_layers", "precision_policy", "process_group", "shard_loss", "use_mesh", "whole_world"]
