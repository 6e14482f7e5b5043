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
  *all* ranks (an all-reduce per collected batch), so every rank stops after the same number
  of batches, logging steps are comparable across world sizes, and the progress bar shows the
  global count. A stop request (e.g. ``EarlyStopping``) on any rank stops all of them, and a
  collector running dry on one rank ends training everywhere instead of hanging the others.
  Optimisation starts once every rank's collector is past its ``init_random_frames``.
- Loss averages logged after each batch are averaged over ranks. The logger and the progress
  bar are used on rank 0 only; a Lightning Fabric logger (e.g.
  ``lightning.fabric.loggers.TensorBoardLogger``) is accepted as well as a torchrl one.
  Throughput (global frames/s, updates/s) is logged by default.
- After each batch's updates the rank's collector acts with the new weights
  (:class:`~fabric_learner.weights.PublishWeights`): a no-op when it runs the very policy the
  loss trains (DDP, one process); under FSDP the collector holds its own copy, and every rank
  gathers the full weights into it with ``learner.get_weights(cpu_offload=False)``.
- ``seed`` seeds every rank differently (``seed + 1000 * rank``), so ranks explore
  different trajectories.
- Checkpoints (``save_trainer_file``, ``save_trainer_interval``, ``load_from_file``) are a
  folder written collectively: the learner through ``learner.save`` (sharded under a sharded
  strategy), and one file per rank with the trainer counters, every registered hook's state
  (replay buffer included), the collector's state and the rank's RNG states. It replaces
  the previous checkpoint atomically. A resume into a freshly built trainer continues as the
  uninterrupted run would (exactly so for stateless environments such as torchrl's
  ``PendulumEnv``, whose in-flight observation is restored too). What is saved of the
  environment is decided once, at construction (see ``_EnvPlan``).
- At the end of ``train()`` the collector's state is read, then the collector is shut down
  (env, worker processes, weight-sync schemes), also when training fails, so no worker
  process outlives the run.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
import random
import shutil
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase
from torchrl.trainers import LogScalar, OptimizationStepper, ReplayBufferTrainer, TrainerHookBase
from torchrl.trainers import Trainer as _TorchRLTrainer

from fabric_learner._checkpoint import weights_only_load
from fabric_learner._dcp import read_json
from fabric_learner._resize import fill_replay, replay_share, reseed
from fabric_learner.onpolicy import all_reduce, distributed_world_size
from fabric_learner.weights import PublishWeights, serve_collector_policy

__all__ = ["FabricLoggerAdapter", "GlobalLogScalar", "LearnerStepper", "LogThroughput", "Trainer"]

CHECKPOINT_FORMAT = "fabric_learner.trainer/1"
_LEARNER_FILE = "learner.ckpt"
_META_FILE = "meta.json"


# ---- the step -----------------------------------------------------------------------------------


class LearnerStepper(OptimizationStepper):
    """One torchrl optimisation step = one ``learner.update(sub_batch)``, then the ``post_loss`` hooks.

    The learner forwards the loss, sums its ``"loss"`` entries, backpropagates (synchronising
    gradients across ranks), clips and steps. ``post_loss`` hooks then see the minibatch as the
    loss left it (DQN's ``td_error`` for priority updates). Its state lives in the learner.
    """

    def __init__(self, learner) -> None:
        self.learner = learner

    def step(self, trainer, sub_batch: TensorDictBase) -> TensorDictBase:
        out = self.learner.update(sub_batch)
        trainer._post_loss_hook(sub_batch)
        return out

    @property
    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (``UpdateWeights(interval_unit="optim_steps")`` reads this)."""
        return self.learner.num_updates

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return


class _TargetNetUpdate(TrainerHookBase):
    """Steps a torchrl ``TargetNetUpdater`` once per optimizer step (not per accumulation micro-step)."""

    def __init__(self, updater, learner) -> None:
        self.updater, self.learner = updater, learner
        self._last = learner.num_updates

    def __call__(self) -> None:
        steps = self.learner.num_updates - self._last
        if steps <= 0:
            return
        # A sharded learner keeps the loss's own parameter objects empty outside update(); the
        # updater reads them, so they hold the gathered weights for the call (a collective).
        with _full_parameters(self.learner):
            for _ in range(steps):
                self.updater.step()
        self._last = self.learner.num_updates

    def state_dict(self) -> dict[str, Any]:
        state = self.updater.state_dict() if hasattr(self.updater, "state_dict") else {}
        return {"updater": state, "last": self._last}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if hasattr(self.updater, "load_state_dict"):
            self.updater.load_state_dict(state_dict.get("updater", {}))
        self._last = int(state_dict.get("last", self.learner.num_updates))

    def register(self, trainer, name: str = "target_net_updater") -> None:
        trainer.register_op("post_optim", self)
        trainer.register_module(name, self)


def _full_parameters(learner):
    """Inside the block the loss's modules hold the full weights (a collective when sharded)."""
    if not learner.capabilities.sharded:
        return contextlib.nullcontext()
    return learner.full_parameters()


# ---- logging --------------------------------------------------------------------------------------


class FabricLoggerAdapter:
    """A Lightning Fabric logger (``log_metrics``) behind torchrl's logger calls (``log_scalar``).

    ``Trainer`` wraps a ``lightning.fabric.loggers.Logger`` in it automatically, e.g.
    ``Trainer(..., logger=TensorBoardLogger("runs", name="ppo"))``.
    """

    def __init__(self, logger) -> None:
        self.logger = logger

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        if isinstance(value, torch.Tensor):
            value = value.item()
        self.logger.log_metrics({name: float(value)}, step=step)

    def log_metrics(self, metrics, step: int | None = None, **kwargs) -> None:
        self.logger.log_metrics({k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()},
                                step=step)

    def log_hparams(self, cfg) -> None:
        self.logger.log_hyperparams(cfg)

    def log_histogram(self, name: str, data, **kwargs) -> None:
        return  # Fabric's generic logger API has no histogram call

    def log_video(self, name: str, video, step: int | None = None, **kwargs) -> None:
        return

    def finalize(self, status: str = "success") -> None:
        self.logger.finalize(status)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["logger"], name)

    def __repr__(self) -> str:
        return f"FabricLoggerAdapter({self.logger!r})"


def _adapt_logger(logger):
    if logger is None:
        return None
    try:
        from lightning.fabric.loggers import Logger as FabricLogger
    except ImportError:  # pragma: no cover - lightning is a dependency
        return logger
    return FabricLoggerAdapter(logger) if isinstance(logger, FabricLogger) else logger


class GlobalLogScalar(LogScalar):
    """torchrl's ``LogScalar`` over every rank's batch: all-reduced sums, counts, minima, maxima.

    A collective at ``pre_steps_log``: every rank must register it (they all run the same
    program). Logs e.g. the mean reward of all ranks' rollouts, not just rank 0's.
    """

    def __call__(self, batch: TensorDictBase) -> dict:
        tensor = batch.get(self.key)
        if ("collector", "mask") in batch.keys(True):
            tensor = tensor[batch.get(("collector", "mask"))]
        t = tensor.detach().to(torch.float64)
        if self.reduction in ("mean", "sum"):
            stats = all_reduce(torch.stack([t.sum(), (t * t).sum(), torch.tensor(float(t.numel()), dtype=torch.float64)]))
            total, sq, n = stats.tolist()
            value = total / max(n, 1.0) if self.reduction == "mean" else total
        else:
            value = all_reduce(t.min() if self.reduction == "min" else t.max(), self.reduction).item()
            n = 0.0
        result = {self.logname: float(value), "log_pbar": self.log_pbar}
        if self.include_std and self.reduction in ("mean", "sum") and n > 1:
            mean = total / n
            result[f"{self.logname}_std"] = math.sqrt(max(sq - n * mean * mean, 0.0) / (n - 1))
        return result


class LogThroughput(TrainerHookBase):
    """Logs global frames per second and optimizer updates per second (``post_steps_log``)."""

    def __init__(self, trainer, log_pbar: bool = True) -> None:
        self.trainer, self.log_pbar = trainer, log_pbar
        self._t0: float | None = None
        self._frames0 = 0
        self._updates0 = 0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._frames0 = self.trainer.collected_frames
        self._updates0 = self.trainer.learner.num_updates

    def __call__(self, batch=None) -> dict:
        if self._t0 is None:
            self.start()
            return {}
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        frames, updates = self.trainer.collected_frames, self.trainer.learner.num_updates
        out = {"fps": (frames - self._frames0) / dt, "updates_per_s": (updates - self._updates0) / dt,
               "log_pbar": self.log_pbar}
        self._t0, self._frames0, self._updates0 = now, frames, updates
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return

    def register(self, trainer, name: str = "log_throughput") -> None:
        trainer.register_op("setup", self.start)
        trainer.register_op("post_steps_log", self)
        trainer.register_module(name, self)


# ---- the trainer ----------------------------------------------------------------------------------


class Trainer(_TorchRLTrainer):
    """torchrl's ``Trainer`` whose optimisation steps are ``learner.update(sub_batch)``.

    Args:
        learner: a ``fabric_learner`` Learner (``LocalLearner``, ``FabricLearner``); its
            ``loss_module`` and ``optimizer`` are the trainer's.
        collector: this rank's collector (every rank collects its own data), or ``None`` to
            drive ``optim_steps(batch)`` by hand.
        total_frames: frames to collect over **all** ranks together.
        optim_steps_per_batch: optimisation steps per epoch over each collected batch (``None``:
            until the ``process_optim_batch`` hook raises ``StopIteration``).
        frame_skip: defaults to 1.
        logger: a torchrl logger or a Lightning Fabric logger; used on rank 0 only.
        publish_weights: register :class:`~fabric_learner.weights.PublishWeights` so the
            collector acts with the new weights after each batch (default ``True``).
        target_net_updater: a torchrl ``TargetNetUpdater`` (``SoftUpdate``/``HardUpdate``),
            stepped after every optimizer step and checkpointed.
        log_throughput: register :class:`LogThroughput` (default ``True``).
        **kwargs: any other torchrl ``Trainer`` argument (``num_epochs``, ``log_interval``,
            ``save_trainer_file``, ``save_trainer_interval``, ``progress_bar``, ``seed``,
            ``log_timings``, ``auto_log_optim_steps``, ...).
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
        self.learner = learner
        self._world_size = learner.world_size
        if kwargs.get("async_collection") and self._world_size > 1:
            raise NotImplementedError("async_collection is not supported with more than one rank yet.")
        super().__init__(
            collector=collector,
            total_frames=total_frames,
            frame_skip=frame_skip,
            optim_steps_per_batch=optim_steps_per_batch,
            loss_module=learner.loss_module,
            optimizer=learner.optimizer,
            optimization_stepper=LearnerStepper(learner),
            logger=_adapt_logger(logger),
            progress_bar=progress_bar and learner.global_rank == 0,
            seed=None,
            target_net_updater=target_net_updater,
            **kwargs,
        )
        # Decided now, while the env is alive: what checkpoints hold of it (see _EnvPlan).
        self._env_plan = _EnvPlan(collector)
        self._collector_closed = False
        self._collector_state_at_end: dict[str, Any] | None = None
        self.seed = seed
        if seed is not None:
            self.set_seed()
        if target_net_updater is not None:
            _TargetNetUpdate(target_net_updater, learner).register(self)
        if publish_weights and collector is not None:
            serve_collector_policy(learner, collector)
            PublishWeights(learner, collector).register(self)
        if log_throughput:
            LogThroughput(self).register(self)
        self._pbar = None

    # ---- ranks --------------------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.learner.global_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _distributed(self) -> bool:
        return self._world_size > 1 and distributed_world_size() > 1

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier()

    def set_seed(self) -> None:
        """Seed this rank's collector, torch and numpy with ``seed + 1000 * rank``."""
        seed = self.seed + 1000 * self.global_rank
        if self.collector is not None:
            seed = self.collector.set_seed(seed, static_seed=False)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

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
        if self.async_collection:
            return super().train()
        if self.progress_bar:
            from tqdm import tqdm

            self._pbar = tqdm(total=self.total_frames, initial=min(self.collected_frames, self.total_frames))
            self._pbar_str = {}
        self._setup_hook()
        iterator = iter(self.collector)
        init_random = int(getattr(self.collector, "init_random_frames", 0) or 0)
        try:
            while True:
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

    def _sync_counts(self, frames: int, exhausted: bool, init_random: int) -> tuple[int, bool, int]:
        """Global frames of this batch, whether any rank's collector ran dry, and the warm-up total."""
        if not self._distributed():
            return frames, exhausted, init_random
        vec = all_reduce(torch.tensor([frames, int(exhausted), init_random], dtype=torch.int64))
        return int(vec[0]), bool(vec[1]), int(vec[2])

    def _sync_stop(self) -> bool:
        if self._stop_training and self._stop_reason and self.global_rank == 0:
            warnings.warn(f"Trainer stopping early: {self._stop_reason}", stacklevel=2)
        if not self._distributed():
            return bool(self._stop_training)
        stop = bool(all_reduce(torch.tensor(int(self._stop_training), dtype=torch.int64)).item())
        if stop and not self._stop_training:
            self.request_stop("another rank requested a stop")
        return stop

    def optim_steps(self, batch: TensorDictBase) -> None:
        """torchrl's epoch/minibatch loop; ``_optim_count`` counts only the steps actually taken.

        (torchrl counts one step more per epoch when ``process_optim_batch`` ends the epoch with
        ``StopIteration``, and its running loss average restarts each epoch: both are exact here.)
        """
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = defaultdict(int)
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
                        value = item.detach().reshape(()).to(torch.float64)
                        sums[key] = sums[key] + value if key in sums else value
                        counts[key] += 1
                taken += 1
                del sub_batch, losses
            self._post_epoch_log_hook(batch)
            self._post_epoch_hook()
        if taken:
            average = TensorDict({k: (v / counts[k]).float() for k, v in sums.items()}, [])
            self._post_optim_complete_log_hook(self._optim_count, average)

    def _post_optim_complete_log_hook(self, optim_steps: int, average_losses: TensorDictBase | None) -> None:
        if average_losses is not None and self._distributed() and len(average_losses.keys()):
            keys = sorted(average_losses.keys())
            vec = all_reduce(torch.stack([average_losses.get(k).reshape(()).float() for k in keys]))
            average_losses = TensorDict({k: vec[i] / self._world_size for i, k in enumerate(keys)}, [])
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

    # ---- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's trainer state plus ``learner.checkpoint()``, in memory."""
        return {**self._rank_state(), "learner": self.learner.checkpoint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_rank_state(state_dict)
        self.learner.load_checkpoint(state_dict["learner"])  # validated before it changes anything
        self._load_rank_state(state_dict)
        self._publish_after_load()
        _set_rng_state(state_dict["rng"], self._env_plan)

    def _collector_state(self) -> dict[str, Any]:
        collector = self.collector
        if collector is None:
            return {"collector": None, "carrier": None, "env_rng": []}
        if self._collector_state_at_end is not None:
            return self._collector_state_at_end  # train() ended and shut the collector down
        if self._collector_closed:
            raise RuntimeError(
                f"The trainer's collector ({type(collector).__name__}) was shut down by a train() that failed, so "
                "its state can no longer be read. Save checkpoints during training (save_trainer_interval=...)."
            )
        return {"collector": collector.state_dict(), "carrier": _carrier_state(collector, self._env_plan),
                "env_rng": [g.get_state() for g in self._env_plan.generators()]}

    def _rank_state(self) -> dict[str, Any]:
        collector = self._collector_state()
        rng = _rng_state()
        rng["env"] = collector["env_rng"]
        return {
            "format": CHECKPOINT_FORMAT,
            "world_size": self._world_size,
            "rank": self.global_rank,
            "state": {k: v for k, v in self._get_state().items()},
            "collector": collector["collector"],
            "carrier": collector["carrier"],
            "modules": {name: module.state_dict() for name, module in self._modules.items()},
            "rng": rng,
        }

    def _check_rank_state(self, state: Any, source: str = "the trainer state", resizing: bool = False) -> None:
        """Raise, before anything is loaded, if this rank's state cannot be restored here.

        ``resizing``: the state comes from a run with another number of ranks (see ``_resize``).
        """
        def refuse(what: str) -> ValueError:
            return ValueError(f"{source}: {what}; nothing was loaded. Pass a checkpoint folder written by "
                              "fabric_learner's Trainer.save_checkpoint.")

        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise refuse(f"format is {found!r}, expected {CHECKPOINT_FORMAT!r}")
        if not _is_count(state.get("world_size")) or state["world_size"] < 1:
            raise refuse(f"'world_size' is {state.get('world_size')!r}, expected a positive integer")
        if state["world_size"] != self._world_size and not resizing:
            raise ValueError(
                f"This rank's state was saved by {state['world_size']} rank(s) and this run has {self._world_size}; "
                "load the whole checkpoint folder with Trainer.load_from_file, which redistributes it."
            )
        counters = state.get("state")
        if not isinstance(counters, dict) or not all(_is_count(counters.get(k)) for k in _COUNTERS) \
                or not isinstance(counters.get("_last_log"), dict) \
                or not all(isinstance(v, (int, float)) for v in counters["_last_log"].values()):
            raise refuse(f"'state' is not the trainer's counters ({', '.join(_COUNTERS)}, _last_log)")
        modules = state.get("modules")
        if not isinstance(modules, dict):
            raise refuse("'modules' is not a mapping of hook names to their states")
        missing = [name for name in self._modules if name not in modules]
        if missing:
            raise ValueError(f"The checkpoint has no state for the registered hooks {missing}; register the same "
                             "hooks as the run that saved it.")
        for name, module in self._modules.items():
            saved = modules[name]
            expected = set(module.state_dict())
            if not isinstance(saved, dict) or set(saved) != expected:
                found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
                raise refuse(f"the state of hook {name!r} has entries {found}, expected {sorted(expected)}")
        if state.get("collector") is not None and not isinstance(state["collector"], dict):
            raise refuse("'collector' is not a collector state dict")
        carrier = state.get("carrier")
        if carrier is not None and not (isinstance(carrier, dict) and isinstance(carrier.get("data"), dict)
                                        and isinstance(carrier.get("batch_size"), list)
                                        and all(_is_count(d) for d in carrier["batch_size"])):
            raise refuse("'carrier' is not a collector's in-flight tensordict")
        _check_rng_state(state.get("rng"), refuse)

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        """Apply a checked rank state (``_check_rank_state``) but its random state, set once publishing is done."""
        if self.collector is not None and state["collector"] is not None:
            self.collector.load_state_dict(state["collector"])
            _restore_carrier(self.collector, state.get("carrier"))
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
        final = Path(path)
        partial, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
        rank = self.global_rank
        if rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        self._barrier()
        self.learner.save(partial / _LEARNER_FILE)
        torch.save(self._rank_state(), partial / f"rank{rank}.pt")
        self._barrier()
        if rank == 0:
            meta = {"format": CHECKPOINT_FORMAT, "world_size": self._world_size, "collected_frames": self.collected_frames,
                    "optim_steps": self._optim_count, "num_updates": self.learner.num_updates}
            (partial / _META_FILE).write_text(json.dumps(meta))
            if old.exists():
                shutil.rmtree(old)
            if final.exists():
                final.rename(old)
            partial.rename(final)
            if old.exists():
                shutil.rmtree(old)
        self._barrier()

    def load_from_file(self, file: str | os.PathLike, **kwargs) -> Trainer:
        """Resume from a checkpoint folder written by :meth:`save_checkpoint` (every rank calls it).

        Restores the learner (weights, optimizer state, update count), then this rank's
        counters, hooks (replay buffer), collector and RNG states, and publishes the weights
        to the collector. ``weights_only`` loading: no code is unpickled.
        """
        path = Path(file)
        if not (path / _META_FILE).exists() and (path.with_name(path.name + ".old") / _META_FILE).exists():
            path = path.with_name(path.name + ".old")  # a crash hit the swap: the previous checkpoint
        if not (path / _META_FILE).exists():
            raise FileNotFoundError(f"No fabric_learner trainer checkpoint at {file} (no {_META_FILE}).")
        meta = read_json(path / _META_FILE, CHECKPOINT_FORMAT)
        saved_world = meta.get("world_size")
        if not _is_count(saved_world) or saved_world < 1:
            raise ValueError(f"{path / _META_FILE}: 'world_size' is {saved_world!r}, expected a positive integer; "
                             "nothing was loaded.")
        ranks = [self.global_rank] if saved_world == self._world_size else list(range(saved_world))
        files = [path / f"rank{r}.pt" for r in ranks]
        learner_file = path / _LEARNER_FILE
        for inner in (*files, learner_file):  # files of the folder itself, never links out of it
            if inner.is_symlink():
                raise ValueError(f"{inner} is a symlink; a trainer checkpoint holds only its own files. Nothing "
                                 "was loaded.")
        states = [weights_only_load(f) for f in files]
        for f, state in zip(files, states):
            self._check_rank_state(state, str(f), resizing=saved_world != self._world_size)
        if saved_world != self._world_size:
            return self._load_resized(states, learner_file)
        state = states[0]
        self.learner.load(learner_file)  # validated before it changes anything
        self._load_rank_state(state)
        self._publish_after_load()
        _set_rng_state(state["rng"], self._env_plan)
        return self

    def _load_resized(self, states: list[dict[str, Any]], learner_file: Path) -> Trainer:
        """Resume a checkpoint written by ``len(states)`` ranks on this run's (see ``_resize``)."""
        replay = {name: m for name, m in self._modules.items() if isinstance(m, ReplayBufferTrainer)}
        shares = {name: replay_share(m.replay_buffer, [s["modules"][name]["replay_buffer"] for s in states],
                                     self.global_rank, self._world_size) for name, m in replay.items()}
        self.learner.load(learner_file)  # reshards; validated before it changes anything
        first = states[0]
        for name, module in self._modules.items():
            if name in replay:
                fill_replay(module.replay_buffer, *shares[name])
            else:
                module.load_state_dict(first["modules"][name])
        self._restore_counters(first["state"])  # global: the same on every rank that wrote them
        warnings.warn(
            f"The checkpoint was written by {len(states)} rank(s) and this run has {self._world_size}: the learner "
            "was resharded and the replay buffers' samples dealt over the ranks, but collectors start afresh and "
            "random generators are re-seeded from the frame count, so the run does not continue bit for bit.",
            stacklevel=3,
        )
        reseed(self.collected_frames, self.global_rank)
        self._publish_after_load()
        return self


# ---- per-rank state helpers ---------------------------------------------------------------------


_COUNTERS = ("collected_frames", "_last_save", "_optim_count")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_rng_state(rng: Any, refuse) -> None:
    """The random states ``_rng_state`` writes: torch, numpy's MT19937, python's, env generators."""
    torch_size = torch.get_rng_state().numel()

    def generator_state(t: Any, size: int | None = None) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and size in (None, t.numel())

    n = rng.get("numpy") if isinstance(rng, dict) else None
    python = rng.get("python") if isinstance(rng, dict) else None
    ok = (isinstance(rng, dict) and generator_state(rng.get("torch"), torch_size)
          and isinstance(n, dict) and n.get("kind") == "MT19937" and isinstance(n.get("keys"), torch.Tensor)
          and n["keys"].dtype == torch.int64 and n["keys"].shape == (624,) and _is_count(n.get("pos"))
          and _is_count(n.get("has_gauss")) and isinstance(n.get("cached_gaussian"), float)
          and isinstance(python, (tuple, list)) and len(python) == 3 and python[0] == 3
          and isinstance(python[1], (tuple, list)) and len(python[1]) == 625 and all(_is_count(x) for x in python[1])
          and (python[2] is None or isinstance(python[2], float))
          and isinstance(rng.get("env", []), list) and all(generator_state(g) for g in rng.get("env", []))
          and all(generator_state(g) for g in rng.get("cuda", [])))
    if not ok:
        raise refuse("'rng' is not the random states of torch, numpy, python and the environments")


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], env_plan: _EnvPlan) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(_tuplify(state["python"]))
    gens = env_plan.generators()
    if len(gens) == len(state.get("env", [])):
        for g, s in zip(gens, state["env"]):
            g.set_state(s)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


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


# ---- what a checkpoint holds of the collector's environment ------------------------------------

_MAX_ENV_NODES = 256  # envs reachable from one collector's env (wrappers, sub-envs) before we give up


class _EnvPlan:
    """What a checkpoint saves of one collector's environment, decided once while the env is alive.

    The walk reads only instance dictionaries (``vars``) and class attributes: a batched env's
    ``__getattr__`` forwards unknown names to its workers (and restarts a closed ``ParallelEnv``),
    and a ``TransformedEnv`` forwards them to its base env, so ``hasattr``/``getattr`` on them can
    recurse, raise or loop. What the walk finds:

    - ``holders``: the envs living in this process (wrappers, base envs, ``SerialEnv`` sub-envs),
      whose ``torch.Generator`` attributes (e.g. ``PendulumEnv.rng``) are saved and restored;
      envs in worker processes (``ParallelEnv``, multi-process collectors) are out of reach.
    - ``stateless``: every env's whole state travels in the tensordict (torchrl's
      ``_supports_set_state``), so the collector's in-flight tensordict is saved and a resume
      continues the episodes under way; for any other env it would desync env and data, so a
      resume starts from the fresh collector's own reset.
    """

    def __init__(self, collector) -> None:
        self.holders: list[EnvBase] = []
        self.stateless = False
        env = vars(collector).get("env") if collector is not None else None
        if isinstance(env, EnvBase):
            seen: dict[int, EnvBase] = {}
            self.stateless = _walk_env(env, seen)
            self.holders = list(seen.values())

    def generators(self) -> list[torch.Generator]:
        found: list[torch.Generator] = []
        for env in self.holders:
            found.extend(v for v in vars(env).values() if isinstance(v, torch.Generator) and all(v is not f for f in found))
        return found


def _walk_env(env: EnvBase, seen: dict[int, EnvBase]) -> bool:
    """Record ``env`` and the envs inside it in ``seen``; whether they are all stateless.

    Stops with an error naming the env if the nesting looks unbounded (a cycle is skipped).
    """
    if id(env) in seen:
        return True
    if len(seen) >= _MAX_ENV_NODES:
        raise RuntimeError(
            f"Trainer: the collector's environment holds more than {_MAX_ENV_NODES} nested environments (reached "
            f"{type(env).__name__}); checkpointing cannot inspect it. Build the collector around a flatter "
            "environment, or pass collector=None and drive the trainer with optim_steps()."
        )
    seen[id(env)] = env
    own = vars(env)
    children = [m for m in (own.get("_modules") or {}).values() if isinstance(m, EnvBase)]  # TransformedEnv.base_env
    sub_envs = own.get("_envs")  # SerialEnv's in-process workers, once started
    if isinstance(sub_envs, (list, tuple)):
        children.extend(e for e in sub_envs if isinstance(e, EnvBase))
    meta = own.get("meta_data")  # a batched env: its workers' metadata, collected when it was built
    if meta is not None:
        metas = meta if isinstance(meta, (list, tuple)) else [meta]
        stateless = all(bool(getattr(m, "supports_set_state", False)) for m in metas)
    elif children:
        stateless = True  # a wrapper: stateless when everything it wraps is
    else:
        flag = inspect.getattr_static(type(env), "_supports_set_state", False)
        stateless = flag is True
    for child in children:
        stateless = _walk_env(child, seen) and stateless
    return stateless


def _carrier_state(collector, plan: _EnvPlan) -> dict[str, Any] | None:
    """The collector's in-flight tensordict, for stateless envs only (elsewhere it would desync)."""
    if not plan.stateless:
        return None
    carrier = vars(collector).get("_carrier")
    if not isinstance(carrier, TensorDictBase):
        return None
    leaves = dict(carrier.items(include_nested=True, leaves_only=True))
    if not all(isinstance(v, torch.Tensor) for v in leaves.values()):
        return None
    return {"data": carrier.to_dict(), "batch_size": list(carrier.batch_size)}


def _restore_carrier(collector, state: dict[str, Any] | None) -> None:
    if state is None or not isinstance(vars(collector).get("_carrier"), TensorDictBase):
        return
    current = collector._carrier
    collector._carrier = TensorDict(state["data"], batch_size=state["batch_size"], device=current.device)

