"""Asynchronous collection on every rank: policy versions, stale-sample admission, backpressure.

``Trainer(..., async_collection=AsyncCollection(max_policy_lag=8))`` lets each rank's collector
(typically torchrl's ``AsyncCollector``/``MultiAsyncCollector``, whose environments step in other
processes) keep collecting while the learner trains:

- **Policy versions.** The collector's policy is a :class:`VersionedPolicy`: it carries the
  version of its weights as a buffer and writes it into every frame it acts on (key
  ``"policy_version"``), read *before* the policy acts. The version is the learner's
  ``num_updates`` when those weights were published, and it travels with the weights (one
  ``update_policy_weights_`` call), so a frame is never labelled newer than what produced it.
- **Admission.** When a batch reaches the learner, frames whose lag ``num_updates - version``
  exceeds ``max_policy_lag`` are masked out (``("collector", "mask")``) before the batch hooks
  write it into the replay buffer, and counted (``dropped_frames``). Frames count towards
  ``total_frames`` whether admitted or not: they were collected.
- **Backpressure.** A thread in the learner's process pulls batches from the collector into a
  queue of at most ``max_queued_batches``; while it is full the thread does not ask the
  collector for more, so the collector's workers stop after their current batch. What exists
  at once is bounded: queued batches + one held by the thread + one per collector worker.
- **Ranks in step.** Ranks meet once per round (one all-reduce): each has taken whatever its
  queue held. A round in which no rank received a batch is a poll and takes no update; otherwise
  every rank takes ``optim_steps_per_batch`` updates per batch received (averaged over ranks,
  rounded up) from its own replay buffer, so all ranks take the same number of updates however
  slow one rank's environment is. A rank that stops or dies makes the round's collective fail,
  with an error naming the rank that raised it and the round.
- **Checkpoints** hold what was admitted (replay buffer), the learner and counters. Queued
  batches and rollouts in progress are *not* saved: a resume starts the collector afresh with
  the restored weights (a warning says how many queued frames the checkpoint left out).
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from fabric_learner.collectives import all_reduce

__all__ = ["AsyncCollection", "VersionedPolicy"]

VERSION_KEY = "policy_version"
MASK_KEY = ("collector", "mask")
# What a checkpoint holds of an asynchronous collector: nothing (see the module docstring).
NO_COLLECTOR_STATE: dict[str, Any] = {"collector": None, "carrier": None, "env_rng": []}


class VersionedPolicy(TensorDictModuleBase):
    """A policy that stamps every frame with the version of the weights it acts with.

    ``VersionedPolicy(policy)`` runs ``policy`` and writes ``version`` (an int64 buffer, part of
    its weights) under ``key`` for every element of the batch. The version is read before the
    policy runs: if new weights and their version are written while it acts, the frame is
    labelled with the older version, never a newer one.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from fabric_learner import VersionedPolicy
        >>> policy = VersionedPolicy(TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["action_value"]))
        >>> policy(TensorDict(observation=torch.randn(3, 4), batch_size=[3]))["policy_version"]
        tensor([0, 0, 0])

        New weights arrive together with their version, as a collector's weight update sends them:

        >>> weights = VersionedPolicy.weights(TensorDict.from_module(policy.policy), version=5)
        >>> _ = weights.to_module(policy)
        >>> policy(TensorDict(observation=torch.randn(3, 4), batch_size=[3]))["policy_version"]
        tensor([5, 5, 5])
    """

    def __init__(self, policy: nn.Module, key: str = VERSION_KEY) -> None:
        super().__init__()
        self.policy = policy
        self.key = key
        self.in_keys = list(getattr(policy, "in_keys", []))
        self.out_keys = [*getattr(policy, "out_keys", []), key]
        self.register_buffer("version", torch.zeros((), dtype=torch.int64))

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        version = self.version.clone()
        tensordict = self.policy(tensordict)
        tensordict.set(self.key, version.expand(tensordict.batch_size).clone())
        return tensordict

    @staticmethod
    def weights(policy_weights: TensorDictBase, version: int) -> TensorDictBase:
        """The weights of a ``VersionedPolicy`` around a policy with ``policy_weights``."""
        return TensorDict({"policy": policy_weights, "version": torch.tensor(int(version), dtype=torch.int64)}, [])


@dataclass(frozen=True)
class AsyncCollection:
    """How a ``Trainer`` collects asynchronously (pass it as ``async_collection=``).

    Args:
        max_policy_lag: frames acted with weights more than this many optimizer updates older
            than the learner's when they arrive are dropped (counted, never trained on).
            ``None`` admits every frame.
        max_queued_batches: batches waiting between collection and learning on each rank; the
            collector is not asked for more while the queue is full.
        poll_s: how long a rank waits for a batch before meeting the other ranks when it has
            none (a round without any new batch on any rank takes no update).
        key: the key under which :class:`VersionedPolicy` writes the version.

    Examples:
        >>> from fabric_learner import AsyncCollection
        >>> config = AsyncCollection(max_policy_lag=8)
        >>> config.max_queued_batches, config.key
        (2, 'policy_version')
        >>> AsyncCollection(max_queued_batches=0)
        Traceback (most recent call last):
            ...
        ValueError: max_queued_batches must be a positive int, got 0: the queue must hold a batch.

        It takes effect as ``Trainer(learner=..., collector=..., async_collection=config, ...)``, with a
        collector whose policy is a :class:`VersionedPolicy`. On one rank that is a learner and a collector
        working side by side; with more ranks each has its own queue and they meet once per round.
    """

    max_policy_lag: int | None = None
    max_queued_batches: int = 2
    poll_s: float = 0.01
    key: str = VERSION_KEY

    def __post_init__(self) -> None:
        lag = self.max_policy_lag
        if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 0):
            raise ValueError(f"max_policy_lag must be a non-negative int (optimizer updates) or None, got {lag!r}.")
        q = self.max_queued_batches
        if not isinstance(q, int) or isinstance(q, bool) or q < 1:
            raise ValueError(f"max_queued_batches must be a positive int, got {q!r}: the queue must hold a batch.")
        if not isinstance(self.poll_s, (int, float)) or isinstance(self.poll_s, bool) or not self.poll_s > 0:
            raise ValueError(f"poll_s must be a positive number of seconds, got {self.poll_s!r}.")


# ---- the collector side ------------------------------------------------------------------------


def versioned_policy(collector) -> VersionedPolicy:
    """The collector's :class:`VersionedPolicy`, or an error saying how to build one."""
    for attr in ("policy", "_wrapped_policy", "_policy_w_state_dict"):
        module = vars(collector).get(attr)
        if isinstance(module, VersionedPolicy):
            return module
    found = next((type(vars(collector)[a]).__name__ for a in ("policy", "_wrapped_policy") if vars(collector).get(a)
                  is not None), "no policy")
    raise TypeError(
        f"Asynchronous collection needs the collector's policy to stamp each frame with its policy version, but "
        f"{type(collector).__name__} runs {found}. Build the collector with "
        "fabric_learner.VersionedPolicy(<a copy of the policy>) as its policy."
    )


class _Feeder(threading.Thread):
    """Pulls batches from the collector into a bounded queue (the only thread touching the collector)."""

    def __init__(self, collector, maxsize: int) -> None:
        super().__init__(name="fabric_learner-async-feeder", daemon=True)
        self.collector = collector
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.exhausted = False
        self.high_water = 0  # the most batches ever waiting in the queue
        self.yielded = 0  # batches the collector has handed over
        self.delivered = threading.Event()  # set once a batch (or the end, or an error) has come

    def run(self) -> None:
        try:
            for batch in self.collector:
                self.yielded += 1
                while not self.stop_event.is_set():
                    try:
                        self.queue.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                self.high_water = max(self.high_water, self.queue.qsize())
                self.delivered.set()
                if self.stop_event.is_set():
                    return
            self.exhausted = True
        except BaseException as err:  # reported by the learner's thread
            self.error = err
        finally:
            self.delivered.set()

    def take(self, wait_s: float) -> list[TensorDictBase]:
        """Every batch waiting; waits up to ``wait_s`` for the first one when none is."""
        out = []
        try:
            out.append(self.queue.get(timeout=wait_s))
        except queue.Empty:
            pass
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        if not out and self.error is not None:
            raise RuntimeError(f"The collector failed in its feeder thread: {self.error!r}") from self.error
        return out

    def queued_frames(self) -> int:
        with self.queue.mutex:
            return sum(int(b.numel()) for b in self.queue.queue)

    def finish(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self.join(timeout)


# ---- the loop -----------------------------------------------------------------------------------


class _State:
    """What the asynchronous loop counts on this rank (global values where said)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.admitted_frames = 0  # this rank
        self.dropped_frames = 0  # this rank
        self.global_dropped_frames = 0
        self.max_lag_seen = 0  # this rank, over admitted frames
        self.batches = 0  # this rank
        self.high_water = 0
        self.max_backlog = 0


def admit(batch: TensorDictBase, version_now: int, cfg: AsyncCollection) -> tuple[TensorDictBase, int, int, int, int]:
    """Mask out frames staler than ``cfg.max_policy_lag``: ``(batch, collected, admitted, dropped, max lag admitted)``."""
    if cfg.key not in batch.keys():
        raise KeyError(f"A collected batch has no {cfg.key!r} entry: the collector's policy must be a VersionedPolicy.")
    versions = batch.get(cfg.key)
    valid = batch.get(MASK_KEY) if MASK_KEY in batch.keys(True) else torch.ones(batch.batch_size, dtype=torch.bool)
    lag = version_now - versions
    keep = valid if cfg.max_policy_lag is None else valid & (lag <= cfg.max_policy_lag)
    if "next" in batch.keys() and "truncated" in batch["next"].keys() and batch.ndim >= 2:
        batch["next", "truncated"][..., -1] = True  # as torchrl's ReplayBufferTrainer marks a flattened rollout's end
    batch.set(MASK_KEY, keep)
    collected, admitted = int(valid.sum()), int(keep.sum())
    max_lag = int(lag[keep].max()) if admitted else 0
    return batch, collected, admitted, collected - admitted, max_lag


def _round_collective(trainer, values: list[int], round_) -> list[int]:
    """Sum ``values`` over ranks; a failure names this rank and the round."""
    if not trainer._distributed():
        return list(values)
    try:
        return [int(v) for v in all_reduce(torch.tensor(values, dtype=torch.int64)).tolist()]
    except RuntimeError as err:
        from fabric_learner.fabric import _lost_peer

        lost = _lost_peer(err)
        if lost is None:
            raise
        raise RuntimeError(
            f"Rank {trainer.global_rank}: asynchronous round {round_} could not complete a collective with the other "
            f"ranks ({lost}). Another rank ended, died, or is busy elsewhere for longer than the process-group "
            "timeout; see that rank's output for its own error."
        ) from err


def publish(trainer, version: int) -> None:
    """Every rank: the learner's weights and their version to this rank's collector (a collective under FSDP)."""
    learner = trainer.learner
    if learner.policy is None:
        raise ValueError("Asynchronous collection publishes the learner's policy weights: build the learner with "
                         "policy=<the policy module the loss trains>.")
    weights = learner.get_weights(cpu_offload=False).detach().to("cpu")
    trainer.collector.update_policy_weights_(VersionedPolicy.weights(weights, version))


def train(trainer, cfg: AsyncCollection) -> None:
    """The asynchronous loop of ``fabric_learner.Trainer.train`` (see the module docstring)."""
    state = trainer._async_state
    init_random = int(getattr(trainer.collector, "init_random_frames", 0) or 0)
    publish(trainer, trainer.learner.num_updates)  # the collector acts with the learner's weights from the start
    trainer._setup_hook()
    feeder = _Feeder(trainer.collector, cfg.max_queued_batches)
    trainer._async_feeder = feeder
    feeder.start()
    template: TensorDictBase | None = None
    try:
        # Every rank's collector delivers its first batch before any rank takes one: a fast rank would
        # otherwise spend the frame budget while a slow one is still starting its workers.
        warmup = 0
        while True:
            feeder.delivered.wait(cfg.poll_s)
            if feeder.error is not None:
                raise RuntimeError(f"The collector failed in its feeder thread: {feeder.error!r}") from feeder.error
            warmup += 1
            if _round_collective(trainer, [int(not feeder.delivered.is_set())], f"0 (warm-up poll {warmup})")[0] == 0:
                break
        while True:
            state.rounds += 1
            # collected but not yet taken by the learner: the queue plus the one the feeder holds
            state.max_backlog = max(state.max_backlog, feeder.yielded - state.batches)
            raw = feeder.take(cfg.poll_s)
            version_now = trainer.learner.num_updates
            admitted_batches, collected = [], 0
            dropped = 0
            for batch in raw:
                batch, c, a, d, lag = admit(batch, version_now, cfg)
                collected += c
                dropped += d
                state.admitted_frames += a
                state.dropped_frames += d
                state.max_lag_seen = max(state.max_lag_seen, lag)
                state.batches += 1
                if a:  # a wholly stale batch never reaches the batch hooks (nor the replay buffer)
                    admitted_batches.append(trainer._process_batch_hook(batch))
            state.high_water = max(state.high_water, feeder.high_water)
            if admitted_batches:
                template = admitted_batches[-1]
            not_ready = int(template is None)
            stop = int(bool(trainer._stop_training))
            exhausted = int(feeder.exhausted and feeder.queue.empty())
            g_collected, g_batches, g_dropped, g_not_ready, g_stop, g_exhausted, g_init = _round_collective(
                trainer, [collected, len(raw), dropped, not_ready, stop, exhausted, init_random], state.rounds)
            state.global_dropped_frames += g_dropped
            if g_exhausted:
                break
            trainer.collected_frames += g_collected * trainer.frame_skip
            if (g_batches == 0 or g_not_ready) and not g_stop and trainer.collected_frames < trainer.total_frames:
                continue  # a poll (no rank has anything new), or a rank still waits for its first admitted batch
            # Ranks without a new batch this round log an empty one (the log hooks may be collectives).
            if len(admitted_batches) > 1:
                batch = torch.cat(admitted_batches, 0)
            elif admitted_batches:
                batch = admitted_batches[0]
            else:
                batch = template[:0] if template is not None else None
            if g_not_ready:  # stopping before every rank admitted a batch: no hook may see a missing batch
                batch = None
            else:
                trainer._pre_steps_log_hook(batch)
            if g_not_ready == 0 and trainer.collected_frames >= g_init and g_batches:
                repeats = math.ceil(g_batches / trainer.world_size)
                for _ in range(repeats):
                    trainer.optim_steps(batch)
                publish(trainer, trainer.learner.num_updates)
            trainer._post_steps_hook()
            if batch is not None:
                trainer._post_steps_log_hook(batch)
            if g_stop:
                if not trainer._stop_training:
                    trainer.request_stop("another rank requested a stop")
                trainer.save_trainer(force_save=True)
                break
            if trainer._pbar is not None:
                trainer._pbar.update(g_collected * trainer.frame_skip)
                trainer._pbar_description()
            if trainer.collected_frames >= trainer.total_frames:
                trainer.save_trainer(force_save=True)
                break
            trainer.save_trainer()
    finally:
        feeder.finish()  # returns once the collector yields its current batch (or after the timeout)
    trainer._shutdown_hook()
    trainer._collector_state_at_end = NO_COLLECTOR_STATE
    trainer._close_collector(raise_on_error=True)


def stats(trainer) -> dict[str, Any]:
    """This rank's asynchronous counters (``Trainer.async_stats``)."""
    s = trainer._async_state
    return {"rounds": s.rounds, "batches": s.batches, "admitted_frames": s.admitted_frames,
            "dropped_frames": s.dropped_frames, "global_dropped_frames": s.global_dropped_frames,
            "max_admitted_lag": s.max_lag_seen, "queue_high_water": s.high_water,
            "max_backlog": s.max_backlog}


def warn_discarded(meta_async: dict[str, Any] | None) -> None:
    if not meta_async:
        return
    warnings.warn(
        "Resumed an asynchronous run: its checkpoint holds the learner, the replay buffers and the counters, not "
        f"the {meta_async.get('queued_frames', 0)} frames that were queued nor the rollouts in progress when it was "
        "written; the collector starts afresh from its own reset, acting with the restored weights.",
        stacklevel=3,
    )

