"""Named meshes: which ranks a collective reduces over.

Every collective of the learner reduces over one named dimension of the run's device mesh:
``"dp"``, the data-parallel ranks, unless asked otherwise. Until a run registers a mesh with
more than one dimension (``use_mesh``), every rank is a data-parallel rank and ``"dp"`` is the
whole world, reduced over the default process group exactly as before meshes had names.

``check_sharded`` registers the mesh the parameters live on when it has a tensor-parallel
dimension (``"tp"`` or Lightning's ``"tensor_parallel"``): ``"dp"`` is then its data-parallel
dimension (``"dp"``/``"data_parallel"``, or every other dimension together), ``"tp"`` the ranks that
share one batch. See docs/meshes.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from fabric_learner.utils import compat as _compat

#: The data-parallel dimension: ranks that each feed their own batch.
DATA_PARALLEL = "dp"
#: The tensor-parallel dimension: ranks that hold parts of the same layers and see the same batch.
TENSOR_PARALLEL = "tp"

#: Names a mesh may give a dimension, by the name collectives use: Lightning's ``ModelParallelStrategy``
#: calls them ``"data_parallel"`` and ``"tensor_parallel"``, torchtitan ``"dp"`` and ``"tp"``.
ALIASES = {DATA_PARALLEL: ("dp", "data_parallel"), TENSOR_PARALLEL: ("tp", "tensor_parallel")}
#: Dimensions whose ranks compute parts of one batch: every other dimension of a mesh is data-parallel.
MODEL_PARALLEL = frozenset(ALIASES[TENSOR_PARALLEL])

_mesh: Any = None  # the run's named DeviceMesh, set by use_mesh
_groups: dict = {}  # dimension name -> its process group on _mesh (None: the whole world), built once
_world: list = [None]  # the default group _mesh was registered under: a mesh outlives no group


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
    _groups.clear()
    _world[0] = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


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
    mesh = registered_mesh()
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        if dim == DATA_PARALLEL or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None  # the whole world, or this process alone: every dimension has one rank
        raise ValueError(f"No mesh with a {dim!r} dimension is registered; nothing was reduced. Reduce over "
                         f"{DATA_PARALLEL!r} (the default) or register the run's mesh with use_mesh(mesh).")
    if dim not in _groups:
        _groups[dim] = _group_of(mesh, dim)
    return _groups[dim]


def _group_of(mesh: Any, dim: str) -> Any:
    names = tuple(mesh.mesh_dim_names)
    found = _dimension(mesh, dim)
    if found is None:
        if dim == DATA_PARALLEL:
            data = [n for n in names if n not in MODEL_PARALLEL]
            if math.prod(mesh.size(names.index(n)) for n in data) == dist.get_world_size():
                return None  # no model-parallel dimension: every rank feeds its own batch (HSDP)
            if len(data) == 1:
                return mesh[data[0]].get_group()
            return _compat.flatten_mesh(mesh[tuple(data)], "fabric_learner_dp").get_group()
        raise ValueError(f"The run's mesh has dimensions {names}, not {dim!r}; nothing was reduced. "
                         "Name one of them.")
    if mesh[found].size() == dist.get_world_size():
        return None
    return mesh[found].get_group()


def _dimension(mesh: Any, dim: str) -> str | None:
    """The name ``mesh`` gives dimension ``dim`` (itself or one of its ``ALIASES``), or ``None``."""
    names = tuple(mesh.mesh_dim_names)
    return next((n for n in (dim, *ALIASES.get(dim, ())) if n in names), None)


def registered_mesh() -> Any:
    """The mesh registered with :func:`use_mesh`, or ``None`` (every rank data-parallel).

    A mesh registered under a process group that has since been destroyed is forgotten.
    """
    if _mesh is not None and not (dist.is_available() and dist.is_initialized() and dist.group.WORLD is _world[0]):
        use_mesh(None)
    return _mesh


def tensor_parallel_size(mesh: Any = None) -> int:
    """Ranks along the tensor-parallel dimension of ``mesh`` (default: the registered one); 1 without one.

    Examples:
        >>> from fabric_learner.sharding.mesh import tensor_parallel_size
        >>> tensor_parallel_size()  # no mesh registered
        1
    """
    mesh = registered_mesh() if mesh is None else mesh
    if mesh is None:
        return 1
    names = tuple(mesh.mesh_dim_names or ())
    return math.prod(mesh.size(names.index(n)) for n in names if n in MODEL_PARALLEL)


def describe(mesh: Any) -> str:
    """``mesh`` in words for error messages: its dimensions, their sizes, and its ranks."""
    names = tuple(mesh.mesh_dim_names or ())
    dims = ", ".join(f"{n}={mesh.size(i)}" for i, n in enumerate(names))
    return f"mesh ({dims}) of ranks {mesh.mesh.tolist()}"


def data_parallel_rank() -> int:
    """This rank's index among the data-parallel ranks: which share of the data it must feed.

    Ranks of one tensor-parallel group have the same index (they must feed the same batch); without
    a registered mesh it is the global rank, in one process 0.

    Examples:
        >>> from fabric_learner.sharding import data_parallel_rank
        >>> data_parallel_rank()  # one process
        0
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group(DATA_PARALLEL))


def tensor_parallel_rank() -> int:
    """This rank's index within its tensor-parallel group; 0 without tensor parallelism.

    The ranks of one group feed one batch: what they count of it (frames, samples) counts once,
    on the group's rank 0.

    Examples:
        >>> from fabric_learner.sharding.mesh import tensor_parallel_rank
        >>> tensor_parallel_rank()  # one process
        0
    """
    if not (dist.is_available() and dist.is_initialized()) or tensor_parallel_size() == 1:
        return 0
    return dist.get_rank(process_group(TENSOR_PARALLEL))


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
