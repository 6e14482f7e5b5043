"""What runs inside one Ray actor: one rank of a ``RemoteLearner``, a ``FabricLearner`` in its own process.

Each actor is a node of one device in Lightning's terms (``num_nodes=world_size``, ``devices=1``):
Ray gives an actor only the GPUs it asked for, so its device is always its first visible one, and
FSDP's mesh puts every rank on the data-parallel dimension. The rendezvous goes through the
environment Lightning reads for processes it did not start (``MASTER_ADDR``/``MASTER_PORT`` of
rank 0's actor, ``NODE_RANK``, ``LOCAL_RANK=0``), so the learner is built exactly as under
``fabric run`` on N one-device nodes; the store at that address is rank 0's, listening on its node's
address only (``remote._rendezvous``).

The actor runs its calls one at a time in submission order (Ray's default group, one thread);
``where()`` alone runs beside them (its own group), to say what a silent rank is doing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
from tensordict import LazyStackedTensorDict

from fabric_learner.remote import _rendezvous
from fabric_learner.remote._wire import _NUMPY_DTYPES, packed, unpacked


class LearnerRank:
    """One learner rank. Methods mirror the ``Learner`` contract on this rank's share."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self._thread: int | None = None  # the thread running the current call, for where()
        self._listening = self._store = None  # rank 0: the group's rendezvous socket, then its store

    # ---- building ---------------------------------------------------------------------------

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and the port the group's store listens on there (``remote._rendezvous``)."""
        self._listening = _rendezvous.listener()
        address, port = self._listening.getsockname()[:2]
        return address, port

    def setup(self, sent: bytes, address: str, port: int) -> dict:
        """Build the loss (from the object or factory sent) and the FabricLearner; join the group.

        ``sent``: ``(payload, optimizer, options)`` pickled by the controller, read by every rank.
        """
        from ray import cloudpickle

        from fabric_learner.fabric import FabricLearner

        try:
            payload, optimizer, options, buffer = cloudpickle.loads(sent)
        except (ImportError, AttributeError) as err:
            raise type(err)(
                f"This rank cannot rebuild the loss sent to it: {err}. Its classes must be importable on every node "
                "(install the package there, or ray.init(runtime_env={'py_modules': [...]})), or pass a factory "
                "defined in an importable module.") from err
        self._thread = threading.get_ident()
        self._store = _rendezvous.join(self.rank, self.world_size, address, port, self._listening,
                                         options.get("timeout", 1800.0))
        loss, policy = built(payload)
        self.learner = FabricLearner(loss, optimizer, policy=policy, devices=1, num_nodes=self.world_size, **options)
        if buffer is not None:  # beside the learner, where call_on_ranks(fn) finds it
            self.learner.replay_buffer = _replay_buffer(buffer)
        return {"pid": os.getpid(), "sharded": self.learner.capabilities.sharded}

    # ---- the contract, on this rank -----------------------------------------------------------

    def update(self, share, write_back: bool = True) -> tuple[Any, int, int, float, Any, float]:
        """One ``update`` on this rank's share: ``(output, num_updates, skipped_updates, weight, written, seconds)``.

        ``weight`` is what the share's loss averaged over (tokens or samples for torchrl's LLM
        losses, else the share's sample count): the controller averages the ranks' outputs by it.
        ``written``: with ``write_back``, ``(entries, in_place)``: the entries the loss added to the
        share, replaced or wrote into (DQN's ``td_error``, also when the batch already held one), and
        the keys of those it wrote into in place; else ``None``. ``seconds``: this rank's wall time
        in ``FabricLearner.update`` (what an SPMD rank spends on it).
        """
        self._thread = threading.get_ident()
        learner = self.learner
        received, share = share, unpacked(share)
        leaves = _leaves(share) if write_back else None
        first = learner._accum_step == 0
        before = None if first or learner._window_count is None else learner._window_count
        start = time.perf_counter()
        try:
            out = learner.update(share)
        except FloatingPointError as err:  # say where: the controller raises the error of a rank holding the values
            raise _naming_nonfinite_rows(err, unpacked(received), self.rank, contiguous=write_back) from err
        seconds = time.perf_counter() - start
        if learner._counts is not None and learner._window_count is not None:
            weight = float(learner._window_count - (0 if before is None else before))
        else:
            weight = float(share.batch_size[0])
        written = None
        if write_back:
            new, in_place = _written(leaves, _leaves(share))
            written = (packed(share.select(*new)), in_place) if new else None
        return packed(out), learner.num_updates, learner.skipped_updates, weight, written, seconds

    def update_minibatches(self, share, write_back: bool, minibatch_size: int, epochs: int, shuffle: bool,
                           seed, normalize_advantage) -> tuple[Any, int, int, float, Any, float]:
        """``FabricLearner.update_minibatches`` on this rank's share; answers as :meth:`update` does, the output
        stacked over the steps and ``written`` covering the whole share."""
        self._thread = threading.get_ident()
        learner = self.learner
        share = unpacked(share)
        leaves = _leaves(share) if write_back else None
        start = time.perf_counter()
        out = learner.update_minibatches(share, minibatch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                                         normalize_advantage=normalize_advantage)
        seconds = time.perf_counter() - start
        written = None
        if write_back:
            new, in_place = _written(leaves, _leaves(share))
            written = (packed(share.select(*new)), in_place) if new else None
        return packed(out), learner.num_updates, learner.skipped_updates, float(share.batch_size[0]), written, seconds

    def extend(self, rows) -> int:
        """Add ``rows`` to this rank's replay buffer (the controller's share, or a collector's batch); its length."""
        self._thread = threading.get_ident()
        buffer = self.learner.replay_buffer
        buffer.extend(unpacked(rows))
        return len(buffer)

    def buffer_write_count(self) -> int:
        return self.learner.replay_buffer.write_count

    def buffer_length(self) -> int:
        return len(self.learner.replay_buffer)

    def update_from_buffer(self, num_updates: int) -> tuple[Any, int, int, float, Any, float, Any]:
        """``num_updates`` updates, each on a sample of this rank's buffer, the priorities written back after each.

        Answers as :meth:`update`, the output stacked over the steps, plus what the sampler added to the
        samples (``index``, and ``priority_weight`` where it weighs them), ``[num_updates, buffer batch]``.
        Before each step the ranks agree that every one of them drew its sample (an empty buffer, a
        sampler with nothing left): otherwise every rank raises alike, where one raising alone would
        leave its peers in the step's collectives. torchrl's random and prioritized samplers draw
        whenever the buffer holds a row, so with them the ranks agree before the first step only. A
        later step's error leaves the earlier steps taken.
        """
        from torchrl.data.replay_buffers.samplers import PrioritizedSampler, RandomSampler

        from fabric_learner.collectives import all_reduce
        from fabric_learner.replay import TorchPrioritizedSampler

        self._thread = threading.get_ident()
        learner, buffer = self.learner, self.learner.replay_buffer
        key = getattr(buffer, "priority_key", None)
        # these draw whenever the buffer holds a row: agreeing before the first step is enough (spares a collective a step)
        once = type(buffer.sampler) in (RandomSampler, PrioritizedSampler, TorchPrioritizedSampler)
        outs, drawn, seconds = [], [], 0.0
        for step in range(num_updates):
            try:
                sample, failed = (buffer.sample(), None) if len(buffer) else (None, "it is empty")
            except Exception as err:  # noqa: BLE001 - told to every rank below, raised with its cause here
                sample, failed = None, f"{type(err).__name__}: {err}"
            mine = self.rank if failed else self.world_size
            first = int(all_reduce(torch.tensor(mine), "min", group=None)) if step == 0 or not once else mine
            if first < self.world_size:  # the lowest failing rank, named by every rank
                cause = f" ({failed})" if first == self.rank else ""
                raise ValueError(
                    f"Learner rank {first} could not sample its replay buffer{cause}, so no rank took step {step} of "
                    f"{num_updates}; {step} step(s) were taken before it. Fill every rank's buffer first "
                    "(learner.extend(batch), or collectors writing into learner.replay_buffer, at least one per "
                    "rank).") from None
            start = time.perf_counter()
            outs.append(learner.update(sample))
            seconds += time.perf_counter() - start
            if key is not None and key in sample.keys(include_nested=True):  # DQN's td_error, as the loss wrote it
                buffer.update_tensordict_priority(sample)
            drawn.append(sample.select("index", "priority_weight", strict=False))
        return (packed(torch.stack(outs)), learner.num_updates, learner.skipped_updates, float(buffer.batch_size),
                None, seconds, torch.stack(drawn))

    def get_weights(self):
        self._thread = threading.get_ident()
        weights = self.learner.get_weights(cpu_offload=True)
        return weights if self.rank == 0 else None

    def checkpoint(self):
        self._thread = threading.get_ident()
        state = self.learner.checkpoint()
        return state if self.rank == 0 else None

    def load_checkpoint(self, state) -> int:
        self._thread = threading.get_ident()
        self.learner.load_checkpoint(state)
        return self.learner.num_updates

    def save(self, path: str) -> None:
        self._thread = threading.get_ident()
        self.learner.save(path)

    def load(self, path: str) -> int:
        self._thread = threading.get_ident()
        self.learner.load(path)
        return self.learner.num_updates

    def loss_state(self):
        """Rank 0's whole loss state as CPU tensors (gathered under FSDP: every rank is called), else ``None``."""
        self._thread = threading.get_ident()
        learner = self.learner
        with learner.full_parameters() if learner.capabilities.sharded else contextlib.nullcontext():
            if self.rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in learner.loss_module.state_dict().items()}

    def loss_entries(self, names: list[str]):
        """Rank 0's values of the named loss state entries, as numpy arrays where numpy holds the dtype (a
        tensor otherwise); gathered under FSDP (every rank is called), else ``None`` on other ranks."""
        self._thread = threading.get_ident()
        learner = self.learner
        with learner.full_parameters() if learner.capabilities.sharded else contextlib.nullcontext():
            if self.rank != 0:
                return None
            state = learner.loss_module.state_dict()
            return {k: _plain(state[k]) for k in names}

    def load_loss_entries(self, entries: dict) -> None:
        """Copy ``entries`` (loss state names to tensors) into this rank's loss, all or none."""
        self._thread = threading.get_ident()
        learner = self.learner
        own = learner.loss_module.state_dict(keep_vars=True)
        unknown = sorted(set(entries) - set(own))
        if unknown:
            raise KeyError(f"These entries are not in the ranks' loss state: {unknown}. Nothing was changed.")
        if learner.capabilities.sharded:
            params = sorted(k for k in entries if isinstance(own[k], torch.nn.Parameter))
            if params:
                raise ValueError(
                    f"The block changed parameters of a sharded group ({params}): their shards live on the ranks. "
                    "Nothing was changed. Change only buffers (a target network) inside full_parameters() under "
                    "FSDP, or use strategy='ddp', or change them on the ranks with call_on_ranks(fn).")
        with torch.no_grad():
            for k, v in entries.items():
                own[k].copy_(v)

    def call(self, fn, *args) -> Any:
        """``fn(learner, *args)`` on this rank (tests and tools: e.g. a rank's own parameters)."""
        self._thread = threading.get_ident()
        return fn(self.learner, *args)

    def close(self) -> None:
        self._thread = threading.get_ident()
        if self.learner is not None:
            self.learner.close()

    # ---- beside the calls ------------------------------------------------------------------------

    def where(self) -> str:
        """The innermost frames of the call this rank is running (answers while that call runs)."""
        frame = sys._current_frames().get(self._thread) if self._thread is not None else None
        if frame is None:
            return "idle"
        stack = traceback.extract_stack(frame)[-3:]
        return " <- ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(stack))


def _replay_buffer(factory):
    """The buffer ``factory()`` builds on this rank, refused unless each of its samples is a TensorDict of a
    fixed size (the ranks' samples must be equal for their mean gradient to be the whole sample's)."""
    from torchrl.data import TensorDictReplayBuffer

    buffer = factory()
    if not isinstance(buffer, TensorDictReplayBuffer) or not isinstance(buffer.batch_size, int):
        raise TypeError(f"replay_buffer must build a TensorDictReplayBuffer with an int batch_size (each rank's "
                        f"sample, the same on every rank), got {type(buffer).__name__} with batch_size "
                        f"{getattr(buffer, 'batch_size', None)!r}. Nothing was started.")
    return buffer


def _plain(value: torch.Tensor):
    value = value.detach().to("cpu", copy=True)
    return value.numpy() if value.dtype in _NUMPY_DTYPES else value


def _naming_nonfinite_rows(err: FloatingPointError, share, rank: int, contiguous: bool) -> FloatingPointError:
    """``err`` saying which rows of this rank's share (as received) hold non-finite values, as rows of the caller's
    batch where the shares are its contiguous equal parts (``nonfinite_rows``: key -> rows); else ``err``."""
    found: dict = {}
    if isinstance(share, LazyStackedTensorDict):
        for i, sample in enumerate(share.tensordicts):
            for key, value in sample.items(include_nested=True, leaves_only=True):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                    found.setdefault(key, []).append(i)
    else:
        for key, value in share.items(include_nested=True, leaves_only=True):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim > 0:
                bad = ~torch.isfinite(value.reshape(value.shape[0], -1)).all(1)
                if bad.any():
                    found[key] = bad.nonzero().flatten().tolist()
    if not found:
        return err
    offset = rank * share.batch_size[0] if contiguous else 0
    rows = {key: [offset + i for i in seen] for key, seen in found.items()}
    whose = "of the batch" if contiguous else "of its share (samples dealt by tokens)"
    where = "; ".join(f"{key!r} in rows {seen[:10]}{' and more' if len(seen) > 10 else ''} {whose}"
                      for key, seen in rows.items())
    named = FloatingPointError(f"{err} This rank's share holds non-finite values: {where}.")
    named.nonfinite_rows = rows
    return named


def _leaves(td) -> dict:
    """Each leaf key's stored objects with, for tensors, their versions (bumped by every in-place write).

    A lazy stack builds a new stacked tensor at every read, so its samples' own leaves are listed.
    """
    if isinstance(td, LazyStackedTensorDict):
        merged: dict = {}
        for part in td.tensordicts:
            for key, seen in _leaves(part).items():
                merged.setdefault(key, []).extend(seen)
        return merged
    return {k: [(v, getattr(v, "_version", None))] for k, v in td.items(include_nested=True, leaves_only=True)}


def _written(before: dict, after: dict) -> tuple[list, list]:
    """The keys the loss added, replaced or wrote into between ``before`` and ``after``; and of them, those
    it wrote into in place (the same objects, newer versions)."""
    written, in_place = [], []
    for key, seen in after.items():
        old = before.get(key)
        if old is None or len(old) != len(seen) or any(a is not b for (a, _), (b, _) in zip(old, seen)):
            written.append(key)
        elif any(va != vb for (_, va), (_, vb) in zip(old, seen)):
            written.append(key)
            in_place.append(key)
    return written, in_place


def built(payload: Any) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``(loss, policy)`` from what the controller sent: a ``(loss, policy)`` pair or a factory returning either."""
    if isinstance(payload, tuple):
        return payload
    made = payload()
    if isinstance(made, tuple):
        if len(made) != 2:
            raise TypeError(f"The loss factory returned a tuple of {len(made)}; return a loss or (loss, policy).")
        return made
    return made, None

