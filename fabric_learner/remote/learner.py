"""RemoteLearner: the Learner contract from one process, the update run by a group of Ray actors.

The controller (the script's process) splits each global batch into one share per rank and sends
each rank its own share only: inside the actor call when it is small, else through Ray's object
store once, by reference; the ranks (``remote.actors``) run a ``FabricLearner`` each, in one
process group, and the controller combines their outputs into what ``LocalLearner.update`` on the
whole batch returns. Faults end the group with a named error (``remote.faults``); the controller's
own state never changes on a failed call.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from fabric_learner.learner import Capabilities, Learner, plain_weights
from fabric_learner.remote import _runtime, _shares
from fabric_learner.remote._wire import arrays_of, packed, unpacked, wire_bytes, with_arrays
from fabric_learner.remote.faults import CONTINUE, RESTART, LearnerLostError, LearnerTimeoutError, gather

# shares of at most this many tensor bytes are passed inside the actor call; larger ones through the object store.
# Under Ray's own limit for inlined arguments (max_direct_call_object_size, 100 KiB by default), with room for the
# share's keys and pickle framing, so that Ray never moves a share this learner counted as inline.
INLINE_BYTES = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024)) - 8 * 1024
# the ranks' replay buffers are in no checkpoint (as a script's own buffer is in no learner checkpoint)
EMPTY_BUFFERS = (" The new ranks' replay buffers start empty: extend() them, or start new collectors on "
                 "learner.replay_buffer (the old ones' clients wrote into the lost ranks), before update_from_buffer().")
GRACE_S = 10.0  # after one rank raised, how long the others may take to answer before the group counts as stuck


class RemoteLearner(Learner):
    """The Learner contract in this process, each update run by ``num_learners`` Ray actors.

    Every rank is a Ray actor running a ``FabricLearner`` with ``strategy`` (``"ddp"``, ``"fsdp"``,
    or a strategy object such as a ``ModelParallelStrategy`` with its ``parallelize_fn``) in one
    process group (gloo on CPU, NCCL on GPU). ``update(batch)`` splits the batch into one share per
    rank (equal shares of a TensorDict; lazy stacks of samples of different lengths dealt by token
    count) and returns what ``LocalLearner.update`` on the whole batch returns: the ranks' loss
    entries averaged (by the tokens or samples each averaged over, for torchrl's LLM losses), and
    ``"grad_norm"`` on calls that step the optimizer.

    With no ``address`` and no Ray runtime running, a local runtime is started (no dashboard, the
    machine's CPUs) and shut down when the last learner using it closes; ``address=`` joins an
    existing cluster, and a runtime the script started with ``ray.init`` is used as it is.

    The loss travels to the ranks by pickling (``cloudpickle``); one that cannot (it holds a lock,
    an open file, a CUDA context...) is refused here, before anything starts: pass a factory
    instead, a function returning the loss (or ``(loss, policy)``) called on each rank. The
    optimizer is a factory ``f(params)`` (an instance holds this process's parameters) or ``None``.

    The controller trains nothing: ``get_weights()`` fetches the weights (full tensors, also under
    FSDP), ``state_dict()`` is empty, ``loss_module`` is the object given or ``None``; with ``follow``
    its modules are brought to the group's weights when this process runs them.

    Args:
        loss_module: a torchrl loss (sent to every rank) or a factory returning one or ``(loss, policy)``.
        optimizer: ``None`` (Adam) or a factory ``f(params) -> Optimizer``.

    Keyword Args:
        policy (nn.Module, optional): with a loss object, the module of it that acts; ``get_weights``
            is laid out as ``TensorDict.from_module(policy)``.
        strategy: as ``FabricLearner``: ``"ddp"`` (default), ``"fsdp"`` or a strategy object.
        num_learners (int): ranks (actors) in the group; the batch size must divide by it.
        num_cpus_per_learner (float), num_gpus_per_learner (float): Ray resources of each actor;
            with GPUs the ranks train on their GPU.
        precision: as ``FabricLearner``.
        clip_grad_norm, grad_accum_steps, on_nonfinite, compile, stages: as ``LocalLearner``.
        address (str, optional): a Ray cluster to join (``"auto"``, ``"ray://host:10001"``, ...).
        timeout (float): seconds a call may wait for the ranks (and each collective among them);
            past it the call raises ``LearnerTimeoutError`` naming the silent ranks and the group ends.
        setup_timeout (float): seconds to wait for the resources and for the ranks to start.
        max_in_flight (int): updates ``update(batch, wait=False)`` keeps in flight before it waits.
        on_lost_rank (str): ``"raise"`` (default): a lost or silent rank ends the group and every later
            call raises; ``"rebuild"``: the call still raises (``LearnerLostError`` /
            ``LearnerTimeoutError``, saying what was lost), but a new group is built and loaded from
            the last checkpoint ``save()`` wrote, and the learner goes on from there.
        follow (bool): ``True`` (default): the loss given here (and ``policy``) holds the group's weights
            whenever this process runs its modules, fetched on first use after an update
            (``remote.following``); ``False`` for programs that publish weights themselves.
        replay_buffer (callable, optional): ``f() -> TensorDictReplayBuffer``, called on each rank: a
            buffer beside every rank (``rank_learner.replay_buffer`` there), filled by ``extend(data)``
            or by collectors writing into ``learner.replay_buffer``, sampled by ``update_from_buffer(K)``;
            not in checkpoints (a rebuilt group's buffers start empty).

    Raises:
        TypeError, ValueError: a bad argument or a loss that cannot be sent, before anything starts.
        RuntimeError: the cluster cannot give the group its resources within ``setup_timeout``.

    Examples:
        A script's learner, moved to two Ray actors (this starts a Ray runtime, so it is not run here):

        >>> import functools, torch
        >>> from fabric_learner import RemoteLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> with RemoteLearner(loss, functools.partial(torch.optim.SGD, lr=0.1), policy=net,
        ...                    strategy="ddp", num_learners=2) as learner:  # doctest: +SKIP
        ...     out = learner.update(batch)                    # each rank trains on 4 of the 8 samples
        ...     weights = learner.get_weights()                # plain tensors in this process
        ...     pending = learner.update(batch, wait=False)    # collect the next batch meanwhile
        ...     out, version = pending.result(), pending.policy_version

        Off-policy, a replay buffer beside each rank, sampled there (priorities written there too):

        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> def buffer():  # called on each rank: 4 of each update's 8 samples come from each rank
        ...     return TensorDictReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=4)
        >>> with RemoteLearner(loss, policy=net, num_learners=2,
        ...                    replay_buffer=buffer) as learner:  # doctest: +SKIP
        ...     lengths = learner.extend(batch)                # rank r takes the r-th half of the rows
        ...     outs = learner.update_from_buffer(16)          # 16 updates in one call, outputs stacked
        ...     # or: RayCollector(..., replay_buffer=learner.replay_buffer) writes into the ranks' buffers

        What cannot work on the ranks is refused before anything starts:

        >>> RemoteLearner(loss, torch.optim.SGD(loss.parameters(), lr=0.1))
        Traceback (most recent call last):
        ...
        TypeError: RemoteLearner builds the optimizer on each rank, over that rank's parameters: ...
    """

    capabilities = Capabilities(sharded=False, distributed=False)  # as seen from the controller: one process

    def __init__(
        self,
        loss_module: Any,
        optimizer: Any = None,
        *,
        policy: nn.Module | None = None,
        strategy: Any = "ddp",
        num_learners: int = 2,
        num_cpus_per_learner: float = 1,
        num_gpus_per_learner: float = 0,
        precision: Any = "32-true",
        clip_grad_norm: float | None = None,
        grad_accum_steps: int = 1,
        on_nonfinite: str = "raise",
        compile: bool = False,
        stages: Sequence[Any] | None = None,
        address: str | None = None,
        timeout: float = 300.0,
        setup_timeout: float = 300.0,
        max_in_flight: int = 2,
        on_lost_rank: str = "raise",
        follow: bool = True,
        replay_buffer: Callable[[], Any] | None = None,
    ) -> None:
        nn.Module.__init__(self)
        payload = _payload(loss_module, policy)
        _check_optimizer(optimizer)
        for name, value in (("num_learners", num_learners), ("max_in_flight", max_in_flight)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}.")
        for name, value in (("timeout", timeout), ("setup_timeout", setup_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
        _check_step_options(loss_module, optimizer, clip_grad_norm, on_nonfinite, stages)
        if on_lost_rank not in ("raise", "rebuild"):
            raise ValueError(f"on_lost_rank must be 'raise' or 'rebuild', got {on_lost_rank!r}.")
        if num_cpus_per_learner < 0 or num_gpus_per_learner < 0:
            raise ValueError("num_cpus_per_learner and num_gpus_per_learner must be >= 0.")
        if not isinstance(follow, bool):
            raise TypeError(f"follow must be True or False, got {follow!r}.")
        if replay_buffer is not None and not callable(replay_buffer):
            raise TypeError(f"replay_buffer must be a factory f() -> TensorDictReplayBuffer, called on each rank (a "
                            f"buffer object would be copied, not shared), got {type(replay_buffer).__name__}. Nothing "
                            "was started.")
        object.__setattr__(self, "loss_module", loss_module if isinstance(loss_module, nn.Module) else None)
        object.__setattr__(self, "policy", policy)
        self.num_learners = num_learners
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = clip_grad_norm
        self.on_nonfinite = on_nonfinite
        self.stages = tuple(stages or ())
        self.optimizer = None
        self.num_updates = 0
        self.skipped_updates = 0
        self.timeout = float(timeout)
        self.max_in_flight = max_in_flight
        self.last_transfer: dict[str, int] = {}
        self.last_rank_seconds: list[float] = []  # each rank's own time in the last collected update
        self._in_flight: collections.deque[PendingUpdate] = collections.deque()
        self._broken: BaseException | None = None
        self._closed = False
        self._actors: list[Any] = []
        self._group = None
        self._sharded = False
        self.on_lost_rank = on_lost_rank
        self._last_save: tuple[str, int] | None = None  # (path, num_updates) of the last save(): where a rebuild starts
        self._follower = None  # the loss here following the group's weights (remote/following.py)
        self._rank_buffers = replay_buffer is not None
        self.last_sampled: TensorDictBase | None = None  # [updates, ranks, sample]: what update_from_buffer drew
        accelerator = "cuda" if num_gpus_per_learner > 0 else "cpu"
        options = {"strategy": strategy, "accelerator": accelerator, "precision": precision,
                   "clip_grad_norm": clip_grad_norm, "grad_accum_steps": grad_accum_steps,
                   "on_nonfinite": on_nonfinite, "compile": compile, "stages": stages,
                   # the ranks' collectives wait longer than the controller, which so names a silent rank first
                   "timeout": 2 * float(timeout)}
        sent = _pickled((payload, optimizer, options, replay_buffer))
        self._build = (sent, num_cpus_per_learner, num_gpus_per_learner, setup_timeout)  # kept for a rebuild
        self._embedded = _runtime.join(address)
        try:
            self._start(*self._build)
        except BaseException:
            self._end_group()
            if self._embedded:
                _runtime.leave()
            self._closed = True
            raise
        if follow and self.loss_module is not None:  # hooks after the loss was pickled for the ranks
            from fabric_learner.remote.following import Follower

            self._follower = Follower(self, self.loss_module, policy)

    # ---- the group ------------------------------------------------------------------------------

    def _start(self, sent: bytes, cpus, gpus, setup_timeout) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from fabric_learner.remote.actors import LearnerRank

        if self._embedded:  # this machine only: what can never fit is refused now, not after setup_timeout
            _runtime.refuse_what_never_fits(self.num_learners, cpus, gpus)
        sent = ray.put(sent)
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self._group = placement_group([bundle] * self.num_learners, strategy="PACK")
        ready, _ = ray.wait([self._group.ready()], timeout=setup_timeout)
        if not ready:
            free = ray.available_resources()
            raise RuntimeError(
                f"The Ray cluster could not give {self.num_learners} learner ranks {bundle} each within "
                f"{setup_timeout:g} s (free now: {free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU). Nothing was "
                "started. Lower num_cpus_per_learner / num_gpus_per_learner or num_learners, close other learners, "
                "or add nodes.")
        remote_rank = _actor_class(ray, LearnerRank)
        self._actors = [
            remote_rank.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=
                                PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=r))
            .remote(r, self.num_learners)
            for r in range(self.num_learners)]
        address, port = gather([self._actors[0].rendezvous.remote()], "starting rank 0", setup_timeout)[0]
        infos = self._call("setup", sent, address, port, what="building the ranks", timeout=setup_timeout)
        self._sharded = bool(infos[0]["sharded"])
        self.pids = [info["pid"] for info in infos]

    def _call(self, method: str, *args, what: str | None = None, ranks=None, timeout=None) -> list[Any]:
        """``method(*args)`` on the given ranks (default: all), their answers in rank order; faults end the group."""
        self._check_usable()
        actors = self._actors if ranks is None else [self._actors[r] for r in ranks]
        refs = [getattr(a, method).remote(*args) for a in actors]
        return self._gather(refs, what or f"{method}()", timeout)

    def _gather(self, refs, what: str, timeout=None) -> list[Any]:
        try:
            # rebuilding, the learner says what it did instead of what the caller should do
            then = "" if self.on_lost_rank == "rebuild" else RESTART
            return gather(refs, what, self.timeout if timeout is None else timeout, self._where, GRACE_S, then)
        except (LearnerLostError, LearnerTimeoutError) as err:
            self._fail(err)
            if self.on_lost_rank == "rebuild":
                self._rebuild(err)
            raise

    def _where(self, ranks: list[int]) -> dict[int, str]:
        import ray

        refs = {r: self._actors[r].where.remote() for r in ranks}
        out = {}
        for r, ref in refs.items():
            try:
                out[r] = "busy in " + ray.get(ref, timeout=5)
            except Exception as err:  # noqa: BLE001 - a rank that cannot even say where it is
                out[r] = f"no answer ({type(err).__name__})"
        return out

    def _fail(self, err: BaseException) -> None:
        """A lost or silent rank: end the group; every later call raises this error's story."""
        self._broken = err
        self._end_group()
        for handle in self._in_flight:
            handle._error = err
        self._in_flight.clear()

    def _rebuild(self, err: BaseException) -> None:
        """A new group from the loss as first sent, then the last checkpoint ``save()`` wrote; told in ``err``."""
        lost = self.num_updates - (self._last_save[1] if self._last_save else 0)
        try:
            self._broken = None
            self._start(*self._build)
            if self._last_save is not None:
                self.num_updates = self._call("load", self._last_save[0], what="load() after a rebuild")[0]
            else:
                self.num_updates = 0
            self._moved()
        except BaseException as again:  # noqa: BLE001 - the rebuild failed: the group stays ended, both told
            self._broken = err
            self._end_group()
            err.args = (f"{err} The group was ended, and on_lost_rank='rebuild' could not build a new one "
                        f"({type(again).__name__}: {again}). {CONTINUE}",)
            return
        start = f"the checkpoint {self._last_save[0]}" if self._last_save else "the loss as first sent (nothing saved yet)"
        err.rebuilt_from = self._last_save[0] if self._last_save else None
        err.lost_updates = lost
        err.args = (f"{err} The group was ended and, as on_lost_rank='rebuild' asks, a new one was built from {start}, "
                    f"at update {self.num_updates} (num_updates is back there): the {lost} update(s) since, and this "
                    f"call's, were not kept.{EMPTY_BUFFERS if self._rank_buffers else ''} The learner is usable: call "
                    "update() again with the next batch.",)

    def _end_group(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception:  # noqa: BLE001 - the runtime may already be down
                pass
            self._group = None

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"This RemoteLearner's group was ended by an earlier fault ({self._broken}). Build a "
                               "new RemoteLearner and load the last checkpoint to continue.") from self._broken
        if self._closed:
            raise RuntimeError("This RemoteLearner is closed; build a new one to keep training.")

    # ---- the step -----------------------------------------------------------------------------

    def update(self, batch: TensorDictBase, *, wait: bool = True):
        """One update on the whole ``batch``, split over the ranks; see ``Learner.update``.

        Args:
            batch (TensorDictBase): the global batch; a plain TensorDict's size must divide by
                ``num_learners``; a lazy stack of samples of different lengths is dealt by tokens.

        Keyword Args:
            wait (bool): ``False`` returns a :class:`PendingUpdate` at once (after waiting for the
                oldest one if ``max_in_flight`` are pending): the ranks train while this process
                goes on. Updates run in the order they were asked for.

        Returns:
            The combined loss output (``"grad_norm"`` on step calls), or a ``PendingUpdate``.
        """
        self._check_usable()
        shares, groups = _shares.split(batch, self.num_learners)
        return self._submit(batch, shares, groups is None, "update", (), wait)

    def update_minibatches(self, batch: TensorDictBase, minibatch_size: int, *, epochs: int = 1, shuffle: bool = True,
                           seed: int | None = None, normalize_advantage=False, wait: bool = True):
        """``Learner.update_minibatches`` run by the ranks in one call: each rank its share, every step there.

        With ``shuffle=True`` (PPO's epochs) each rank takes an equal contiguous share of ``batch`` and
        partitions it each epoch into minibatches of ``minibatch_size / num_learners`` (generator
        ``seed + rank``), so step ``i`` trains on the union of the ranks' ``i``-th minibatches, the
        advantage standardised over it with ``normalize_advantage``: the loop an SPMD program runs. With
        ``shuffle=False`` (K updates on K sampled batches, concatenated) rank ``r`` takes the ``r``-th part
        of every minibatch, so step ``i`` trains on rows ``[i * minibatch_size, (i + 1) * minibatch_size)``
        of ``batch``, as ``LocalLearner`` does. Returns every step's combined output, stacked; what the
        loss writes (``td_error``) lands in ``batch`` at its rows.

        Raises:
            ValueError: ``batch`` or ``minibatch_size`` does not divide by ``num_learners``, ``shuffle=False``
                with a batch that is not whole minibatches, a lazy stack dealt by tokens, or a bad argument
                (nothing is sent).
        """
        from fabric_learner.step import minibatches as _minibatches

        self._check_usable()
        _minibatches.check_arguments(minibatch_size, epochs, shuffle, seed, normalize_advantage)
        ranks = self.num_learners
        n = batch.batch_size[0] if isinstance(batch, TensorDictBase) and batch.batch_dims == 1 else None
        if n is None:
            raise ValueError("update_minibatches() takes a TensorDict of one batch dimension (batch.reshape(-1) for "
                             "[envs, time]). Nothing was sent.")
        if minibatch_size % (ranks * self.grad_accum_steps) or n % ranks:
            raise ValueError(f"update_minibatches() gives each of the {ranks} ranks an equal part of the batch ({n}) and "
                             f"of every minibatch ({minibatch_size}), in grad_accum_steps={self.grad_accum_steps} equal "
                             f"micro-batches: the batch must divide by num_learners={ranks}, the minibatch by "
                             f"{ranks * self.grad_accum_steps}. Nothing was sent.")
        if n < minibatch_size:
            raise ValueError(f"The batch holds {n} samples, fewer than one minibatch of {minibatch_size}. Nothing was sent.")
        key = _minibatches.advantage_key(normalize_advantage)
        if key is not None and key not in batch.keys(include_nested=True):
            raise KeyError(f"normalize_advantage names {key!r}, which the batch lacks. Nothing was sent.")
        order = None
        if shuffle:
            shares, groups = _shares.split(batch, ranks)
            if groups is not None:
                raise ValueError("update_minibatches() cuts equal shares; a lazy stack of samples of different lengths "
                                 "is dealt by tokens: call update() per minibatch. Nothing was sent.")
        else:
            if n % minibatch_size:
                raise ValueError(f"With shuffle=False the batch must be whole minibatches: {n} samples are not a multiple "
                                 f"of {minibatch_size}. Nothing was sent.")
            part = minibatch_size // ranks
            steps = torch.arange(n // minibatch_size).unsqueeze(1) * minibatch_size
            rows = [(steps + r * part + torch.arange(part)).reshape(-1) for r in range(ranks)]
            shares, order = [batch[r] for r in rows], torch.cat(rows)
        extra = (minibatch_size // ranks, epochs, shuffle, seed, normalize_advantage)
        return self._submit(batch, shares, True, "update_minibatches", extra, wait, order)

    # ---- replay buffers beside the ranks ------------------------------------------------------------

    @property
    def replay_buffer(self):
        """The ranks' replay buffers (``replay_buffer=``) as one writer: torchrl's ``RayCollector(...,
        replay_buffer=learner.replay_buffer)`` gives each collector a client writing into one rank's buffer
        (collector ``i`` into rank ``i % num_learners``), so its batches never cross this process."""
        from fabric_learner.remote.buffers import RankBuffers

        self._check_buffers("replay_buffer")
        return RankBuffers(self._actors)

    def extend(self, data: TensorDictBase) -> list[int]:
        """Add ``data``'s rows to the ranks' replay buffers, rank ``r`` taking the ``r``-th contiguous part (as
        ``update(data)`` deals it); returns each buffer's length.

        Raises:
            RuntimeError: the learner was built without ``replay_buffer=`` (nothing sent).
            ValueError: ``data`` has fewer rows than there are ranks (nothing sent).
        """
        self._check_buffers("extend()")
        if not isinstance(data, TensorDictBase) or data.batch_dims < 1 or data.batch_size[0] < self.num_learners:
            raise ValueError(f"extend() deals the rows of a TensorDict over the {self.num_learners} ranks' buffers: it "
                             f"needs at least {self.num_learners} rows. Nothing was sent.")
        self._settle()
        parts = torch.arange(data.batch_size[0]).tensor_split(self.num_learners)
        refs = [actor.extend.remote(packed(data[rows].to("cpu"))) for actor, rows in zip(self._actors, parts)]
        return self._gather(refs, "extend()")

    def update_from_buffer(self, num_updates: int = 1) -> TensorDictBase:
        """``num_updates`` updates in one call, each rank sampling its share of every step from its own buffer.

        Step ``i`` trains on the union of the ranks' ``i``-th samples (each the buffer's ``batch_size``),
        as ``LocalLearner.update`` on their concatenation, rank order, would (a loss that normalises by
        importance weights, torchrl's DQN with ``beta > 0``, does so per rank, as under DDP); what the loss writes under
        the buffer's ``priority_key`` (DQN's ``td_error``) updates that rank's priorities after each step.
        ``last_sampled`` holds what the samplers drew, ``[num_updates, num_learners, batch_size]``: each
        rank's storage ``index`` and, from a prioritized sampler, the ``priority_weight`` the loss used.
        Returns every step's combined output, stacked.

        Raises:
            RuntimeError: the learner was built without ``replay_buffer=`` (nothing sent).
            ValueError: a bad ``num_updates``, or ``grad_accum_steps > 1`` (nothing sent); a rank could not
                sample its buffer (empty, or its sampler raised): every rank raises before that step, the
                steps before it kept and counted in ``num_updates``. A step's own error (a non-finite loss)
                also leaves the earlier steps taken and counted.
        """
        self._check_buffers("update_from_buffer()")
        if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 1:
            raise ValueError(f"num_updates must be an integer >= 1, got {num_updates!r}. Nothing was sent.")
        if self.grad_accum_steps != 1:
            raise ValueError("update_from_buffer() steps the optimizer on every sample; this learner accumulates "
                             f"grad_accum_steps={self.grad_accum_steps}: sample bigger batches instead. Nothing was sent.")
        self._settle()
        try:
            answers = self._call("update_from_buffer", num_updates, what="update_from_buffer()")
        except (LearnerLostError, LearnerTimeoutError):
            raise
        except Exception:  # a step that failed after others were taken: those stay taken, counted here too
            if self._broken is None:
                self.num_updates, self.skipped_updates = self._call("call", _counters, what="update counters")[0]
                self._moved()
            raise
        self.num_updates, self.skipped_updates = answers[0][1], answers[0][2]
        self._moved()
        self.last_rank_seconds = [float(a[5]) for a in answers]
        self.last_sampled = torch.stack([a[6] for a in answers], dim=1)
        if self._follower is not None:
            self._follower.after_update()
        return combine([a[0] for a in answers], [a[3] for a in answers])

    def _check_buffers(self, what: str) -> None:
        self._check_usable()
        if not self._rank_buffers:
            raise RuntimeError(f"{what} needs replay buffers beside the ranks: build the learner with "
                               "replay_buffer=f, f() -> TensorDictReplayBuffer (called on each rank). Nothing was sent.")

    def _submit(self, batch, shares, write_back: bool, method: str, extra: tuple, wait: bool, order=None):
        """Send each rank its share for ``method`` (``update`` or ``update_minibatches``); see :meth:`update`."""
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight[0].result()
        self._check_usable()  # an earlier update may have ended the group
        if self._follower is not None:
            self._follower.push()  # a target network moved here reaches the ranks before they read it
        import ray

        # arrays over the batch's own memory, or bytes: Ray copies them (into the call, or by ray.put) before
        # update() returns, so what the caller does with its batch next reaches no rank
        wires = [packed(share) for share in shares]
        crossing = [wire_bytes(wire) for wire in wires]
        sizes = [size if arrays_of(wire) is not None else int(share.bytes())
                 for share, wire, size in zip(shares, wires, crossing)]  # the shares' tensor bytes
        inline = [size <= INLINE_BYTES for size in crossing]
        # a small share rides inside the call (Ray inlines it into the task), a large one goes through the
        # object store once: ray.put of a small share cost about 1.8 ms here against 0.4 ms inline
        args = [wire if small else ray.put(wire) for wire, small in zip(wires, inline)]
        # equal shares: what the loss writes comes back into the caller's batch
        handle = PendingUpdate(self, [getattr(a, method).remote(arg, write_back, *extra)
                                      for a, arg in zip(self._actors, args)])
        handle._batch, handle._order = (batch if write_back else None), order
        inline_bytes = sum(size for size, small in zip(sizes, inline) if small)
        handle.transfer = {"batch_bytes": int(batch.bytes()), "sent_bytes": sum(sizes), "inline_bytes": inline_bytes,
                           "object_store_bytes": sum(sizes) - inline_bytes,
                           "wire_bytes": sum(crossing)}
        self._in_flight.append(handle)
        if wait:
            return handle.result()
        handle._pipelined = True  # this process goes on while it runs
        return handle

    def _collect(self, handle: PendingUpdate) -> None:
        """Wait for ``handle`` and every earlier update, in order, applying their counters here.

        The first of them to fail raises here, whichever handle was asked for: an update's error is
        never left unseen behind a later one (the handles keep theirs for their own ``result()``).
        """
        while self._in_flight:
            head = self._in_flight[0]
            try:
                answers = self._gather(head._refs, "update()")
            except BaseException as err:
                if self._in_flight and self._in_flight[0] is head:
                    self._in_flight.popleft()
                head._error = err
                raise
            self._in_flight.popleft()
            self.num_updates, self.skipped_updates = answers[0][1], answers[0][2]  # the ranks stepped, whatever follows
            self._moved(head._pipelined)
            head.policy_version = self.num_updates
            head.transfer["returned_bytes"] = sum(wire_bytes(a[0]) + (wire_bytes(a[4][0]) if a[4] else 0)
                                                  for a in answers)
            self.last_transfer = head.transfer
            self.last_rank_seconds = [float(a[5]) for a in answers]
            try:
                result = combine([a[0] for a in answers], [a[3] for a in answers])
                if head._batch is not None and all(a[4] is not None for a in answers):
                    _write_back(head._batch, [unpacked(a[4][0]) for a in answers], answers[0][4][1], head._order)
            except BaseException as err:  # this update's own error, kept on its handle as the ranks' are
                head._error = err
                raise
            finally:
                head._batch = None
            head._result = result
            if head is handle:
                break
        if self._follower is not None and not self._in_flight:
            self._follower.after_update()

    def _moved(self, pipelined: bool = False) -> None:
        """The group's weights changed: the modules here are behind until they are next run."""
        if self._follower is not None:
            self._follower.moved(while_running=pipelined)

    def _drain(self) -> None:
        while self._in_flight:
            self._in_flight[-1].result()

    def _settle(self) -> None:
        """Every update collected, and what this process wrote into the loss's buffers sent to the ranks."""
        self._drain()
        if self._follower is not None:
            self._follower.push()

    # ---- weights and checkpoints ----------------------------------------------------------------

    def get_weights(self, *, cpu_offload: bool = True) -> TensorDictBase:
        """The trained weights as plain tensors in this process (gathered from the shards under FSDP)."""
        self._drain()
        follower = self._follower
        if follower is not None and self.policy is not None and follower.follows(self.policy, whole=True):
            # the policy here is the loss's module: fetched into it (as running it would), then copied as one process does
            follower.pull(follower.names(self.policy))
            return plain_weights(self.loss_module, self.policy, True)
        ranks = None if self._sharded else [0]
        return self._call("get_weights", what="get_weights()", ranks=ranks)[0]  # CPU tensors either way

    def checkpoint(self) -> dict[str, Any]:
        """See ``Learner.checkpoint``: the group's state (full tensors), in this process."""
        self._settle()
        return self._call("checkpoint", what="checkpoint()")[0]

    def load_checkpoint(self, checkpoint) -> None:
        """See ``Learner.load_checkpoint``: sent once through the object store, loaded by every rank."""
        import ray

        self._drain()
        ref = ray.put(checkpoint)
        self.num_updates = self._call("load_checkpoint", ref, what="load_checkpoint()")[0]
        self._moved()

    def save(self, path, blocking: bool = True) -> Future | None:
        """Every rank writes its part (a file under DDP, a DCP folder under FSDP): the formats any learner loads.

        ``path`` must be reachable by every rank (a shared filesystem on a multi-node cluster).
        Saves before returning; ``blocking=False`` returns a finished future.
        """
        self._settle()
        path = os.path.abspath(os.fspath(path))
        self._call("save", path, what="save()")
        self._last_save = (path, self.num_updates)
        if blocking:
            return None
        done: Future = Future()
        done.set_result(None)
        return done

    def load(self, path) -> None:
        """Every rank loads ``path`` (written by any learner, any strategy or world size)."""
        self._drain()
        self.num_updates = self._call("load", os.path.abspath(os.fspath(path)), what="load()")[0]
        self._moved()

    def wait_for_save(self, timeout: float | None = None) -> None:
        """Saves complete before ``save`` returns: nothing to wait for."""

    @contextlib.contextmanager
    def full_parameters(self):
        """Inside the block the loss given here holds the group's current weights; what the block changes in it reaches the ranks.

        For code that runs the loss's networks in this process between updates: a value estimator
        reading the critic (``LearnerValueEstimator``), a target-network updater (torchrl's
        ``SoftUpdate`` / ``HardUpdate`` on the loss, which ``fabric_learner.Trainer`` runs in
        this block). On entering, rank 0's whole loss state (gathered under FSDP) is loaded into
        ``loss_module``; on leaving, the entries the block changed are copied into every rank's
        loss, so the ranks stay identical and the next update sees them. Under FSDP only buffers
        (a target network's) may change: the sharded parameters are the ranks'.

        Raises:
            ValueError: the learner was built from a factory (there is no loss here to fill), or,
                on leaving, the block changed a parameter of a sharded group (no rank changes).
        """
        if self.loss_module is None:
            raise ValueError(
                "full_parameters() fills the loss given to RemoteLearner with the group's weights, but this learner was "
                "built from a factory, so this process holds no loss. Build it from the loss object (with policy=) to "
                "run its networks here, or run the code on the ranks with call_on_ranks(fn).")
        self._drain()
        loss = self.loss_module
        if self._follower is not None:
            with self._follower.whole():
                yield loss
            return
        state = self._call("loss_state", what="full_parameters()")[0]
        # the entries both hold: a rank's loss may have built more (its value estimator's gamma, in update)
        state = {k: v for k, v in state.items() if k in loss.state_dict()}
        loss.load_state_dict(state, strict=False)
        yield loss
        now = loss.state_dict()
        changed = {k: now[k].detach().clone() for k, v in state.items() if not torch.equal(now[k], v)}
        if changed:
            self._call("load_loss_entries", changed, what="full_parameters() (sending the changed entries)")

    def serve(self, module: nn.Module) -> bool:
        """Whether ``module`` follows the group's weights here (a module of the loss, with ``follow=True``).

        Nothing is trained in this process; a module that does not follow takes :meth:`get_weights`
        (``fabric_learner.weights.publish_to_collector`` loads them into a collector's policy).
        """
        return self._follower is not None and self._follower.follows(module)

    def call_on_ranks(self, fn, *args) -> list[Any]:
        """``fn(rank_learner, *args)`` on every rank (each a ``FabricLearner``), answers in rank order.

        For inspection and tools; ``fn`` must be picklable and must not change the learner's state.
        """
        self._settle()
        return self._call("call", fn, *args, what="call_on_ranks()")

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """End the group (every rank closes its learner, then the actors end); idempotent.

        The embedded runtime shuts down with the last learner using it.
        """
        if self._closed:
            return
        try:
            if self._broken is None and self._actors:
                try:
                    self._drain()
                finally:
                    if self._broken is None and self._actors:
                        self._call("close", what="close()")
        finally:
            self._closed = True
            self._end_group()
            self._unfollow()
            if self._embedded:
                _runtime.leave()

    def _unfollow(self) -> None:
        """The loss here becomes a plain module again (its hooks removed), holding the weights it last fetched."""
        if self._follower is not None:
            self._follower.close()
            self._follower = None

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
            return
        self._closed = True  # an error is on its way up: end the actors without waiting for them
        closed = RuntimeError(
            f"This update was not collected before its RemoteLearner was closed: the with block exited on "
            f"{kind.__name__} ({value}), which ends the group without waiting for the updates in flight, so its result "
            "is gone (no rank was lost). Collect an update (pending.result()) inside the block to keep it.")
        for handle in self._in_flight:
            handle._error = closed
        self._in_flight.clear()
        self._end_group()
        self._unfollow()
        if self._embedded:
            _runtime.leave()

    @property
    def world_size(self) -> int:
        return 1  # the controller is one process; num_learners is the group's size

    @property
    def broken(self) -> BaseException | None:
        """The fault that ended the group, or ``None``."""
        return self._broken


class PendingUpdate:
    """An update in flight: ``result()`` waits for it; ``policy_version`` is the update count it produced."""

    def __init__(self, learner: RemoteLearner, refs: list[Any]) -> None:
        self._learner, self._refs = learner, refs
        self._result: TensorDictBase | None = None
        self._error: BaseException | None = None
        self._batch: TensorDictBase | None = None
        self._order: torch.Tensor | None = None  # the batch's rows the shares hold, in order, when not contiguous
        self._pipelined = False  # returned at once (wait=False): the caller ran code while it was in flight
        self.policy_version: int | None = None
        self.transfer: dict[str, int] = {}

    def done(self) -> bool:
        """Whether ``result()`` would return (or raise) without waiting."""
        if self._result is not None or self._error is not None:
            return True
        import ray

        ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self) -> TensorDictBase:
        """The combined output (as ``update(batch)`` returns it); raises what the update raised."""
        if self._result is None and self._error is None:
            self._learner._collect(self)
        if self._error is not None:
            raise self._error
        return self._result


def _counters(rank_learner) -> tuple[int, int]:
    return rank_learner.num_updates, rank_learner.skipped_updates


def combine(outputs: list[Any], weights: list[float]) -> TensorDictBase:
    """The ranks' outputs (as they crossed, or TensorDicts) as one process's on the whole batch.

    Floating entries are averaged with ``weights`` (the samples or tokens each rank's loss averaged
    over), in float64; ``grad_norm*`` entries, equal on every rank after the gradient sync, and any
    other entry are rank 0's. Outputs that crossed as arrays are combined as arrays (a tenth of the
    time a TensorDict's entries take, for the few scalars a loss returns).
    """
    total = sum(weights)
    arrays = [arrays_of(o) for o in outputs]
    if all(a is not None for a in arrays):
        out = {}
        with numpy.errstate(all="ignore"):  # inf - inf is nan here as in torch, without numpy's warning
            for key, value in arrays[0].items():
                if _averaged(key, value.dtype.kind == "f", [a[key].shape for a in arrays]):
                    mean = sum(a[key].astype(numpy.float64) * (w / total) for a, w in zip(arrays, weights))
                    if value.dtype == numpy.float16:  # torch rounds float64 to half through float32
                        mean = numpy.asarray(mean).astype(numpy.float32)
                    value = numpy.asarray(mean).astype(value.dtype)
                out[key] = value
        return unpacked(with_arrays(outputs[0], out))
    outputs = [unpacked(o) for o in outputs]
    first = outputs[0]
    out = TensorDict({}, batch_size=first.batch_size, device=first.device)
    for key in first.keys(include_nested=True, leaves_only=True):
        value = first.get(key)
        if isinstance(value, torch.Tensor) and _averaged(key, value.is_floating_point(),
                                                         [o.get(key).shape for o in outputs]):
            value = sum(o.get(key).double() * (w / total) for o, w in zip(outputs, weights)).to(value.dtype)
        out.set(key, value)
    return out


def _averaged(key, floating: bool, shapes: list) -> bool:
    name = key if isinstance(key, str) else key[-1]
    return floating and not name.startswith("grad_norm") and all(shape == shapes[0] for shape in shapes)


def _write_back(batch: TensorDictBase, written: list[TensorDictBase], in_place: list, order=None) -> None:
    """Put what the loss wrote into the ranks' shares (DQN's ``td_error``) into the caller's batch, as one process
    does: into the entry the batch holds where the loss wrote in place, else as a new or replacing entry.
    ``order``: the batch's rows the shares hold, one after the other (default: contiguous, in order)."""
    whole = torch.cat(written, 0)
    if order is not None:
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel())
        whole = whole[where]
    for key in whole.keys(include_nested=True, leaves_only=True):
        batch.set(key, whole.get(key), inplace=key in in_place)


def _payload(loss_module: Any, policy: nn.Module | None) -> Any:
    """What the ranks build the loss from: ``(loss, policy)`` or a factory."""
    if isinstance(loss_module, nn.Module):
        from fabric_learner.learner import check_policy

        check_policy(loss_module, policy)  # a module of the loss, refused here before any rank starts
        return loss_module, policy  # pickled together: the policy stays the loss's own module on the ranks
    if callable(loss_module):
        if policy is not None:
            raise ValueError("With a loss factory, return (loss, policy) from it instead of passing policy=: the "
                             "policy must be the module of the loss built on each rank.")
        return loss_module
    raise TypeError(f"loss_module must be a torchrl loss (an nn.Module) or a factory returning one, got "
                    f"{type(loss_module).__name__}.")


def _pickled(sent: Any) -> bytes:
    """What the ranks build from, pickled once here: a loss that cannot travel is refused before anything starts."""
    from ray import cloudpickle

    try:
        return cloudpickle.dumps(sent)
    except Exception as err:  # any pickling failure: named with the fix
        raise TypeError(
            f"The loss (or its policy, the optimizer factory, stages or strategy) cannot be sent to the learner ranks "
            f"({type(err).__name__}: {err}). Nothing was started. Pass a factory instead of the object, e.g. "
            "RemoteLearner(lambda: make_loss(), ...), returning the loss or (loss, policy): each rank calls it to build "
            "its own.") from err


def _check_step_options(loss_module, optimizer, clip_grad_norm, on_nonfinite, stages) -> None:
    """What every rank would refuse, refused here first: before a runtime or an actor starts."""
    from fabric_learner.learner import NONFINITE_MODES
    from fabric_learner.step.stages import check_stages

    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be a positive number or None (no clipping), got {clip_grad_norm!r}.")
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}.")
    if stages is not None:
        if optimizer is not None:
            raise ValueError("With stages=, each Stage builds its own optimizer; pass optimizer=None.")
        if clip_grad_norm is not None:
            raise ValueError("With stages=, give each Stage its own clip_grad_norm.")
        if isinstance(loss_module, nn.Module):
            check_stages(stages, loss_module.named_parameters(), loss_module)


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "RemoteLearner builds the optimizer on each rank, over that rank's parameters: pass a factory "
            "f(params) -> Optimizer (e.g. functools.partial(torch.optim.Adam, lr=3e-4)) or None, not an instance "
            "(it holds this process's parameters). Nothing was started.")
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"optimizer must be None or a callable params -> Optimizer, got {type(optimizer).__name__}.")


def _actor_class(ray, rank_class):
    """``rank_class`` as a Ray actor whose ``where()`` answers while another call runs."""
    class _Rank(rank_class):
        @ray.method(concurrency_group="control")
        def where(self) -> str:
            return rank_class.where(self)

    return ray.remote(concurrency_groups={"control": 1})(_Rank)
