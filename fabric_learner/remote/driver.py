"""One learner rank's collection driver: a process of its own that runs torchrl's ``DistributedCollector``.

Why a process of its own: torchrl's distributed collector makes its group with the collectors the
*default* process group of the process that drives it, and a learner rank's default group is the
learner's (Fabric's). So each learner rank starts a driver; the driver is rank 0 of a torchrl group
whose other ranks are the collectors that joined this build through the directory, and talks to
its learner rank through two queues: batches out (bounded: while it is full the driver asks its
collectors for nothing) and weights in (the latest publication wins).

A build waits for its collectors as long as its learner rank lets it (the learner rank decides when
waiting becomes an error, and says what it waits for, from the directory). It ends when a collector is reported dead, stops
beating (killed whole, its host gone), the group raises, the learner rank's process is gone, or the
learner asks it to stop; the learner rank then starts the next build, which the collectors join again.
Nothing is saved in a driver: what it held in flight is lost, and the learner counts it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

EXIT_FAULT = 75  # a collector of this build died: start the next one
BEAT_S = 15.0  # a collector whose supervisor has not beaten for this long is gone (killed whole, host lost)
FOREVER = 2**62  # torchrl's distributed collector loops while its frame count is below its total
GRACE_S = 5.0  # how long a stopping driver may take to shut its collectors down cleanly


@dataclass
class DriverSpec:
    """What a driver needs, pickled into its process."""

    address: str  # the directory
    host: str  # where this rank's collectors reach its driver
    rank: int  # the learner rank it serves
    expected: int  # collectors assigned to that rank
    create_env_fn: Any  # cloudpickled by torchrl on its way to the collectors
    policy: Any  # a VersionedPolicy: what the collectors act with
    frames_per_batch: int  # per collector and batch
    seed: int
    on_failure: str  # "restart": wait for every collector; "continue": go on with those back in time
    rejoin_s: float
    timeout_s: float
    collector_kwargs: dict
    started_at: float = 0.0  # time.time() when the learner rank started this driver


class SeededEnv:
    """An environment constructor that seeds what it builds (each collector gets its own seed)."""

    def __init__(self, create_env_fn, seed: int) -> None:
        self.create_env_fn = create_env_fn
        self.seed = seed

    def __call__(self):
        env = self.create_env_fn()
        env.set_seed(self.seed)
        return env


def _group_store(host: str):
    """``(store, port)``: the TCP store of this build's group, served here on a port the system picks as it binds.

    A port found free and bound later could be taken in between (``EADDRINUSE``: the build failed, a restart
    spent). torchrl's ``init_process_group`` in this process then joins the store as a client, as torchrun's
    ranks join their agent's (``TORCHELASTIC_USE_AGENT_STORE``); the collectors join it at ``port``. Keep
    the store for as long as the group lives.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(host, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # read by torch's tcp:// rendezvous only
    return store, store.port


def _wait_for_joins(directory, spec: DriverSpec, epoch: int, parent_alive) -> int:
    """How many collectors this build has: every one assigned, or under "continue" those back in time (the
    first build waits ``timeout_s`` for all, a rebuild ``rejoin_s``). Waits while none has joined, however long."""
    start = time.monotonic()
    while parent_alive():
        joined = min(directory.count(f"rank{spec.rank}", f"e{epoch}", "join"), spec.expected)
        if joined == spec.expected:
            return joined
        patience = spec.rejoin_s if epoch > 0 else spec.timeout_s
        if joined and spec.on_failure == "continue" and time.monotonic() - start >= patience:
            return joined
        time.sleep(0.05)
    return 0


def _silent_slot(directory, spec: DriverSpec, epoch: int, nodes: int, beats: dict, now: float) -> int | None:
    """A collector of this build whose supervisor stopped beating ``BEAT_S`` ago, if any (``beats``: slot ->
    (last count, when it changed))."""
    for slot in range(nodes):
        count = directory.count(f"rank{spec.rank}", f"e{epoch}", f"beat{slot}")
        last, since = beats.get(slot, (None, now))
        if count != last:
            beats[slot] = (count, now)
        elif now - since > BEAT_S:
            return slot
    return None


def run(spec: DriverSpec, epoch: int, batches, weights, stop) -> None:
    """The driver's process: build ``epoch`` of rank ``spec.rank``'s collection and feed ``batches``."""
    import torch
    from torchrl.collectors.distributed import DistributedCollector

    from fabric_learner.remote.directory import Directory

    torch.set_num_threads(1)
    parent = os.getppid()

    def parent_alive() -> bool:
        return os.getppid() == parent and not stop.is_set()

    directory = Directory.connect(spec.address)
    # how long this driver took to start (a spawned interpreter, its imports): the learner rank gives the build's
    # first batch that much more time, since the nodes start as slowly on a loaded host
    directory.store.set(directory.key(f"rank{spec.rank}", f"e{epoch}", "up"), f"{time.time() - spec.started_at:.3f}")
    nodes = _wait_for_joins(directory, spec, epoch, parent_alive)
    if not nodes:
        os._exit(0)  # told to stop while waiting
    store, port = _group_store(spec.host)  # store: the group's rendezvous server, kept for the process's life
    directory.store.set(directory.key(f"rank{spec.rank}", f"e{epoch}", "group"), f"{spec.host} {port} {nodes}")
    fault_key = (f"rank{spec.rank}", f"e{epoch}", "fault")

    def watch() -> None:  # ends the process when its build can no longer go on
        beats: dict = {}
        for tick in itertools.count():
            time.sleep(0.1)
            if os.getppid() != parent:
                os._exit(0)
            if stop.is_set():  # the main thread shuts the collectors down after its current batch; else force it
                time.sleep(GRACE_S)
                os._exit(0)
            try:
                if directory.has(*fault_key):
                    os._exit(EXIT_FAULT)
                silent = _silent_slot(directory, spec, epoch, nodes, beats, time.monotonic()) if tick % 10 == 0 else None
                if silent is not None:  # its supervisor is gone too, so nobody else reports it
                    directory.store.set(directory.key(*fault_key), f"collector {silent + 1} stopped beating")
                    os._exit(EXIT_FAULT)
            except Exception:  # noqa: BLE001 - the directory is gone: learner rank 0 is, and so is this run
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="fabric_learner-driver-watch").start()
    envs = [SeededEnv(spec.create_env_fn, spec.seed + 1 + i + 100 * epoch) for i in range(nodes)]
    collector = DistributedCollector(
        envs, spec.policy, frames_per_batch=spec.frames_per_batch * nodes, total_frames=FOREVER, sync=True,
        launcher="submitit_delayed", tcp_port=port, backend="gloo", collector_kwargs=dict(spec.collector_kwargs))
    try:
        _feed(collector, batches, weights, stop)
    except Exception:
        if not stop.is_set():
            raise  # the learner rank sees this driver end and rebuilds the group
    else:
        collector.shutdown()  # the collectors end their node loops cleanly
    batches.cancel_join_thread()
    os._exit(0)


def _feed(collector, batches, weights, stop) -> None:
    """Hand every batch to the learner rank (waiting while its queue is full), the newest weights to the collectors."""
    _push_latest(collector, weights)
    for batch in collector:
        batch = batch.contiguous() if hasattr(batch, "contiguous") else batch
        while not stop.is_set():
            try:
                batches.put(batch, timeout=0.1)
                break
            except queue.Full:
                _push_latest(collector, weights)
        if stop.is_set():
            return
        _push_latest(collector, weights)


def _push_latest(collector, weights) -> None:
    """Send the collectors the newest weights waiting from the learner, if any (older ones are skipped)."""
    latest = None
    try:
        while True:
            latest = weights.get_nowait()
    except queue.Empty:
        pass
    if latest is not None:
        collector.update_policy_weights_(latest)
