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
from fabric_learner.utils.lines import say

FAILURE_MODES = ("restart", "continue")
WAIT_LINE_S = 10.0  # a rank waiting for collectors says so after this long, then at doubling intervals up to a minute
LINGER_S = 5.0  # how long a rank that ends the run waits for the other ranks to have said why


class RemoteCollectors:
    """Collectors in processes or hosts of their own, feeding this learner rank (a torchrl collector to the Trainer).

    Every learner rank builds one with the same arguments, after its learner. The ``collectors`` of the run
    are shared among the learner ranks in turn (collector ``j`` serves rank ``j % ranks``). Each rank starts a
    driver process running torchrl's :class:`~torchrl.collectors.distributed.DistributedCollector` over the
    collectors that serve it; weights go out through torchrl's ``DistributedWeightSyncScheme``. Collectors are
    ``python -m fabric_learner.collect --connect ADDRESS`` processes, started on other hosts by the user or, with
    ``local=True``, by this rank on its own host. Use it with ``Trainer(..., async_collection=AsyncCollection(...))``:
    policy versions, staleness admission and the bounded queue apply to what arrives.

    Waiting: a rank without collectors says so on stderr (the address, how many it has), after 10 s and then at
    growing intervals. If no collector ever connects to a rank within ``timeout_s`` (a wrong address or port,
    collectors not started, a firewall), the run ends on every rank with an error saying so.

    Faults: when a collector dies, its learner rank rebuilds its group (a restart, counted against
    ``max_restarts``); the collector's supervisor restarts it (``--max-restarts``) and it joins again. A collector
    killed whole (its supervisor too) is found by its silence within seconds. ``on_failure="restart"`` waits for
    every collector of the rank to be back; ``"continue"`` goes on with those back within ``rejoin_s``, and a rank
    that lost them all goes on training on its replay buffer with the other ranks' rounds while it waits for one
    to come back. Waiting is never counted as a restart and never ends the run. When a rank ends the run, every
    rank raises, saying why. Batches in flight in a rebuilt group are lost and counted (``stats()``); what the
    learner admitted is in its replay buffer and stays there.

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
        max_restarts (int): rebuilds after a fault of collectors that had joined (a node that died, a collector
            gone silent, a group that stopped delivering) this rank allows; the next fault ends the run.
        rejoin_s (float): how long a rebuild waits for collectors under ``"continue"``.
        timeout_s (float): how long this rank waits for its first collector before the run ends, and, once a
            group is built, for each batch before it counts the group as failed and rebuilds it (a build's first
            batch gets as much more time as its driver process took to start: a loaded host starts both slowly).
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
        self._seen = self._had = False  # a collector has connected to this rank / joined one of its builds
        self._connected = 0  # collectors that took their turn serving this rank, in all
        self._started_t = self._last_batch_t = self._formed_t = 0.0
        self._startup_s = 0.0  # how long the current build's driver took to start (it says so in the directory)
        self._delivered = False  # the current build has delivered a batch
        self._epoch, self._joined, self._nodes, self._build_read_t = 0, 0, 0, 0.0  # the current build, as last read
        self._next_line_t, self._line_gap, self._said_waiting = 0.0, WAIT_LINE_S, False
        self._told, self._tell_lock = False, threading.Lock()
        self._peer_failure: tuple[str, int] | None = None  # (reason, rank) of another rank that ended the run
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
            if self._peer_failure is not None:
                self._end_run(*self._peer_failure)
            try:
                batch = self._batches.get(timeout=0.1)
            except queue.Empty:
                self._check_driver()
                continue
            except (EOFError, OSError, ConnectionError):  # the driver died while handing a batch over
                self._check_driver(force=True)
                continue
            self._last_batch_t = time.monotonic()
            self._read_build(self._last_batch_t, force=True)
            self._seen = self._had = self._delivered = True
            if self._said_waiting:
                self._say(f"collectors at {self.address}: {self._nodes} of {self.share} delivering")
            self._next_line_t, self._line_gap, self._said_waiting = self._last_batch_t + WAIT_LINE_S, WAIT_LINE_S, False
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
        self._started_t = time.monotonic()
        self._next_line_t = self._started_t + WAIT_LINE_S
        if self.world > 1:
            threading.Thread(target=self._watch_peers, daemon=True, name="fabric_learner-remote-peers").start()
        if self.local:
            from fabric_learner.remote import supervisor as collect

            for _ in range(self.share):
                proc = self._ctx.Process(target=collect.serve, kwargs=dict(address=self.address, learner_rank=self.rank),
                                         daemon=False, name="fabric_learner-collector")
                proc.start()
                self._locals.append(proc)
        self._start_driver()

    def _start_driver(self) -> None:
        epoch = self._directory.count(f"rank{self.rank}", "epochs", add=1) - 1
        spec = _driver.DriverSpec(address=self.address, host=self.host, rank=self.rank, expected=self.share,
                                  policy=self.policy, seed=self._seed, started_at=time.time(), **self._spec_args)
        self._batches, self._weights, self._stop = self._ctx.Queue(maxsize=1), self._ctx.Queue(), self._ctx.Event()
        self._driver = self._ctx.Process(target=_driver.run, args=(spec, epoch, self._batches, self._weights, self._stop),
                                         daemon=True, name=f"fabric_learner-driver-{self.rank}")
        self._driver.start()
        self._builds += 1
        self._epoch, self._joined, self._nodes, self._build_read_t = epoch, 0, 0, 0.0
        self._formed_t, self._startup_s, self._delivered = 0.0, 0.0, False
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
        """End the run if no collector ever came; say that this rank waits; rebuild its group
        when its driver ended or its built group stopped delivering (a restart)."""
        now = time.monotonic()
        driver, (joined, nodes) = self._driver, self._read_build(now)
        self._had = self._had or joined > 0
        self._seen = self._seen or self._had or self._connected > 0
        if nodes and not self._formed_t:
            # the build's first batch may take timeout_s beyond what its driver took to start: its nodes start (a
            # group, environments, a collector) about as slowly, so a loaded host is not mistaken for a stalled group
            self._formed_t = now + self._startup_s
        stalled = False
        if not force and driver is not None and driver.is_alive():
            if not nodes and not self._seen and now - self._started_t > self.timeout_s:
                self._end_run(self._never_connected())
            stalled = nodes > 0 and now - max(self._last_batch_t, self._formed_t) > self.timeout_s
            if not stalled:
                if not self._delivered:
                    self._say_waiting(now, nodes or joined, built=nodes > 0)
                return
        code = driver.exitcode if driver is not None else None
        cause = (f"no batch for {self.timeout_s:g} s (timeout_s)" if stalled else
                 "a collector's node died or a collector went silent" if code == _driver.EXIT_FAULT else
                 f"its driver process ended (exit code {code})")
        if self._restarts >= self.max_restarts:
            self._end_run(
                f"its collectors failed {self._restarts + 1} times, the last time with {cause}, and max_restarts="
                f"{self.max_restarts} rebuilds of its group were used up. Check the collectors' output (python -m "
                "fabric_learner.collect) for their errors, and raise max_restarts if such faults are expected.")
        self._restarts += 1
        self._say(f"collectors at {self.address}: group failed ({cause}); rebuilding it (restart {self._restarts} of "
                  f"{self.max_restarts})")
        with self._lock:
            self._stop_driver()
            self._start_driver()

    def _read_build(self, now: float, force: bool = False) -> tuple[int, int]:
        """Collectors joined to the current build and its group size once built (0 before), read from the directory
        every half second until the group is built."""
        if not self._nodes and (force or now - self._build_read_t >= 0.5):
            self._build_read_t = now
            build = (f"rank{self.rank}", f"e{self._epoch}")
            try:
                self._connected = self._directory.count(f"rank{self.rank}", "connected")
                self._joined = min(self._directory.count(*build, "join"), self.share)
                if self._directory.has(*build, "group"):
                    self._nodes = int(self._directory.store.get(self._directory.key(*build, "group")).split()[2])
                    self._startup_s = float(self._directory.store.get(self._directory.key(*build, "up")))
            except Exception:  # noqa: BLE001 - the directory went with learner rank 0; its collective errors tell
                pass
        return self._joined, self._nodes

    # ---- what the user is told ----------------------------------------------------------------------

    def _say(self, message: str) -> None:
        say(f"[learner rank {self.rank} {time.strftime('%H:%M:%S')}] {message}")

    def _say_waiting(self, now: float, have: int, built: bool) -> None:
        if now < self._next_line_t:
            return
        self._next_line_t, self._line_gap, self._said_waiting = now + self._line_gap, min(2 * self._line_gap, 60.0), True
        waited = now - max(self._last_batch_t, self._started_t)
        continuing = self._spec_args["on_failure"] == "continue"
        if built:
            state = "their first batch is not in yet"
        elif not self._seen:
            state = (f"none has connected yet; the run ends at {self.timeout_s:g} s (timeout_s) unless one does. Each is "
                     f"started with: python -m fabric_learner.collect --connect {self.address}")
        elif have == self.share:
            state = "their group is being built"
        elif not self._had:
            state = f"{self._connected} connected and starting (each joins once its imports are done)"
        elif not continuing:
            state = "on_failure='restart' waits for every one; this rank trains on its replay buffer meanwhile"
        elif have:
            state = "the group starts with those (on_failure='continue')"
        else:
            state = ("its collectors were lost; the run goes on (on_failure='continue'), this rank training on its "
                     "replay buffer with the other ranks' rounds until one comes back")
        self._say(f"waiting for collectors at {self.address} for {waited:.0f} s: it has {have} of {self.share}; {state}")

    def _never_connected(self) -> str:
        _, port = split_address(self.address)
        return (f"no collector connected to {self.address} in {self.timeout_s:g} s (timeout_s). Check that the collectors "
                f"were started (python -m fabric_learner.collect --connect {self.address}; their output says what they "
                f"reached), that their --connect address and port are {self.address} exactly, and that no firewall "
                f"blocks port {port} between them and this host; or pass local=True to start them here, or raise "
                "timeout_s if they take longer to start.")

    # ---- ending the run on every rank -----------------------------------------------------------------

    def _end_run(self, reason: str, peer: int | None = None) -> None:
        """Raise ``reason`` on this rank, once every rank has said it (or ``LINGER_S`` passed): the others read
        it in the directory within a second, instead of failing later on a collective with no reason given."""
        self._closed = True
        with self._lock:
            self._stop_driver()
        message = self._tell(reason, peer)
        try:
            self._directory.store.set(self._directory.key(f"rank{self.rank}", "done"), "1")  # its collectors end
            told = [self._directory.key(f"rank{r}", "told") for r in range(self.world)]
            deadline = time.monotonic() + LINGER_S
            while self.world > 1 and not self._directory.store.check(told) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the directory went with learner rank 0: the others know already
            pass
        raise RuntimeError(message + " The run ends on every rank.")

    def _tell(self, reason: str, peer: int | None) -> str:
        """Say why the run ends (once), and mark in the directory that this rank has said it."""
        message = (f"Learner rank {self.rank}: {reason}" if peer is None else
                   f"Learner rank {self.rank}: the run ends because learner rank {peer} reports: {reason}")
        with self._tell_lock:
            if self._told:
                return message
            self._told = True
        self._say(f"ending the run on every rank. {message}")
        try:
            if peer is None:
                self._directory.store.set(self._directory.key(f"rank{self.rank}", "failed"), reason)
            self._directory.store.set(self._directory.key(f"rank{self.rank}", "told"), "1")
        except Exception:  # noqa: BLE001 - the directory went with learner rank 0: the others know already
            pass
        return message

    def _watch_peers(self) -> None:
        """A thread of its own: every half second, whether another rank ended the run. It says so at once (the
        collector's thread may be waiting for the learner to take a batch) and the collector raises it next."""
        while not self._closed:
            time.sleep(0.5)
            for peer in range(self.world):
                if peer == self.rank or self._closed:
                    continue
                try:
                    if not self._directory.has(f"rank{peer}", "failed"):
                        continue
                    reason = self._directory.store.get(self._directory.key(f"rank{peer}", "failed")).decode()
                except Exception:  # noqa: BLE001 - the directory went with learner rank 0; its collective errors tell
                    return
                self._tell(reason, peer)
                self._peer_failure = (reason, peer)
                return
