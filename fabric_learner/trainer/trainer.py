"""``fabric_learner.Trainer``: torchrl's ``Trainer`` driven by a Learner, one program on every rank.

``Trainer(learner=learner, collector=collector, total_frames=..., optim_steps_per_batch=...)``
keeps torchrl's collect -> epochs -> minibatches loop and its hooks; each optimisation step is
``learner.update(sub_batch)`` (through an ``OptimizationStepper``), so the same trainer runs in
one process (``LocalLearner``) or on many ranks (``FabricLearner`` under DDP or FSDP).

What changes against torchrl's Trainer, and why:

- The loss module and the optimizer come from the learner; ``frame_skip`` defaults to 1.
  Clipping, accumulation and precision are the learner's (``clip_norm=`` is refused). The
  ``process_loss`` and ``optimizer`` hook stages cannot act on a step the learner takes
  whole, so registering one raises instead of being silently ignored.
- ``post_loss`` hooks run after each update with the minibatch the loss wrote into, so
  ``ReplayBufferTrainer``'s priority update (``td_error``) keeps working (torchrl skips
  ``post_loss`` whenever an optimization stepper is set).
- Every rank collects its own data. ``collected_frames``/``total_frames`` count frames over
  *all* data-parallel ranks (an all-reduce per collected batch), so every rank stops after the same number
  of batches, logging steps are comparable across world sizes, and the progress bar shows the
  global count. A stop request (e.g. ``EarlyStopping``) on any rank stops all of them, and a
  collector running dry on one rank ends training everywhere instead of hanging the others.
  Optimisation starts once every rank's collector is past its ``init_random_frames`` (per rank):
  the global count reaches their sum. A resume on another number of ranks does not repeat the
  part of that warm-up the run already took.
- Loss averages logged after each batch are averaged over ranks. The logger and the progress
  bar are used on rank 0 only; a Lightning Fabric logger (e.g.
  ``lightning.fabric.loggers.TensorBoardLogger``) is accepted as well as a torchrl one.
  Throughput (global frames/s, updates/s) is logged by default.
- After each batch's updates the rank's collector acts with the new weights
  (:class:`~fabric_learner.weights.PublishWeights`): a no-op when it runs the very policy the
  loss trains (DDP, one process); under FSDP the collector holds its own copy, and every rank
  gathers the full weights into it with ``learner.get_weights(cpu_offload=False)``.
- ``seed`` seeds every data-parallel rank differently (``seed + 1000 * data-parallel rank``), so
  ranks explore different trajectories.
- On a mesh with tensor parallelism (docs/meshes.md) the ranks of one tensor-parallel group
  compute parts of one update, so they are one data-parallel rank to the trainer: seeded alike,
  their collectors, replay buffers and on-policy partitions produce the same batches (which the
  learner checks), and their frames count once. Stops and a dry collector still reach every rank.
- Checkpoints (``save_trainer_file``, ``save_trainer_interval``, ``load_from_file``) are a
  folder written collectively: the learner through ``learner.save`` (sharded under a sharded
  strategy), and one file per rank with the trainer counters, every registered hook's state
  (replay buffer included), the collector's state and the rank's RNG states. It replaces
  the previous checkpoint atomically. A resume into a freshly built trainer continues as the
  uninterrupted run would (exactly so for stateless environments such as torchrl's
  ``PendulumEnv``, whose in-flight observation is restored too). What is saved of the
  environment is decided once, at construction (see ``checkpoint.trainer_state.EnvPlan``).
- ``async_collection=AsyncCollection(...)`` (or ``True`` on several ranks) runs the asynchronous
  loop of :mod:`fabric_learner.asynchronous` instead, on any number of ranks: collection in
  other processes, policy versions on every frame, stale frames dropped and counted, a bounded
  queue, ranks in step; its checkpoints discard in-flight work. ``True`` on one rank keeps
  torchrl's own asynchronous mode.
- At the end of ``train()`` the collector's state is read, then the collector is shut down
  (env, worker processes, weight-sync schemes), also when training fails, so no worker
  process outlives the run.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections import defaultdict
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.trainers import Trainer as _TorchRLTrainer

from fabric_learner.asynchronous import AsyncCollection, versioned_policy
from fabric_learner.checkpoint import trainer_state
from fabric_learner.collectives import all_reduce, distributed_world_size
from fabric_learner.trainer.async_loop import AsyncLoop
from fabric_learner.trainer.checkpoints import TrainerCheckpoints
from fabric_learner.trainer.hooks import LearnerStepper, LogThroughput, _TargetNetUpdate
from fabric_learner.trainer.logging import _adapt_logger
from fabric_learner.trainer.ranks import TrainerRanks, place_on_mesh
from fabric_learner.weights import PublishWeights, serve_collector_policy

__all__ = ["Trainer"]


# ---- the trainer ----------------------------------------------------------------------------------


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The mean of one-element tensors, summed in float64 in step order, as float32.

    One stack for a batch's steps, where a running sum costs four tensor operations per step and
    key (~0.1 ms a step on PPO's outputs); on CPU ``cumsum`` adds in step order, as the running sum
    did (a GPU's parallel scan may round differently in the last bits).
    """
    stacked = torch.stack([v.reshape(()) for v in values])  # detached by the caller
    return (stacked.to(torch.float64).cumsum(0)[-1] / len(values)).float()


class Trainer(TrainerRanks, TrainerCheckpoints, _TorchRLTrainer):
    """torchrl's ``Trainer`` whose optimisation steps are ``learner.update(sub_batch)``.

    Args:
        learner: a ``fabric_learner`` Learner (``LocalLearner``, ``FabricLearner``); its
            ``loss_module`` and ``optimizer`` are the trainer's.
        collector: this rank's collector (every rank collects its own data; on a tensor-parallel mesh
            the ranks of a group collect the same), or ``None`` to drive ``optim_steps(batch)`` by hand.
        total_frames: frames to collect over **all** data-parallel ranks together.
        optim_steps_per_batch: optimisation steps per epoch over each collected batch (``None``:
            until the ``process_optim_batch`` hook raises ``StopIteration``).
        frame_skip: defaults to 1.
        logger: a torchrl logger or a Lightning Fabric logger; used on rank 0 only.
        publish_weights: register :class:`~fabric_learner.weights.PublishWeights` so the
            collector acts with the new weights after each batch (default ``True``).
        target_net_updater: a torchrl ``TargetNetUpdater`` (``SoftUpdate``/``HardUpdate``),
            stepped after every optimizer step and checkpointed.
        log_throughput: register :class:`LogThroughput` (default ``True``).
        max_tokens: for torchrl's LLM losses (GRPO family, SFT), each optimisation step's sub-batch is
            cut into micro-batches of at most this many padded tokens
            (:func:`fabric_learner.llm.update_by_tokens`) instead of being one ``update``.
        resume: with ``save_trainer_file``, ``train()`` first loads the latest complete checkpoint
            found there, so a restarted run (``torchrun --max-restarts``, or the same command run
            again) continues where it was; ``False`` starts afresh (the next save overwrites it).
        **kwargs: any other torchrl ``Trainer`` argument (``num_epochs``, ``log_interval``,
            ``save_trainer_file``, ``save_trainer_interval``, ``progress_bar``, ``seed``,
            ``log_timings``, ``auto_log_optim_steps``, ...).

    Raises:
        TypeError: ``loss_module=``, ``optimizer=``, ``optimization_stepper=`` or ``clip_norm=``
            given (they are the learner's), or ``learner`` is not a Learner.
        ValueError, NotImplementedError: a torchrl option this trainer cannot honour on several
            ranks (``learner_backend`` other than ``"local"``, torchrl's unified ``checkpoint=``).

    Examples:
        ``train()`` runs torchrl's loop on the collector; with ``collector=None`` the same
        optimisation steps run on a batch given by hand:

        >>> import torch
        >>> from fabric_learner import LocalLearner, Trainer
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.Adam(params, lr=1e-3), policy=net)
        >>> trainer = Trainer(learner=learner, collector=None, total_frames=0, optim_steps_per_batch=3,
        ...                   progress_bar=False)
        >>> trainer.optim_steps(batch)
        >>> learner.num_updates, trainer.loss_module is learner.loss_module
        (3, True)
    """

    def __init__(
        self,
        *,
        learner,
        collector,
        total_frames: int,
        optim_steps_per_batch: int | None,
        frame_skip: int = 1,
        logger=None,
        progress_bar: bool = True,
        seed: int | None = None,
        publish_weights: bool = True,
        target_net_updater=None,
        log_throughput: bool = True,
        resume: bool = True,
        max_tokens: int | None = None,
        **kwargs,
    ) -> None:
        for name in ("loss_module", "optimizer", "optimization_stepper"):
            if name in kwargs:
                raise TypeError(
                    f"Trainer(learner=...) takes its {name.replace('_', ' ')} from the learner; do not pass {name}=."
                )
        if kwargs.pop("clip_norm", None) is not None:
            raise TypeError("The learner clips gradients: build it with clip_grad_norm=... instead of passing clip_norm=.")
        kwargs.pop("clip_grad_norm", None)  # torchrl's clipping-mode flag: the learner clips
        if kwargs.get("learner_backend", "local") != "local":
            raise ValueError("Trainer(learner=...) runs the learner in this process: learner_backend must be 'local'.")
        if kwargs.get("checkpoint") is not None or kwargs.get("checkpoint_rotation") is not None:
            raise NotImplementedError(
                "torchrl's unified Checkpoint is not rank-aware; use save_trainer_file= (a folder written "
                "collectively, with per-rank replay buffer, collector and RNG state)."
            )
        if not hasattr(learner, "update") or not hasattr(learner, "loss_module"):
            raise TypeError(f"learner must be a fabric_learner Learner, got {type(learner).__name__}.")
        if max_tokens is not None:
            _check_max_tokens(learner, max_tokens)
        self.learner = learner
        self._world_size = learner.world_size
        self._dp_rank, self._counts_frames = place_on_mesh(learner)
        self._dp_size = distributed_world_size() if self._world_size > 1 else 1
        # AsyncCollection (or True on several ranks): fabric_learner's asynchronous loop on every rank;
        # True on one rank keeps torchrl's own asynchronous mode.
        async_cfg = kwargs.pop("async_collection", False)
        if async_cfg is True and self._world_size > 1:
            async_cfg = AsyncCollection()
        if isinstance(async_cfg, AsyncCollection):
            if not self._counts_frames or self._dp_rank != self.global_rank:
                raise NotImplementedError(
                    "async_collection on a mesh with tensor parallelism is not supported: its rounds count and deal "
                    "batches per global rank. Use the synchronous loop (async_collection=False), which gives the "
                    "ranks of each tensor-parallel group the same batches.")
            if collector is None:
                raise ValueError("async_collection needs a collector: pass this rank's collector=.")
            stamp = versioned_policy(collector)  # raises, naming the fix, unless the policy stamps versions
            if stamp.key != async_cfg.key:
                raise ValueError(f"The collector's VersionedPolicy writes {stamp.key!r} but AsyncCollection reads "
                                 f"{async_cfg.key!r}; give both the same key.")
            if learner.policy is None:
                raise ValueError("async_collection publishes the learner's policy weights to the collector: build the "
                                 "learner with policy=<the policy module the loss trains>.")
        elif async_cfg not in (False, None, True):
            raise TypeError(f"async_collection must be a fabric_learner.AsyncCollection or a bool, got {async_cfg!r}.")
        else:
            kwargs["async_collection"] = bool(async_cfg)
        self._async = AsyncLoop(async_cfg) if isinstance(async_cfg, AsyncCollection) else None
        super().__init__(
            collector=collector,
            total_frames=total_frames,
            frame_skip=frame_skip,
            optim_steps_per_batch=optim_steps_per_batch,
            loss_module=learner.loss_module,
            optimizer=learner.optimizer,
            optimization_stepper=LearnerStepper(learner, max_tokens=max_tokens),
            logger=_adapt_logger(logger),
            progress_bar=progress_bar and learner.global_rank == 0,
            seed=None,
            target_net_updater=target_net_updater,
            **kwargs,
        )
        # The collector's warm-up as configured (also read by the asynchronous loop): a resume on another number
        # of ranks shortens the fresh collector's own (see _skip_taken_random_frames), never the threshold
        # optimisation waits for.
        self.init_random_frames = int(getattr(collector, "init_random_frames", 0) or 0)
        # Decided now, while the env is alive: what checkpoints hold of it (see trainer_state.EnvPlan).
        self._env_plan = trainer_state.EnvPlan(collector)
        self._collector_closed = False
        self._collector_state_at_end: dict[str, Any] | None = None
        self.seed = seed
        if seed is not None:
            self.set_seed()
        if target_net_updater is not None:
            _TargetNetUpdate(target_net_updater, learner).register(self)
        if publish_weights and collector is not None and self._async is None:  # async: publish() each round
            serve_collector_policy(learner, collector)
            PublishWeights(learner, collector).register(self)
        if log_throughput:
            LogThroughput(self).register(self)
        self._pbar = None
        self._resume = resume
        self._loaded = False  # load_from_file was called: train() does not resume on its own

    # ---- hooks ----------------------------------------------------------------------------------

    def register_op(self, dest, op, **kwargs) -> None:
        if dest in ("process_loss", "optimizer"):
            raise RuntimeError(
                f"The {dest!r} hook stage acts between the loss and the optimizer step, which the learner takes "
                "whole in learner.update(): a hook there would never run. Clip with the learner's clip_grad_norm, "
                "transform losses inside the loss module (or a wrapper such as fabric_learner.onpolicy."
                "GlobalMeanLoss), and use 'post_loss' or 'post_optim' for what follows the step."
            )
        if dest == "post_loss":
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The 'post_loss' hook stage", category=FutureWarning)
                return super().register_op(dest, op, **kwargs)
        return super().register_op(dest, op, **kwargs)

    register_hook = register_op

    # ---- the loop -------------------------------------------------------------------------------

    def train(self):
        """torchrl's ``Trainer.train`` loop (as of torchrl 0.14.1) with global frame counts and stops.

        A copy, kept in step with torchrl's by tests/test_from_torchrl.py: with one process, each of
        torchrl's algorithm trainers run through here ends with the weights of torchrl's own
        ``train()`` bit for bit.
        """
        self._resume_from_last_checkpoint()
        if self._async is not None:
            return self._train_async()
        if self.async_collection:
            return super().train()
        if self.progress_bar:
            from tqdm import tqdm

            self._pbar = tqdm(total=self.total_frames, initial=min(self.collected_frames, self.total_frames))
            self._pbar_str = {}
        self._setup_hook()
        iterator = iter(self.collector)
        init_random = self.init_random_frames
        try:
            while self.collected_frames < self.total_frames:  # a resumed run may have nothing left to do
                batch = next(iterator, None)
                current = 0
                if batch is not None:
                    batch = self._process_batch_hook(batch)
                    current = int(batch.get(("collector", "mask"), torch.tensor(batch.numel())).sum().item()) * self.frame_skip
                frames, exhausted, init_total = self._sync_counts(current, batch is None, init_random)
                if exhausted:
                    break
                self.collected_frames += frames
                self._pre_steps_log_hook(batch)
                if self.collected_frames >= init_total:
                    self.optim_steps(batch)
                self._post_steps_hook()
                self._post_steps_log_hook(batch)
                if self._sync_stop():
                    self.save_trainer(force_save=True)
                    break
                if self._pbar is not None:
                    self._pbar.update(frames)
                    self._pbar_description()
                if self.collected_frames >= self.total_frames:
                    self.save_trainer(force_save=True)
                    break
                self.save_trainer()
        except BaseException:
            # Worker processes (ParallelEnv, multi-process collectors) would otherwise outlive the
            # error and keep the interpreter from exiting.
            self._close_collector(raise_on_error=False)
            raise
        finally:
            if self._pbar is not None:
                self._pbar.close()
        self._shutdown_hook()
        self._collector_state_at_end = self._collector_state()  # read while the collector is alive
        self._close_collector(raise_on_error=True)

    def _train_async(self) -> None:
        if self.progress_bar:
            from tqdm import tqdm

            self._pbar = tqdm(total=self.total_frames, initial=min(self.collected_frames, self.total_frames))
            self._pbar_str = {}
        try:
            self._async.run(self)
        except BaseException:
            self._async.abort()
            self._close_collector(raise_on_error=False)
            raise
        finally:
            if self._pbar is not None:
                self._pbar.close()

    # ---- what the asynchronous loop drives (async_loop.AsyncHost) ----------------------------------

    def run_hook(self, stage: str, *args: Any) -> Any:
        """Run torchrl's hook stage ``stage`` (e.g. ``"process_batch"``) on ``args``; its result."""
        return getattr(self, f"_{stage}_hook")(*args)

    def stop_requested(self) -> bool:
        return bool(self._stop_training)

    def advance_progress(self, frames: int) -> None:
        if self._pbar is not None:
            self._pbar.update(frames)
            self._pbar_description()

    def end_collection(self, state: dict[str, Any]) -> None:
        self._collector_state_at_end = state
        self._close_collector(raise_on_error=True)

    @property
    def async_stats(self) -> dict[str, Any]:
        """This rank's asynchronous-collection counters: rounds, batches, admitted and dropped frames
        (``global_dropped_frames``: over all ranks), the largest admitted lag, the queue's high water."""
        return self._async.stats() if self._async is not None else AsyncLoop(AsyncCollection()).stats()

    def __del__(self):
        # torchrl's Trainer.__del__ shuts the collector down again, even after train() did
        with contextlib.suppress(Exception):  # at garbage collection: nobody to report to
            self._close_collector(raise_on_error=False)

    def _close_collector(self, *, raise_on_error: bool) -> None:
        """Shut the collector down once (closing its env and worker processes)."""
        if self._collector_closed or self.collector is None:
            return
        self._collector_closed = True
        try:
            self.collector.shutdown()
            _shutdown_weight_sync(self.collector)
        except Exception:
            if raise_on_error:
                raise

    def optim_steps(self, batch: TensorDictBase) -> None:
        """torchrl's epoch/minibatch loop (as of torchrl 0.14.1); ``_optim_count`` counts only the steps taken.

        (torchrl counts one step more per epoch when ``process_optim_batch`` ends the epoch with
        ``StopIteration``, and its running loss average restarts each epoch: both are exact here.)
        """
        scalars: dict[str, list[torch.Tensor]] = defaultdict(list)  # averaged once the batch is done
        self._pre_optim_hook()
        taken = 0
        for _ in range(self.num_epochs):
            self._pre_epoch_log_hook(batch)
            batch_processed = self._pre_epoch_hook(batch)
            steps = itertools.count() if self.optim_steps_per_batch is None else range(self.optim_steps_per_batch)
            for _ in steps:
                try:
                    sub_batch = self._process_optim_batch_hook(batch_processed)
                except StopIteration:
                    break
                if sub_batch is None:
                    break
                self._optim_count += 1
                losses = self.optimization_stepper.step(self, sub_batch)
                self._post_optim_hook()
                self._post_optim_log(sub_batch)
                for key, item in losses.items():
                    if isinstance(item, torch.Tensor) and item.numel() == 1:
                        scalars[key].append(item.detach() if item.requires_grad else item)  # keep no graph alive
                taken += 1
                del sub_batch, losses
            self._post_epoch_log_hook(batch)
            self._post_epoch_hook()
        if taken:
            average = TensorDict({k: _mean(vs) for k, vs in scalars.items()}, [])
            self._post_optim_complete_log_hook(self._optim_count, average)

    def _post_optim_complete_log_hook(self, optim_steps: int, average_losses: TensorDictBase | None) -> None:
        if average_losses is not None and self._distributed() and len(average_losses.keys()):
            keys = sorted(average_losses.keys())
            with self._peers_named("loss averages logged after a batch"):
                vec = all_reduce(torch.stack([average_losses.get(k).reshape(()).float() for k in keys]))
            # summed over the data-parallel ranks (a tensor-parallel group's ranks report one batch's losses)
            average_losses = TensorDict({k: vec[i] / distributed_world_size() for i, k in enumerate(keys)}, [])
        super()._post_optim_complete_log_hook(optim_steps, average_losses)

    def _log(self, log_pbar: bool = False, **kwargs) -> None:
        """torchrl's logging (history, intervals, progress bar), with the logger used on rank 0 only."""
        if self.global_rank == 0:
            return super()._log(log_pbar=log_pbar, **kwargs)
        logger, self.logger = self.logger, None
        try:
            super()._log(log_pbar=log_pbar, **kwargs)
        finally:
            self.logger = logger

    def _shutdown_hook(self) -> None:
        super()._shutdown_hook()
        if self.global_rank == 0 and self.logger is not None and hasattr(self.logger, "finalize"):
            self.logger.finalize("success")


def _shutdown_weight_sync(collector) -> None:
    """Shut down the collector's weight-sync schemes now, while the interpreter is alive.

    A multi-process collector's ``shutdown`` leaves its schemes open; the scheme's ``__del__``
    then runs at interpreter exit and puts to a multiprocessing queue, whose feeder thread
    cannot start during finalisation: the process hangs after the script has returned.
    """
    schemes = vars(collector).get("_weight_sync_schemes")
    for scheme in (schemes.values() if isinstance(schemes, dict) else ()):
        shutdown = getattr(type(scheme), "shutdown", None)
        if callable(shutdown):
            shutdown(scheme)


def _check_max_tokens(learner, max_tokens) -> None:
    """``max_tokens`` refused before the trainer is built: not a positive integer, or a loss without token counts."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer (padded tokens per micro-batch) or None, got "
                         f"{max_tokens!r}.")
    if getattr(learner, "_counts", None) is None:
        raise ValueError(f"max_tokens cuts each step by tokens, which keeps the step exact only for losses the learner "
                         f"normalises by token or sample count (torchrl's GRPO family, SFTLoss); "
                         f"{type(learner.loss_module).__name__} is not one. Leave max_tokens=None.")
