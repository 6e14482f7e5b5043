"""``RemoteCollectors``: this learner rank's share of collectors that run in other processes or hosts."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict, TensorDictBase
from torchrl.data.utils import CloudpickleWrapper

from fabric_learner.asynchronous import VersionedPolicy
from fabric_learner.remote import driver as _driver
from fabric_learner.remote.directory import Directory, split_address

FAILURE_MODES = ("restart", "continue")


class RemoteCollectors:
    """Collectors in processes or hosts of their own, feeding this learner rank (a torchrl collector to the Trainer).

    Every learner rank builds one with the same arguments, after its learner. The ``collectors`` of the run
    are shared among the learner ranks in turn (collector ``j`` serves rank ``j % ranks``). Each rank starts a
    driver process running torchrl's :class:`~torchrl.collectors.distributed.DistributedCollector` over the
    collectors that serve it; weights go out through torchrl's ``DistributedWeightSyncScheme``. Collectors are
    ``python -m fabric_learner.collect --connect ADDRESS`` processes, started on other hosts by the user or, with
    ``local=True``, by this rank on its own host. Use it with ``Trainer(..., async_collection=AsyncCollection(...))``:
    policy versions, staleness admission and the bounded queue apply to what arrives.

    Faults: when a collector dies, its learner rank rebuilds its group; the collector's supervisor restarts it
    (``--max-restarts``) and it joins again. ``on_failure="restart"`` waits for every collector of the rank to be
    back; ``"continue"`` goes on with those back within ``rejoin_s``. Batches in flight in a rebuilt group are
    lost and counted (``stats()``); what the learner admitted is in its replay buffer and stays there.

    Args:
        create_env_fn: builds one environment; sent to the collectors (cloudpickled), so it must be importable
            or picklable there.
        policy (VersionedPolicy): the policy the collectors act with (a copy of the learner's policy); its weights
            are replaced by every publication.
        frames_per_batch (int): frames each collector returns per batch; a batch of this rank holds
            ``frames_per_batch`` times its number of collectors.
        collectors (int): collectors of the whole run, at least one per learner rank.
        address (str): ``"HOST:PORT"`` where learner rank 0 serves the directory the collectors connect to.
        host (str, optional): the address this rank's collectors reach it at; defaults to the directory's host on
            rank 0 and to this machine's name elsewhere.
        local (bool): start this rank's collectors here, as child processes (default ``False``: started elsewhere).
        on_failure (str): ``"restart"`` or ``"continue"`` (above).
        max_restarts (int): group rebuilds this rank allows before it raises.
        rejoin_s (float): how long a rebuild waits for collectors under ``"continue"``.
        timeout_s (float): how long this rank waits for its collectors, to join a build and for each batch (a
            build's first included), before it rebuilds the group.
        collector_kwargs (dict, optional): passed to torchrl's ``Collector`` inside each collector process
            (``auto_register_policy_transforms`` defaults to ``False`` there; pass ``True`` for a recurrent policy).

    Examples:
        >>> import copy, torch
        >>> from tensordict.nn import TensorDictModule
        >>> from fabric_learner import RemoteCollectors, VersionedPolicy
        >>> policy = VersionedPolicy(TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["action"]))
        >>> remote = RemoteCollectors(lambda: None, policy, frames_per_batch=64, collectors=2, address="127.0.0.1:29711")
        >>> remote.share, remote.started
        (2, False)

        Nothing starts before the Trainer publishes weights or asks for a batch. A run of 2 learner ranks and 2 hosts
        of collectors: ``fabric run --strategy=ddp --devices=2 train.py`` on the learner host, and on each collector
        host ``python -m fabric_learner.collect --connect LEARNER_HOST:29711``.
    """

    def __init__(self, create_env_fn, policy: VersionedPolicy, *, frames_per_batch: int, collectors: int, address: str,
                 host: str | None = None, local: bool = False, on_failure: str = "restart", max_restarts: int = 10,
                 rejoin_s: float = 10.0, timeout_s: float = 120.0, collector_kwargs: dict | None = None) -> None:
        if not isinstance(policy, VersionedPolicy):
            raise TypeError(f"RemoteCollectors needs a fabric_learner.VersionedPolicy (its frames carry the weights' "
                            f"version), got {type(policy).__name__}. Wrap a copy of the policy: VersionedPolicy(policy).")
        if on_failure not in FAILURE_MODES:
            raise ValueError(f"on_failure must be one of {FAILURE_MODES}, got {on_failure!r}.")
        for name, value in (("frames_per_batch", frames_per_batch), ("collectors", collectors)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        directory_host, _ = split_address(address)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if collectors < self.world:
            raise ValueError(f"{collectors} collector(s) for {self.world} learner ranks: every learner rank needs at least "
                             f"one collector of its own. Pass collectors>={self.world}.")
        self.share = len(range(self.rank, collectors, self.world))
        self.policy = policy
        self.address = address
        self.host = host or (directory_host if self.rank == 0 else socket.gethostbyname(socket.gethostname()))
        self.local = local
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self._spec_args = dict(create_env_fn=CloudpickleWrapper(create_env_fn), frames_per_batch=frames_per_batch,
                               on_failure=on_failure, rejoin_s=rejoin_s, timeout_s=timeout_s,
                               # False: torchrl 0.14's behaviour without its FutureWarning, which it emits for every
                               # policy (any module lacks an InitTracker's key); a recurrent policy passes True
                               collector_kwargs={"auto_register_policy_transforms": False, **(collector_kwargs or {})})
        self.total_frames = -1
        self.init_random_frames = 0
        self._seed = 0
        self._directory: Directory | None = None
        self._driver = None
        self._ctx = mp.get_context("spawn")
        self._batches = self._weights = self._stop = None
        self._latest: TensorDictBase | None = None
        self._locals: list = []
        self._closed = False
        self._restarts = 0
        self._lost_batches = 0
        self._builds = 0
        self._lock = threading.Lock()  # the driver and its queues are replaced from the feeder thread

    # ---- what a torchrl collector offers the Trainer ---------------------------------------------------

    @property
    def started(self) -> bool:
        return self._directory is not None

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seeds of this rank's collectors: ``seed + 1 + i + 100 * build`` for its collector ``i``."""
        self._seed = int(seed)
        return seed

    def update_policy_weights_(self, policy_or_weights: TensorDictBase | None = None, **kwargs: Any) -> None:
        """Publish weights (a ``VersionedPolicy.weights`` TensorDict) to every collector of this rank."""
        if policy_or_weights is None:
            policy_or_weights = VersionedPolicy.weights(TensorDict.from_module(self.policy.policy), int(self.policy.version))
        self._start()
        with self._lock:
            self._latest = policy_or_weights.detach().clone()
            self._offer_latest()

    def __iter__(self):
        self._start()
        while not self._closed:
            try:
                batch = self._batches.get(timeout=0.1)
            except queue.Empty:
                self._check_driver()
                continue
            except (EOFError, OSError, ConnectionError):  # the driver died while handing a batch over
                self._check_driver(force=True)
                continue
            self._last_batch_t = time.monotonic()
            yield batch

    def shutdown(self, timeout: float | None = None) -> None:
        """End this rank's collection: its driver, the collectors it started, and its part of the directory."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stop_driver()  # first: it tells its collectors to end their node loops
        if self._directory is not None:
            try:
                self._directory.store.set(self._directory.key(f"rank{self.rank}", "done"), "1")
            except Exception:  # noqa: BLE001 - rank 0 (the directory's host) may have ended first
                pass
        for proc in self._locals:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def stats(self) -> dict[str, int]:
        """Group rebuilds, batches lost with them, builds started."""
        return {"restarts": self._restarts, "lost_batches": self._lost_batches, "builds": self._builds,
                "collectors": self.share}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    # ---- the driver ---------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._directory is not None or self._closed:
            return
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != self.world:
            raise RuntimeError(f"RemoteCollectors was built for {self.world} learner rank(s) but the run has {world}: "
                               "nothing has started. Build it after the learner, whose process group it shares out.")
        self._directory = (Directory.host(self.address, self.world) if self.rank == 0
                           else Directory.connect(self.address, timeout_s=self.timeout_s))
        if self.local:
            from fabric_learner import collect

            for _ in range(self.share):
                proc = self._ctx.Process(target=collect.serve, kwargs=dict(address=self.address, learner_rank=self.rank),
                                         daemon=False, name="fabric_learner-collector")
                proc.start()
                self._locals.append(proc)
        self._start_driver()

    def _start_driver(self) -> None:
        epoch = self._directory.count(f"rank{self.rank}", "epochs", add=1) - 1
        spec = _driver.DriverSpec(address=self.address, host=self.host, rank=self.rank, expected=self.share,
                                  policy=self.policy, seed=self._seed, **self._spec_args)
        self._batches, self._weights, self._stop = self._ctx.Queue(maxsize=1), self._ctx.Queue(), self._ctx.Event()
        self._driver = self._ctx.Process(target=_driver.run, args=(spec, epoch, self._batches, self._weights, self._stop),
                                         daemon=True, name=f"fabric_learner-driver-{self.rank}")
        self._driver.start()
        self._builds += 1
        self._last_batch_t = time.monotonic()
        self._offer_latest()

    def _offer_latest(self) -> None:
        if self._weights is not None and self._latest is not None:
            self._weights.put(self._latest)

    def _stop_driver(self) -> None:
        if self._driver is None:
            return
        self._stop.set()
        self._driver.join(_driver.GRACE_S + 2)
        if self._driver.is_alive():
            self._driver.kill()
            self._driver.join(5)
        for q in (self._batches, self._weights):
            while True:
                try:
                    q.get_nowait()
                    if q is self._batches:
                        self._lost_batches += 1
                except (queue.Empty, EOFError, OSError):
                    break
            q.cancel_join_thread()
        self._driver = None

    def _check_driver(self, force: bool = False) -> None:
        """Rebuild this rank's group when its driver ended or never delivered a first batch in time."""
        driver = self._driver
        stalled = time.monotonic() - self._last_batch_t > self.timeout_s
        if not force and driver is not None and driver.is_alive() and not stalled:
            return
        code = None if driver is None else driver.exitcode
        if self._restarts >= self.max_restarts:
            self._closed = True
            with self._lock:
                self._stop_driver()
            raise RuntimeError(
                f"Learner rank {self.rank}: its collectors' group was rebuilt {self._restarts} times (max_restarts) and "
                f"failed again (driver exit code {code}, {'stalled' if stalled else 'ended'}). Check the collectors' "
                "output (python -m fabric_learner.collect) and raise max_restarts if the faults are expected."
            )
        self._restarts += 1
        with self._lock:
            self._stop_driver()
            self._start_driver()
