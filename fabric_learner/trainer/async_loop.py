"""The asynchronous rounds of ``fabric_learner.Trainer`` (``async_collection=AsyncCollection(...)``).

What the loop guarantees (versions, admission, backpressure, ranks in step, checkpoints) is said in
``fabric_learner.asynchronous``, which holds the public configuration. The loop drives its trainer
only through ``AsyncHost``, the few things a Trainer offers it, so it never reads the Trainer's
private state.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from fabric_learner.asynchronous import MASK_KEY, NO_COLLECTOR_STATE, AsyncCollection, VersionedPolicy
from fabric_learner.collectives import all_reduce


class AsyncHost(Protocol):
    """What the asynchronous loop needs of the trainer that runs it."""

    learner: Any
    collector: Any
    frame_skip: int
    total_frames: int
    collected_frames: int
    init_random_frames: int  # this rank's collector's random warm-up, as configured
    world_size: int
    global_rank: int

    def distributed(self) -> bool: ...

    def run_hook(self, stage: str, *args: Any) -> Any:
        """torchrl's hook stage ``stage`` (``"setup"``, ``"process_batch"``, ``"pre_steps_log"``,
        ``"post_steps"``, ``"post_steps_log"``, ``"shutdown"``) on ``args``."""

    def stop_requested(self) -> bool: ...

    def request_stop(self, reason: str) -> None: ...

    def optim_steps(self, batch: TensorDictBase) -> None: ...

    def save_trainer(self, force_save: bool = False) -> None: ...

    def advance_progress(self, frames: int) -> None: ...

    def end_collection(self, state: dict[str, Any]) -> None:
        """Keep ``state`` as the collector's final state and shut the collector down."""


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
        except BaseException as err:  # noqa: BLE001 - reported by the learner's thread
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


class AsyncLoop:
    """One rank's asynchronous collection: its feeder thread and counters, run by ``run(host)``."""

    def __init__(self, cfg: AsyncCollection) -> None:
        self.cfg = cfg
        self.feeder: _Feeder | None = None
        self.rounds = 0
        self.admitted_frames = 0  # this rank
        self.dropped_frames = 0  # this rank
        self.global_dropped_frames = 0
        self.max_lag_seen = 0  # this rank, over admitted frames
        self.batches = 0  # this rank
        self.high_water = 0
        self.max_backlog = 0

    def stats(self) -> dict[str, Any]:
        """This rank's counters (``Trainer.async_stats``)."""
        return {"rounds": self.rounds, "batches": self.batches, "admitted_frames": self.admitted_frames,
                "dropped_frames": self.dropped_frames, "global_dropped_frames": self.global_dropped_frames,
                "max_admitted_lag": self.max_lag_seen, "queue_high_water": self.high_water,
                "max_backlog": self.max_backlog}

    def queued_frames(self) -> int:
        """Frames waiting in the queue now: what a checkpoint written now leaves out."""
        return self.feeder.queued_frames() if self.feeder is not None else 0

    def abort(self) -> None:
        """After an error: ask the feeder thread to stop."""
        if self.feeder is not None:
            self.feeder.stop_event.set()

    def run(self, host: AsyncHost) -> None:
        """The rounds (see the module docstring of ``fabric_learner.asynchronous``)."""
        cfg = self.cfg
        init_random = host.init_random_frames  # as configured (a resize shortens the collector's own)
        publish(host, host.learner.num_updates)  # the collector acts with the learner's weights from the start
        host.run_hook("setup")
        feeder = self.feeder = _Feeder(host.collector, cfg.max_queued_batches)
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
                if _round_collective(host, [int(not feeder.delivered.is_set())], f"0 (warm-up poll {warmup})", feeder)[0] == 0:
                    break
            while True:
                self.rounds += 1
                # collected but not yet taken by the learner: the queue plus the one the feeder holds
                self.max_backlog = max(self.max_backlog, feeder.yielded - self.batches)
                raw = feeder.take(cfg.poll_s)
                version_now = host.learner.num_updates
                admitted_batches, collected = [], 0
                dropped = 0
                for batch in raw:
                    batch, c, a, d, lag = admit(batch, version_now, cfg)
                    collected += c
                    dropped += d
                    self.admitted_frames += a
                    self.dropped_frames += d
                    self.max_lag_seen = max(self.max_lag_seen, lag)
                    self.batches += 1
                    if a:  # a wholly stale batch never reaches the batch hooks (nor the replay buffer)
                        admitted_batches.append(host.run_hook("process_batch", batch))
                self.high_water = max(self.high_water, feeder.high_water)
                if admitted_batches:
                    template = admitted_batches[-1]
                not_ready = int(template is None)
                stop = int(host.stop_requested())
                exhausted = int(feeder.exhausted and feeder.queue.empty())
                g_collected, g_batches, g_dropped, g_not_ready, g_stop, g_exhausted, g_init = _round_collective(
                    host, [collected, len(raw), dropped, not_ready, stop, exhausted, init_random], self.rounds, feeder)
                self.global_dropped_frames += g_dropped
                if g_exhausted:
                    break
                host.collected_frames += g_collected * host.frame_skip
                if (g_batches == 0 or g_not_ready) and not g_stop and host.collected_frames < host.total_frames:
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
                    host.run_hook("pre_steps_log", batch)
                if g_not_ready == 0 and host.collected_frames >= g_init and g_batches:
                    repeats = math.ceil(g_batches / host.world_size)
                    for _ in range(repeats):
                        host.optim_steps(batch)
                    publish(host, host.learner.num_updates)
                host.run_hook("post_steps")
                if batch is not None:
                    host.run_hook("post_steps_log", batch)
                if g_stop:
                    if not host.stop_requested():
                        host.request_stop("another rank requested a stop")
                    host.save_trainer(force_save=True)
                    break
                host.advance_progress(g_collected * host.frame_skip)
                if host.collected_frames >= host.total_frames:
                    host.save_trainer(force_save=True)
                    break
                host.save_trainer()
        finally:
            feeder.finish()  # returns once the collector yields its current batch (or after the timeout)
        host.run_hook("shutdown")
        host.end_collection(dict(NO_COLLECTOR_STATE))


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


def _round_collective(host: AsyncHost, values: list[int], round_, feeder: _Feeder) -> list[int]:
    """Sum ``values`` over ranks; a failure names this rank, the round and what the peers last announced, or is
    this rank's own collector's error when it has one (a peer that left for the same reason broke the round)."""
    if not host.distributed():
        return list(values)
    try:
        return [int(v) for v in all_reduce(torch.tensor(values, dtype=torch.int64)).tolist()]
    except RuntimeError as err:
        from fabric_learner.fabric import _lost_peer
        from fabric_learner.launch import call_order as _call_order

        lost = _lost_peer(err)
        if lost is None:
            raise
        if feeder.error is not None:
            raise RuntimeError(f"The collector failed in its feeder thread: {feeder.error!r}") from feeder.error
        _call_order.note_failure(f"failed (in asynchronous round {round_})")
        peers = _call_order.peer_announcements()
        raise RuntimeError(
            f"Rank {host.global_rank}: asynchronous round {round_} could not complete a collective with the other "
            f"ranks ({lost}). {peers[:1].upper() + peers[1:] + '. ' if peers else ''}Another rank ended, died, or is "
            "busy elsewhere for longer than the process-group timeout; see that rank's output for its own error."
        ) from err


def publish(host: AsyncHost, version: int) -> None:
    """Every rank: the learner's weights and their version to this rank's collector (a collective under FSDP)."""
    learner = host.learner
    if learner.policy is None:
        raise ValueError("Asynchronous collection publishes the learner's policy weights: build the learner with "
                         "policy=<the policy module the loss trains>.")
    weights = learner.get_weights(cpu_offload=False).detach().to("cpu")
    host.collector.update_policy_weights_(VersionedPolicy.weights(weights, version))


def warn_discarded(meta_async: dict[str, Any] | None) -> None:
    if not meta_async:
        return
    warnings.warn(
        "Resumed an asynchronous run: its checkpoint holds the learner, the replay buffers and the counters, not "
        f"the {meta_async.get('queued_frames', 0)} frames that were queued nor the rollouts in progress when it was "
        "written; the collector starts afresh from its own reset, acting with the restored weights.",
        stacklevel=3,
    )
