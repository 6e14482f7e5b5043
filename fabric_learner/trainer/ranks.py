"""The Trainer's ranks: which rank this is, and the per-batch agreements every rank takes part in.

``TrainerRanks`` (a base of ``Trainer``) holds the rank and world size, seeds each data-parallel rank
apart, sums each batch's frame count and stop requests over all ranks, and turns a collective that
failed because a peer is gone into an error naming the step. ``place_on_mesh`` says where a rank sits on a
tensor-parallel mesh. Every collective here runs over ``WORLD`` (the default group, all ranks).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch
import torch.distributed as dist

from fabric_learner.collectives import all_reduce, distributed_world_size
from fabric_learner.fabric import _lost_peer
from fabric_learner.launch import call_order as _call_order
from fabric_learner.sharding.mesh import data_parallel_rank, registered_mesh, tensor_parallel_rank, use_mesh
from fabric_learner.utils.compat import strategy_timeout

WORLD = None  # collectives over every rank (the default process group), not only the data-parallel ones


class TrainerRanks:
    """The rank side of ``Trainer``: reads ``learner``, ``collector``, ``seed``, ``_world_size``, ``_dp_rank``,
    ``_counts_frames``, ``_stop_training`` and ``_stop_reason`` of the trainer it is a base of."""

    @property
    def global_rank(self) -> int:
        return self.learner.global_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _distributed(self) -> bool:
        return self._world_size > 1 and distributed_world_size(WORLD) > 1

    distributed = _distributed  # part of async_loop.AsyncHost

    def _collective(self, name: str) -> contextlib.AbstractContextManager:
        """Checks, before the call's first collective, that every rank makes this same call (see ``launch.call_order``)."""
        strategy = getattr(getattr(self.learner, "fabric", None), "strategy", None)
        timeout = strategy_timeout(strategy) if strategy is not None else None
        return _call_order.collective_call(f"Trainer.{name}", self.global_rank, self._world_size, timeout)

    @contextlib.contextmanager
    def _peers_named(self, what: str):
        """A per-batch collective of the loop (off the store, as ``update``): when it fails because a peer is
        gone or elsewhere, the error names this step and what the peers last announced."""
        try:
            yield
        except RuntimeError as err:
            lost = _lost_peer(err)
            if lost is None:
                raise
            _call_order.note_failure(f"failed (in the Trainer's {what})")
            peers = _call_order.peer_announcements()
            raise RuntimeError(
                f"Rank {self.global_rank}: the Trainer's {what} could not complete a collective with the other ranks "
                f"({lost}). {peers[:1].upper() + peers[1:] + '. ' if peers else ''}Every rank must run the same "
                "Trainer program: train(), its hooks and its checkpoints at the same points, and the learner's "
                "collective methods (get_weights, save, ...) on every rank or none; see that rank's output for its "
                "own error."
            ) from err

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier()

    def set_seed(self) -> None:
        """Seed this rank's collector, torch and numpy with ``seed + 1000 * data-parallel rank``.

        The ranks of a tensor-parallel group get the same seed: they must collect and sample alike.
        """
        seed = self.seed + 1000 * self._dp_rank
        if self.collector is not None:
            seed = self.collector.set_seed(seed, static_seed=False)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

    def _sync_counts(self, frames: int, exhausted: bool, init_random: int) -> tuple[int, bool, int]:
        """Global frames of this batch, whether any rank's collector ran dry, and the warm-up total.

        Over every rank, a tensor-parallel group's frames and warm-up counted once (on its rank 0).
        """
        if not self._distributed():
            return frames, exhausted, init_random
        once = int(self._counts_frames)
        with self._peers_named("frame count after a collected batch"):
            vec = all_reduce(torch.tensor([frames * once, int(exhausted), init_random * once], dtype=torch.int64),
                             group=WORLD)
        return int(vec[0]), bool(vec[1]), int(vec[2])

    def _sync_stop(self) -> bool:
        if self._stop_training and self._stop_reason and self.global_rank == 0:
            warnings.warn(f"Trainer stopping early: {self._stop_reason}", stacklevel=2)
        if not self._distributed():
            return bool(self._stop_training)
        with self._peers_named("stop check after a batch"):
            stop = bool(all_reduce(torch.tensor(int(self._stop_training), dtype=torch.int64), group=WORLD).item())
        if stop and not self._stop_training:
            self.request_stop("another rank requested a stop")
        return stop


def place_on_mesh(learner) -> tuple[int, bool]:
    """This rank's data-parallel rank, and whether it counts its group's frames (tensor-parallel rank 0).

    Reads the learner's own mesh (registering it, as its loss does when it runs); a learner without
    tensor parallelism has every rank data-parallel.
    """
    owner = getattr(learner, "sharded_module", None)
    mesh = getattr(owner, "mesh", None) if owner is not None else None
    if mesh is not registered_mesh():
        use_mesh(mesh)  # without a mesh: forget another learner's, "dp" is the whole world
    if mesh is None or learner.world_size == 1:
        return learner.global_rank, True
    return data_parallel_rank(), tensor_parallel_rank() == 0
