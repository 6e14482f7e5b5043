"""The Trainer's checkpoints: a folder every rank writes together, resumed on the same or another number of ranks.

``TrainerCheckpoints`` (a base of ``Trainer``) writes ``save_checkpoint``'s folder (the learner's
``save`` beside one state file per rank), loads it back (``load_from_file``, ``resume=``), redistributes
it when the number of data-parallel ranks changed, and gives torchrl's ``state_dict``/``load_state_dict``.
What a rank's state holds and how its files are laid out is ``checkpoint.trainer_state`` and
``checkpoint.trainer_folder``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, TypeVar

import torch
from torchrl.trainers import ReplayBufferTrainer

from fabric_learner.asynchronous import NO_COLLECTOR_STATE
from fabric_learner.checkpoint import trainer_folder, trainer_state
from fabric_learner.checkpoint.resize import fill_replay, replay_share, reseed
from fabric_learner.checkpoint.trainer_state import CHECKPOINT_FORMAT
from fabric_learner.collectives import all_reduce
from fabric_learner.trainer.async_loop import warn_discarded
from fabric_learner.trainer.ranks import WORLD
from fabric_learner.weights import PublishWeights

_Self = TypeVar("_Self", bound="TrainerCheckpoints")  # the Trainer itself


class TrainerCheckpoints:
    """The checkpoint side of ``Trainer``: reads the trainer's ``learner``, ``collector``, ``_modules``,
    ``_env_plan``, ``_async``, counters and rank placement, and its ``TrainerRanks`` collectives."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's trainer state plus ``learner.checkpoint()``, in memory."""
        return {**self._rank_state(), "learner": self.learner.checkpoint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_rank_state(state_dict)
        self.learner.load_checkpoint(state_dict["learner"])  # validated before it changes anything
        self._load_rank_state(state_dict)
        self._publish_after_load()
        trainer_state.set_rng_state(state_dict["rng"], self._env_plan)

    def _collector_state(self) -> dict[str, Any]:
        collector = self.collector
        if collector is None or self._async is not None:  # async: in-flight work is not saved
            return dict(NO_COLLECTOR_STATE)
        if self._collector_state_at_end is not None:
            return self._collector_state_at_end  # train() ended and shut the collector down
        if self._collector_closed:
            raise RuntimeError(
                f"The trainer's collector ({type(collector).__name__}) was shut down by a train() that failed, so "
                "its state can no longer be read. Save checkpoints during training (save_trainer_interval=...)."
            )
        return {"collector": collector.state_dict(), "carrier": trainer_state.carrier_state(collector, self._env_plan),
                "env_rng": [g.get_state() for g in self._env_plan.generators()]}

    def _rank_state(self) -> dict[str, Any]:
        collector = self._collector_state()
        rng = trainer_state.rng_state()
        rng["env"] = collector["env_rng"]
        return {
            "format": CHECKPOINT_FORMAT,
            "world_size": self._world_size,
            "rank": self.global_rank,
            # on a tensor-parallel mesh each group's ranks save the same state: the one that counts frames is read
            "data_parallel_rank": self._dp_rank,
            "counts_frames": self._counts_frames,
            "state": {k: v for k, v in self._get_state().items()},
            "collector": collector["collector"],
            "carrier": collector["carrier"],
            "modules": {name: module.state_dict() for name, module in self._modules.items()},
            "rng": rng,
            **({"async": {"queued_frames": self._async.queued_frames(), **self._async.stats()}}
               if self._async is not None else {}),
        }

    def _check_rank_state(self, state: Any, source: str = "the trainer state", resizing: bool = False) -> None:
        trainer_state.check_rank_state(state, self._modules, self._world_size, source, resizing)

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        """Apply a checked rank state (``_check_rank_state``) but its random state, set once publishing is done."""
        if self.collector is not None and state["collector"] is not None:
            self.collector.load_state_dict(state["collector"])
            trainer_state.restore_carrier(self.collector, state.get("carrier"))
        for name, module in self._modules.items():
            module.load_state_dict(state["modules"][name])
        self._restore_counters(state["state"])

    def _restore_counters(self, counters: dict[str, Any]) -> None:
        self.collected_frames = counters["collected_frames"]
        self._last_log = dict(counters["_last_log"])
        self._last_save = counters["_last_save"]
        self._optim_count = counters["_optim_count"]

    def _publish_after_load(self) -> None:
        publisher = self._modules.get("publish_weights")
        if isinstance(publisher, PublishWeights):
            from fabric_learner.weights import publish_to_collector

            publish_to_collector(self.learner, self.collector)

    def _save_trainer(self) -> None:
        self.save_checkpoint(self.save_trainer_file)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write this trainer's checkpoint folder at ``path``. Every rank must call it.

        ``path/learner.ckpt`` is ``learner.save`` (one file under DDP, written by rank 0; a
        sharded folder under sharded strategies), ``path/rank{r}.pt`` each rank's own state, and
        ``path/meta.json`` the format and world size. The folder is built beside ``path`` and
        swapped in only when complete, so a crash leaves the previous checkpoint loadable (at
        ``path``, or at ``path.old`` if the crash hit the swap itself). On several nodes ``path``
        must be on a shared filesystem.
        """
        def meta() -> dict[str, Any]:
            out = {"world_size": self._world_size, "data_parallel_size": self._dp_size,
                   "collected_frames": self.collected_frames,
                   "optim_steps": self._optim_count, "num_updates": self.learner.num_updates}
            if self._async is not None:
                out["in_flight"] = "discarded"  # queued batches and rollouts in progress are not saved
            return out

        with self._collective("save_checkpoint"):
            trainer_folder.write(path, self.global_rank, self._barrier, self.learner.save, self._rank_state, meta)

    def load_from_file(self: _Self, file: str | os.PathLike, **kwargs) -> _Self:
        """Resume from a checkpoint folder written by :meth:`save_checkpoint` (every rank calls it).

        Restores the learner (weights, optimizer state, update count), then this rank's
        counters, hooks (replay buffer), collector and RNG states, and publishes the weights
        to the collector. ``weights_only`` loading: no code is unpickled.
        """
        with self._collective("load_from_file"):
            return self._load_from_file(file)

    def _load_from_file(self: _Self, file: str | os.PathLike) -> _Self:
        path = trainer_folder.locate(file)
        if path is None:
            raise FileNotFoundError(f"No fabric_learner trainer checkpoint at {file} (no {trainer_folder.META_FILE}).")
        meta = trainer_folder.read_meta(path)
        saved_world = meta["world_size"]
        # another world, or the same ranks laid out on another mesh (e.g. DDP on 4 ranks -> 2 x 2): redistribute
        resizing = saved_world != self._world_size or meta.get("data_parallel_size", saved_world) != self._dp_size
        ranks = list(range(saved_world)) if resizing else [self.global_rank]
        states, learner_file = trainer_folder.read_rank_states(path, ranks)
        for r, state in zip(ranks, states):
            self._check_rank_state(state, str(path / f"rank{r}.pt"), resizing=resizing)
        if resizing:
            # one state per data-parallel rank of the saved run, in data-parallel order
            counted = [(s.get("data_parallel_rank", r), s) for r, s in zip(ranks, states) if s.get("counts_frames", True)]
            return self._load_resized([s for _, s in sorted(counted, key=lambda pair: pair[0])], learner_file)
        state = states[0]
        self.learner.load(learner_file)  # validated before it changes anything
        self._load_rank_state(state)
        self._publish_after_load()
        trainer_state.set_rng_state(state["rng"], self._env_plan)
        self._loaded = True
        if self._async is not None:
            warn_discarded(state.get("async") or {"queued_frames": 0})
        return self

    def _load_resized(self: _Self, states: list[dict[str, Any]], learner_file: Path) -> _Self:
        """Resume a checkpoint written by ``len(states)`` data-parallel ranks on this run's (see ``checkpoint.resize``).

        The samples go to data-parallel ranks: the ranks of a tensor-parallel group get the same share.
        """
        replay = {name: m for name, m in self._modules.items() if isinstance(m, ReplayBufferTrainer)}
        shares = {name: replay_share(m.replay_buffer, [s["modules"][name]["replay_buffer"] for s in states],
                                     self._dp_rank, self._dp_size) for name, m in replay.items()}
        with warnings.catch_warnings():  # the learner's own warning on random states: this one below says it all
            warnings.filterwarnings("ignore", message="The checkpoint holds the random state of")
            self.learner.load(learner_file)  # reshards; validated before it changes anything
        first = states[0]
        for name, module in self._modules.items():
            if name in replay:
                fill_replay(module.replay_buffer, *shares[name])
            else:
                module.load_state_dict(first["modules"][name])
        self._restore_counters(first["state"])  # global: the same on every rank that wrote them
        warnings.warn(
            f"The checkpoint was written by {len(states)} rank(s) and this run has {self._dp_size} (data-parallel ranks: "
            "a tensor-parallel group counts once): the learner "
            "was resharded and the replay buffers' samples dealt over the ranks, but collectors start afresh and "
            "random generators are re-seeded from the frame count, so the run does not continue bit for bit.",
            stacklevel=3,
        )
        reseed(self.collected_frames, self._dp_rank)  # a tensor-parallel group's ranks alike
        self._skip_taken_random_frames()
        self._publish_after_load()
        self._loaded = True
        return self

    def _skip_taken_random_frames(self) -> None:
        """After a resume on another number of ranks: the fresh collector acts at random only for what is
        left of the run's warm-up, which the global frame count decides (a collective).

        The warm-up is every rank's ``init_random_frames`` together, as ``train()`` waits for it; of the
        part the run has not collected yet, each rank takes its share (rounded up). A collector whose
        worker processes already run (multi-process collectors) cannot be told: it warns instead.
        """
        mine = self.init_random_frames
        warmup = int(all_reduce(torch.tensor(mine, dtype=torch.int64))) if self._distributed() else mine
        if self.collector is None or mine <= 0:
            return
        left = -(-max(0, warmup - self.collected_frames) * mine // warmup)
        if hasattr(type(self.collector), "_run_processes"):
            if left < mine:
                warnings.warn(
                    f"Resumed at {self.collected_frames} frames of a run whose random warm-up is {warmup} frames over "
                    f"all ranks, but this collector's worker processes were started with init_random_frames={mine} "
                    f"and will act at random for that many frames again. Build the collector with "
                    f"init_random_frames={left} when resuming.", stacklevel=4)
            return
        self.collector.init_random_frames = left

    def _resume_from_last_checkpoint(self) -> None:
        """Load the latest complete checkpoint at ``save_trainer_file``, if any (see ``resume=``).

        Every rank must find the same one (on several nodes the folder must be on a shared
        filesystem); if they do not, it raises on every rank before anything is loaded.
        """
        if not self._resume or self._loaded or not self.save_trainer_file:
            return
        path = Path(self.save_trainer_file)
        found, seen = trainer_folder.counters_seen(path)
        if self._distributed():
            both = all_reduce(torch.tensor(seen + [-v for v in seen], dtype=torch.int64), op="max", group=WORLD)
            if not torch.equal(both[:3], -both[3:]):
                raise RuntimeError(
                    f"Resuming from {path}: the ranks see different checkpoints there (rank {self.global_rank} sees "
                    f"{'none' if found is None else found} with frames, optim steps, updates = {seen}); nothing was "
                    "loaded. save_trainer_file must be on a filesystem every rank shares, or pass resume=False."
                )
        if found is not None:
            self.load_from_file(path)
