"""Whether the ranks of each tensor-parallel group fed the same batch, without a collective per call.

Ranks of one tensor-parallel group compute parts of the same layers: each must run the loss on
the very batch of its data-parallel rank, or the partial results they exchange mix two batches
and the step is wrong without any error. Comparing whole batches would cost a gather of the data,
so each rank hashes its batch, and the ranks gather the hashes (one int64 each) on the loss's
first call and every ``CHECK_EVERY``-th. All ranks see every group's verdict, so all raise together.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from tensordict import is_tensor_collection

from fabric_learner.sharding.mesh import MODEL_PARALLEL, describe, registered_mesh, tensor_parallel_size
from fabric_learner.step.sample_counts import CHECK_EVERY

_MODULUS = 2**61 - 1
_BASE = 1_000_003
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_digest(batch: Any) -> int:
    """A hash of every tensor leaf of ``batch`` (bit patterns, positions and keys); equal batches, equal hashes.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fabric_learner.sharding.agreement import batch_digest
        >>> td = TensorDict({"obs": torch.arange(6.0).reshape(3, 2)}, [3])
        >>> batch_digest(td) == batch_digest(td.clone())
        True
        >>> batch_digest(td) == batch_digest(td.flip(0))
        False
    """
    digest = 0
    for key, value in _leaves(batch, ""):
        flat = value.detach().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        elif flat.is_floating_point() or flat.is_complex():
            flat = flat.contiguous().view(_INT_OF_SIZE.get(flat.element_size(), torch.uint8))
        ints = flat.to(torch.int64)
        weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device)
        value_hash = int((ints * weights).sum().item()) % _MODULUS  # int64 overflow wraps alike on every rank
        for part in (zlib.crc32(key.encode()), *value.shape, value_hash):
            digest = (digest * _BASE + part + 1) % _MODULUS
    return digest


def _leaves(value: Any, key: str):
    """``(key, tensor)`` for every tensor of ``value``, in a fixed order; a lazy stack member by member
    (its samples may have different lengths), a tensorclass through its TensorDict."""
    if isinstance(value, torch.Tensor):
        yield key, value
        return
    if not is_tensor_collection(value):
        return  # strings and other non-tensor data are not compared
    td = getattr(value, "_tensordict", value)
    members = getattr(td, "tensordicts", None)
    if members is not None:
        for i, member in enumerate(members):
            yield from _leaves(member, f"{key}[{i}]")
        return
    for name in sorted(td.keys(), key=str):
        yield from _leaves(td.get(name), f"{key}.{name}")


class BatchAgreement:
    """Counts the loss's calls and, when due, checks the tensor-parallel groups fed equal batches."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def check(self, batch: Any) -> None:
        """A collective on a mesh with tensor parallelism, every ``CHECK_EVERY`` calls; else nothing."""
        call, self.calls = self.calls, self.calls + 1
        if call % CHECK_EVERY or tensor_parallel_size() == 1:
            return
        mesh = registered_mesh()
        from fabric_learner.collectives import _collective_device

        mine = torch.tensor([batch_digest(batch)], dtype=torch.int64, device=_collective_device())
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        digests = torch.cat(gathered).cpu()
        names = tuple(mesh.mesh_dim_names)
        tp_dims = [i for i, n in enumerate(names) if n in MODEL_PARALLEL]
        other = [i for i in range(len(names)) if i not in tp_dims]
        groups = mesh.mesh.permute(*other, *tp_dims).reshape(-1, tensor_parallel_size(mesh))
        bad = [g.tolist() for g in groups if len(set(digests[g].tolist())) > 1]
        if bad:
            raise ValueError(
                f"The ranks of tensor-parallel group(s) {bad} of the {describe(mesh)} fed different batches to "
                f"the loss (call {call + 1} on this rank); nothing was trained by this call. Ranks of one "
                "tensor-parallel group compute parts of the same layers and must all get the batch of their "
                "data-parallel rank: feed each rank the data of fabric_learner.sharding.data_parallel_rank() "
                "(a collector or sampler seeded by it), not of its global rank."
            )
