"""Collectives over every rank's data: sums, counts and means that one process would compute.

Each function is a collective when a process group is up (call it on every rank, in the same
order) and the plain local computation without one, so the same code runs under
``LocalLearner``. NCCL groups reduce on the current CUDA device, gloo on CPU.

``group`` names the mesh dimension a reduction runs over: ``"dp"`` (the default), the
data-parallel ranks, each of which feeds its own batch; another name of the run's mesh (see
``sharding.mesh.use_mesh``); or a process group itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fabric_learner.sharding.mesh import DATA_PARALLEL, process_group

__all__ = ["all_reduce", "distributed_world_size", "global_count", "global_mean", "global_sum"]


def distributed_world_size(group: Any = DATA_PARALLEL) -> int:
    """Ranks along mesh dimension ``group`` (or in a process group); 1 without a process group.

    Examples:
        >>> from fabric_learner.collectives import distributed_world_size
        >>> distributed_world_size()  # one process
        1

        Under DDP on 4 ranks it answers 4; on a registered ``(dp=2, tp=2)`` mesh, ``"dp"`` answers 2.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group(group))


def _collective_device(group: Any = None) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = DATA_PARALLEL) -> torch.Tensor:
    """All-reduce a detached copy of ``tensor`` (``op``: ``"sum"``, ``"max"``, ``"min"``).

    Returns a new tensor on ``tensor``'s device and dtype; ``tensor`` itself is not modified.
    Without a process group (or with one rank) it returns a copy. NCCL groups get the
    tensor on the current CUDA device, gloo on CPU.

    Examples:
        >>> import torch
        >>> from fabric_learner.collectives import all_reduce
        >>> x = torch.tensor([1.0, 5.0])
        >>> all_reduce(x, "max")  # one process: a copy
        tensor([1., 5.])
        >>> all_reduce(x) is x
        False

        With several ranks every rank gets the element-wise sum (or max, min) of all ranks' tensors.
    """
    out = tensor.detach().clone()
    if distributed_world_size(group) == 1:
        return out
    group = process_group(group)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}.")
    device = _collective_device(group)
    buf = out.to(device)
    dist.all_reduce(buf, op=ops[op], group=group)
    return buf.to(tensor.device)


def global_sum(x: torch.Tensor, mask: torch.Tensor | None = None, group: Any = DATA_PARALLEL) -> torch.Tensor:
    """Sum of ``x`` (where ``mask``) over every rank's data; not differentiable. A collective.

    Args:
        x (torch.Tensor): this rank's values.
        mask (torch.Tensor, optional): a boolean tensor broadcastable to ``x``'s leading dims.
        group (str or ProcessGroup): the mesh dimension to reduce over (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Examples:
        >>> import torch
        >>> from fabric_learner.collectives import global_sum
        >>> global_sum(torch.tensor([1.0, 2.0, 4.0]), mask=torch.tensor([True, False, True]))
        tensor(5.)
    """
    x = x.detach()
    if mask is not None:
        x = x * _broadcast_mask(mask, x).to(x.dtype)
    return all_reduce(x.sum(), "sum", group)


def global_count(n: int | torch.Tensor, group: Any = DATA_PARALLEL) -> torch.Tensor:
    """Sum over ranks of a local count (samples, valid mask entries, tokens), as float64. A collective.

    Examples:
        >>> from fabric_learner.collectives import global_count
        >>> global_count(3)
        tensor(3., dtype=torch.float64)
    """
    return all_reduce(torch.as_tensor(n, dtype=torch.float64).reshape(()), "sum", group)


def global_mean(x: torch.Tensor, mask: torch.Tensor | None = None, group: Any = DATA_PARALLEL) -> torch.Tensor:
    """Mean of ``x`` (where ``mask``) over the union of every rank's data: global sum / global count.

    Ranks may hold different numbers of valid entries; each counts with its own weight, which
    a mean of per-rank means would not do. Not differentiable (use :class:`GlobalMeanLoss` for
    losses). A collective; without a process group the local (masked) mean.

    Args:
        x (torch.Tensor): this rank's values.
        mask (torch.Tensor, optional): a boolean tensor broadcastable to ``x``'s leading dims.
        group (str or ProcessGroup): the mesh dimension to reduce over (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Returns:
        A 0-dim tensor of ``x``'s dtype, equal on every rank.

    Examples:
        >>> import torch
        >>> from fabric_learner.collectives import global_mean
        >>> global_mean(torch.tensor([1.0, 2.0, 6.0]), mask=torch.tensor([True, False, True]))
        tensor(3.5000)
    """
    x = x.detach()
    if mask is None:
        count = torch.tensor(float(x.numel()), dtype=torch.float64)
        total = x.sum().to(torch.float64)
    else:
        m = _broadcast_mask(mask, x)
        count = m.sum().to(torch.float64)
        total = (x * m.to(x.dtype)).sum().to(torch.float64)
    both = all_reduce(torch.stack([total, count]), "sum", group)
    return (both[0] / both[1].clamp_min(1)).to(x.dtype)


def _mask_like(mask: torch.Tensor, value: torch.Tensor, key: str) -> torch.Tensor:
    mask = mask.to(torch.bool)
    if mask.ndim > value.ndim and mask.numel() == value.numel():
        mask = mask.reshape(value.shape)
    try:
        return _broadcast_mask(mask, value)
    except RuntimeError as err:
        raise ValueError(
            f"Cannot apply a mask of shape {tuple(mask.shape)} to loss entry {key!r} of shape "
            f"{tuple(value.shape)}: with mask_key, loss entries must keep the batch's leading shape "
            "(build the loss with reduction='none' and no mask of its own)."
        ) from err


def _broadcast_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    mask = mask.to(torch.bool)
    while mask.ndim < like.ndim:
        mask = mask.unsqueeze(-1)
    return mask.expand_as(like)
