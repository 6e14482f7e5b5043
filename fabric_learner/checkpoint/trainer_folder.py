"""The Trainer's checkpoint folder: its layout, the swap that makes a new one current, reading it back.

Layout of ``path`` (a directory)::

    path/meta.json      format, world size and counters (written by rank 0)
    path/learner.ckpt   ``learner.save``: one file, or a sharded folder under FSDP
    path/rank{r}.pt     each rank's own state: counters, hooks (replay buffers), collector, RNG

A new checkpoint is built as ``path.partial`` and renamed onto ``path`` only when every rank has
written its part; the previous one is kept as ``path.old`` during the rename, so a crash at any
moment leaves a complete checkpoint at ``path`` or ``path.old``, which ``locate`` finds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fabric_learner.checkpoint.dcp_folder import read_json
from fabric_learner.checkpoint.files import weights_only_load
from fabric_learner.checkpoint.trainer_state import CHECKPOINT_FORMAT, is_count

LEARNER_FILE = "learner.ckpt"
META_FILE = "meta.json"


def write(path: str | Path, rank: int, barrier: Callable[[], None], save_learner: Callable[[Path], None],
          rank_state: Callable[[], dict[str, Any]], meta: Callable[[], dict[str, Any]]) -> None:
    """Collective: build the folder beside ``path`` (the learner, every rank's state, rank 0's meta),
    then swap it in on rank 0."""
    final = Path(path)
    partial, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    barrier()
    save_learner(partial / LEARNER_FILE)
    torch.save(rank_state(), partial / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        (partial / META_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, **meta()}))
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        partial.rename(final)
        if old.exists():
            shutil.rmtree(old)
    barrier()


def locate(path: str | Path) -> Path | None:
    """The complete checkpoint at ``path``, or at ``path.old`` when a crash hit the swap; else ``None``."""
    path = Path(path)
    return next((p for p in (path, path.with_name(path.name + ".old")) if (p / META_FILE).exists()), None)


def read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json`` of a located folder, its format and world size checked."""
    meta = read_json(folder / META_FILE, CHECKPOINT_FORMAT)
    if not is_count(meta.get("world_size")) or meta["world_size"] < 1:
        raise ValueError(f"{folder / META_FILE}: 'world_size' is {meta.get('world_size')!r}, expected a positive "
                         "integer; nothing was loaded.")
    return meta


def read_rank_states(folder: Path, ranks: list[int]) -> tuple[list[Any], Path]:
    """The state files of ``ranks`` (``weights_only``) and the learner checkpoint's path, refusing links."""
    files = [folder / f"rank{r}.pt" for r in ranks]
    learner_file = folder / LEARNER_FILE
    for inner in (*files, learner_file):  # files of the folder itself, never links out of it
        if inner.is_symlink():
            raise ValueError(f"{inner} is a symlink; a trainer checkpoint holds only its own files. Nothing "
                             "was loaded.")
    return [weights_only_load(f) for f in files], learner_file


def counters_seen(path: str | Path) -> tuple[Path | None, list[int]]:
    """The located checkpoint and its (frames, optim steps, updates); ``-1`` each when there is none,
    ``-2`` for a counter that is not one, so ranks can compare what they see with one all-reduce."""
    found = locate(path)
    if found is None:
        return None, [-1, -1, -1]
    meta = read_json(found / META_FILE, CHECKPOINT_FORMAT)
    return found, [meta.get(k) if is_count(meta.get(k)) else -2 for k in ("collected_frames", "optim_steps", "num_updates")]
