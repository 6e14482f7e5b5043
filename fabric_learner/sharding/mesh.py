"""Named meshes: which ranks a collective reduces over.

Every collective of the learner reduces over one named dimension of the run's device mesh:
``"dp"``, the data-parallel ranks, unless asked otherwise. Until a run registers a mesh with
more than one dimension (``use_mesh``), every rank is a data-parallel rank and ``"dp"`` is the
whole world, reduced over the default process group exactly as before meshes had names.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fabric_learner import _compat

#: The data-parallel dimension: ranks that each feed their own batch.
DATA_PARALLEL = "dp"

_mesh: Any = None  # the run's named DeviceMesh, set by use_mesh


def use_mesh(mesh: Any) -> None:
    """Make ``mesh`` (a ``DeviceMesh`` with ``mesh_dim_names``, or ``None``) the run's mesh.

    Examples:
        >>> from fabric_learner.sharding import use_mesh
        >>> use_mesh(None)  # no mesh: every rank is data-parallel
        >>> use_mesh(object())
        Traceback (most recent call last):
            ...
        ValueError: use_mesh needs a DeviceMesh with mesh_dim_names, e.g. init_device_mesh(..., ...

        On several ranks, ``use_mesh(init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp")))``
        makes collectives reduce over the 2 data-parallel ranks of each group instead of all 8.
    """
    global _mesh
    if mesh is not None and not getattr(mesh, "mesh_dim_names", None):
        raise ValueError("use_mesh needs a DeviceMesh with mesh_dim_names, e.g. init_device_mesh(..., "
                         "mesh_dim_names=('dp', 'tp')); nothing was registered.")
    _mesh = mesh


def process_group(dim: Any = DATA_PARALLEL) -> Any:
    """The process group of mesh dimension ``dim`` (a name), or ``dim`` itself when it is a group.

    ``None`` means the default group (the whole world): what ``"dp"`` is while no registered mesh
    names a data-parallel dimension smaller than the world. In a one-rank world every dimension is
    this process alone; with several ranks, a name the run's mesh lacks raises a ``ValueError``.

    Examples:
        >>> from fabric_learner.sharding import process_group
        >>> process_group("dp") is None  # one process, no mesh: the whole world
        True
        >>> process_group("tp") is None  # one process: every dimension holds this process alone
        True
    """
    if not isinstance(dim, str):
        return dim
    mesh = _mesh
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        if dim == DATA_PARALLEL or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None  # the whole world, or this process alone: every dimension has one rank
        raise ValueError(f"No mesh with a {dim!r} dimension is registered; nothing was reduced. Reduce over "
                         f"{DATA_PARALLEL!r} (the default) or register the run's mesh with use_mesh(mesh).")
    names = tuple(mesh.mesh_dim_names)
    if dim not in names:
        if dim == DATA_PARALLEL:
            return None
        raise ValueError(f"The run's mesh has dimensions {names}, not {dim!r}; nothing was reduced. "
                         "Name one of them.")
    if mesh[dim].size() == dist.get_world_size():
        return None
    return mesh[dim].get_group()


def whole_world(mesh):
    """A 1-D mesh over every rank of ``mesh``: the data-parallel mesh of a run without model parallelism.

    Every rank feeds its own batch, so gradients must be averaged over all ranks; Fabric's
    2-D (data, tensor) mesh is flattened since the learner does no tensor parallelism.

    Examples:
        >>> from fabric_learner import whole_world
        >>> whole_world(None) is None  # no mesh: FSDP2's default, the whole world
        True
    """
    if mesh is None or mesh.ndim == 1:
        return mesh
    return _compat.flatten_mesh(mesh, "fabric_learner_shard")
