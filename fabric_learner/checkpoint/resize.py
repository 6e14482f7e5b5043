"""Resuming a Trainer checkpoint on another number of ranks.

What each kind of per-rank state becomes when ``W`` ranks wrote the checkpoint and ``W'`` read it:

- the learner: resharded by its own ``load`` (a file loads anywhere; a sharded folder reshards);
- the trainer's counters and the hooks other than replay buffers: identical on every rank (frame
  counts are global), so rank 0's are taken;
- replay buffers: every stored sample of the ``W`` buffers, in rank order, dealt round-robin over
  the ``W'`` ranks (sample ``j`` to rank ``j % W'``): none lost, none duplicated. Prioritized
  samplers keep each sample's priority;
- collectors and random states: a rank's environments and generators have no counterpart in
  another world, so collectors start afresh and generators are re-seeded from the checkpoint's
  frame count and the new rank (deterministic), with one warning.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch

from fabric_learner.utils import compat as _compat


def replay_share(live_rb, saved: list[dict[str, Any]], rank: int, world: int):
    """This rank's share of the samples in ``saved`` (the buffers' state dicts, in rank order).

    Returns ``(data, priorities)``; either may be ``None`` (no samples, no prioritized sampler).
    Reads through throw-away copies of ``live_rb``, which is not changed.
    """
    parts, priorities = [], []
    for state in saved:
        buffer = copy.deepcopy(live_rb)
        buffer.load_state_dict(state)
        n = len(buffer)
        if not n:
            continue
        index = torch.arange(n)
        parts.append(buffer.storage[index])
        stored = _compat.stored_priorities(buffer.sampler, index)
        priorities.append(stored)
    if not parts:
        return None, None
    data = torch.cat(parts)
    mine = torch.arange(rank, len(data), world)
    if any(p is None for p in priorities):
        return data[mine], None
    return data[mine], torch.cat(priorities)[mine]


def fill_replay(rb, data, priorities) -> None:
    """Empty ``rb`` and write ``data`` into it, with the samples' stored priorities when given."""
    rb.empty()
    if data is None or not len(data):
        return
    index = rb.extend(data)
    if priorities is not None:
        _compat.restore_priorities(rb.sampler, index, priorities)


def reseed(collected_frames: int, rank: int) -> None:
    """torch, numpy and python generators from the checkpoint's frame count and this rank."""
    seed = (int(collected_frames) * 1_000_003 + 1000 * rank) % (2**31 - 1)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
