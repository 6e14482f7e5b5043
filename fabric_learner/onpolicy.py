"""On-policy data across ranks: global means and normalisation, and minibatch partitions.

Every rank collects its own rollouts and feeds ``learner.update`` its own minibatches; DDP and
FSDP then *average* gradients over ranks. That average equals one process on the union of the
ranks' data only when every statistic taken over samples is taken over the union too. The
helpers here do that with all-reduced sums and counts, so 2 ranks on two halves of a batch
learn exactly as one process on the whole batch:

- :func:`normalize_advantage` / :class:`GlobalAdvantageNormalization`: advantage
  standardisation with global mean and std (what ``ClipPPOLoss(normalize_advantage=True)``
  computes, but over every rank's minibatch rather than the local one);
- :class:`GlobalMeanLoss`: wraps a torchrl loss built with ``reduction="none"`` and divides
  each loss entry's local *sum* by the global *count* (variable samples, masks, tokens);
- :func:`global_sum`, :func:`global_mean`, :func:`global_count`: the reductions themselves
  (from :mod:`fabric_learner.collectives`, re-exported here);
- :func:`partition_indices` / :class:`EpochPartitionSampler`: PPO minibatches that partition
  the rank's batch without replacement each epoch, with the same number of minibatches on
  every rank (a rank that stepped once more than another would hang the others);
- :class:`LearnerValueEstimator`: GAE (or any value estimator) on each collected batch with
  the learner's full weights, also under FSDP.

Single process (no initialised process group, or world size 1) every helper reduces to the
ordinary local computation, so the same code runs under ``LocalLearner``.
All functions here are collectives when a process group is up: call them on every rank, in
the same order.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from tensordict import NestedKey, TensorDictBase
from torch import nn
from torchrl.data import SamplerWithoutReplacement
from torchrl.objectives.value.advantages import GAE
from torchrl.trainers import TrainerHookBase, ValueEstimatorHook

from fabric_learner.collectives import (  # re-exported: part of this module's public API
    _broadcast_mask,
    _mask_like,
    all_reduce,
    distributed_world_size,
    global_count,
    global_mean,
    global_sum,
)
from fabric_learner.sharding.mesh import DATA_PARALLEL, process_group
from fabric_learner.step.output import loss_keys

__all__ = [
    "EpochPartitionSampler",
    "GlobalAdvantageNormalization",
    "GlobalMeanLoss",
    "LearnerValueEstimator",
    "all_reduce",
    "distributed_world_size",
    "global_count",
    "global_mean",
    "global_sum",
    "normalize_advantage",
    "partition_indices",
]


# ---- advantage normalisation ------------------------------------------------------------------


def normalize_advantage(
    batch: TensorDictBase,
    key: NestedKey = "advantage",
    *,
    out_key: NestedKey | None = None,
    mask_key: NestedKey | None = None,
    group: Any = DATA_PARALLEL,
) -> TensorDictBase:
    """Standardise ``batch[key]`` with the mean and std of every rank's entries, in place.

    The formula is ``ClipPPOLoss(normalize_advantage=True)``'s, applied to the union of the
    ranks' data: without a mask ``(a - mean) / std.clamp_min(eps)`` with the unbiased std and
    ``eps`` the float32 resolution; with ``mask_key`` (a boolean entry, e.g.
    ``("collector", "mask")``) the masked mean and the biased masked std clamped at ``1e-4``
    (masked-out entries are normalised with the same statistics but do not contribute).
    Build the loss with ``normalize_advantage=False`` so it does not normalise again locally.
    A collective (one all-reduce, in float64).

    Args:
        batch (TensorDictBase): this rank's data.
        key (NestedKey): the entry to standardise (default ``"advantage"``).

    Keyword Args:
        out_key (NestedKey, optional): where to write the result (default: ``key``).
        mask_key (NestedKey, optional): a boolean entry selecting the valid samples.
        group (str or ProcessGroup): the mesh dimension to reduce over (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Returns:
        ``batch``, written in place.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fabric_learner.onpolicy import normalize_advantage
        >>> batch = TensorDict(advantage=torch.tensor([1.0, 2.0, 3.0, 6.0]), batch_size=[4])
        >>> normalize_advantage(batch)["advantage"]
        tensor([-0.9258, -0.4629,  0.0000,  1.3887])
    """
    adv = batch.get(key)
    mask = batch.get(mask_key) if mask_key is not None else None
    a = adv.detach().to(torch.float64)
    m = torch.ones_like(a) if mask is None else _broadcast_mask(mask, a).to(torch.float64)
    # one all-reduce of (sum, sum of squares, count), in float64
    total, sq, count = all_reduce(torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()]), "sum", group).unbind()
    mean = total / count.clamp_min(1)
    centred = (sq - count * mean * mean).clamp_min(0)
    if mask is None:  # torchrl's _standardize: unbiased std, clamped at the float32 resolution
        std = (centred / (count - 1).clamp_min(1)).sqrt()
        eps = torch.finfo(torch.float).resolution
    else:  # torchrl's masked PPO standardisation: biased std over the valid entries, clamped at 1e-4
        std = (centred / count.clamp_min(1)).sqrt()
        eps = 1e-4
    result = (adv - mean.to(adv.dtype)) / std.to(adv.dtype).clamp_min(eps)
    batch.set(out_key if out_key is not None else key, result)
    return batch


class GlobalAdvantageNormalization(TrainerHookBase):
    """Trainer hook: :func:`normalize_advantage` over all ranks, per minibatch or per batch.

    ``per="minibatch"`` (default, what ``ClipPPOLoss(normalize_advantage=True)`` does locally)
    registers at ``process_optim_batch`` and must come after the sampler that makes the
    minibatch (register it after :class:`EpochPartitionSampler`). ``per="batch"`` registers at
    ``pre_epoch`` and must come after the value estimator (``ValueEstimatorHook``).

    Args:
        key (NestedKey): the advantage entry (default ``"advantage"``).

    Keyword Args:
        mask_key (NestedKey, optional): a boolean entry selecting the valid samples.
        per (str): ``"minibatch"`` or ``"batch"``.
        group (str or ProcessGroup): the mesh dimension to reduce over (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Raises:
        ValueError: ``per`` is neither.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fabric_learner.onpolicy import GlobalAdvantageNormalization
        >>> hook = GlobalAdvantageNormalization(per="batch")
        >>> out = hook(TensorDict(advantage=torch.tensor([1.0, 2.0, 3.0, 6.0]), batch_size=[4]))
        >>> round(out["advantage"].mean().item(), 6), round(out["advantage"].std().item(), 6)
        (0.0, 1.0)
    """

    def __init__(self, key: NestedKey = "advantage", *, mask_key: NestedKey | None = None,
                 per: str = "minibatch", group: Any = DATA_PARALLEL) -> None:
        if per not in ("minibatch", "batch"):
            raise ValueError(f"per must be 'minibatch' or 'batch', got {per!r}.")
        self.key, self.mask_key, self.per, self.group = key, mask_key, per, group

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        if batch is None:
            return batch
        return normalize_advantage(batch, self.key, mask_key=self.mask_key, group=self.group)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return

    def register(self, trainer, name: str = "advantage_normalization") -> None:
        trainer.register_op("process_optim_batch" if self.per == "minibatch" else "pre_epoch", self)
        trainer.register_module(name, self)


# ---- value estimates with the learner's weights -------------------------------------------------


class LearnerValueEstimator(ValueEstimatorHook):
    """torchrl's ``ValueEstimatorHook`` run with the learner's full weights and without gradients.

    Under a sharded learner the loss's critic holds no whole weights outside ``update``; this
    hook gathers them for the call (a collective: every rank runs it, as every rank runs the
    same hooks). Under a ``RemoteLearner`` it fetches the group's current weights into the loss
    given to it (``RemoteLearner.full_parameters``). Otherwise it is the plain call. The estimator's state (e.g. ``GAE``'s
    ``gamma`` and ``lmbda``) is checkpointed with the trainer, as torchrl's hook does.

    On several ranks, an estimator that standardises its advantages (``GAE(average_gae=True)``,
    as torchrl's PPO and A2C trainers build it) does so with the mean and std of every rank's
    advantages (an all-reduce), as one process on the union of the ranks' batches would.

    Args:
        learner (Learner): the learner whose loss holds the critic the estimator reads.
        value_estimator (Callable[[TensorDictBase], TensorDictBase]): e.g. torchrl's ``GAE``.

    Keyword Args:
        stage (str): ``"batch_process"`` (default) computes advantages once per collected
            batch; ``"pre_epoch"`` recomputes them before every epoch, with the critic as it is then.

    Raises:
        ValueError: ``stage`` is neither of the two.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.objectives.value import GAE
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.onpolicy import LearnerValueEstimator
        >>> critic = TensorDictModule(torch.nn.Linear(3, 1), ["observation"], ["state_value"])
        >>> learner = LocalLearner(critic)
        >>> hook = LearnerValueEstimator(learner, GAE(gamma=0.99, lmbda=0.95, value_network=critic))
        >>> batch = TensorDict({"observation": torch.randn(5, 3), "next": {"observation": torch.randn(5, 3),
        ...     "reward": torch.ones(5, 1), "done": torch.zeros(5, 1, dtype=torch.bool),
        ...     "terminated": torch.zeros(5, 1, dtype=torch.bool)}}, [5])
        >>> hook(batch)["advantage"].shape
        torch.Size([5, 1])
        >>> sorted(hook.state_dict()["value_estimator"])
        ['gamma', 'lmbda']
    """

    earlier_state_keys = (frozenset(),)  # trainer checkpoints from before it kept the estimator's state

    def __init__(self, learner, value_estimator, *, stage: str = "batch_process") -> None:
        if stage not in ("batch_process", "pre_epoch"):
            raise ValueError(f"stage must be 'batch_process' or 'pre_epoch', got {stage!r}.")
        super().__init__(value_estimator)
        self.learner, self.stage = learner, stage

    def __call__(self, batch: TensorDictBase | None) -> TensorDictBase | None:
        if batch is None:
            return batch
        from fabric_learner.trainer.hooks import _full_parameters

        with _full_parameters(self.learner), torch.no_grad(), _global_standardisation(self.value_estimator):
            return super().__call__(batch)

    def register(self, trainer, name: str = "value_estimator") -> None:
        trainer.register_op(self.stage, self)
        trainer.register_module(name, self)


@contextlib.contextmanager
def _global_standardisation(estimator):
    """Inside the block, ``estimator``'s advantage standardisation uses statistics over all ranks."""
    if not getattr(estimator, "average_gae", False) or distributed_world_size() <= 1 \
            or not hasattr(estimator, "_normalize_advantage"):
        yield
        return
    if getattr(estimator, "group_key", None) is not None:
        raise NotImplementedError(
            f"{type(estimator).__name__}(average_gae=True, group_key=...) standardises within groups, which is not "
            "taken over ranks yet; build it with average_gae=False and normalise advantages with "
            "fabric_learner.onpolicy.GlobalAdvantageNormalization.")
    if type(estimator)._normalize_advantage is not GAE._normalize_advantage:
        raise NotImplementedError(
            f"{type(estimator).__name__} standardises its advantages in its own way, which is not taken over ranks; "
            "build it with average_gae=False and normalise with GlobalAdvantageNormalization.")

    def standardise(adv, valid=None, groups=None):
        # GAE._normalize_advantage's formulas (std clamped at 1e-4) over the union of the ranks' entries
        a = adv.detach().to(torch.float64)
        m = torch.ones_like(a) if valid is None else estimator._expand_to_match(valid, adv).to(torch.float64)
        total, sq, count = all_reduce(torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()])).unbind()
        mean = total / count.clamp_min(1)
        centred = (sq - count * mean * mean).clamp_min(0)
        std = (centred / ((count - 1).clamp_min(1) if valid is None else count.clamp_min(1))).sqrt()
        return (adv - mean.to(adv.dtype)) / std.to(adv.dtype).clamp_min(1e-4)

    estimator._normalize_advantage = standardise
    try:
        yield
    finally:
        del estimator._normalize_advantage


# ---- global means inside a loss -------------------------------------------------------------


class GlobalMeanLoss(nn.Module):
    """A torchrl loss whose ``"loss*"`` entries are means over the union of all ranks' data.

    Wrap a loss built with ``reduction="none"``: each loss entry holds one value per sample
    (after the loss's own masking, if it masks). This module returns, per entry,
    ``local_sum * world_size / global_count``: DDP and FSDP average gradients over ranks, so the
    gradient becomes ``sum over all ranks / global count``, the gradient of the global mean,
    however unevenly samples, valid mask entries or tokens are spread over ranks. With one
    process it is the plain mean.

    ``mask_key`` names a boolean entry of the batch to weigh samples by (for losses that do not
    mask themselves); entries must then have the batch's leading shape. Non-loss entries are
    reduced to their local mean for logging. The reported loss values are per-rank shares
    (their mean over ranks is the global mean). Build the learner on this wrapper; attributes
    not found on it are looked up on the wrapped loss.

    Args:
        loss_module (nn.Module): a torchrl loss built with ``reduction="none"``.

    Keyword Args:
        mask_key (NestedKey, optional): a boolean batch entry weighing the samples.
        group (str or ProcessGroup): the mesh dimension to reduce over (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Raises:
        ValueError: (on call) with ``mask_key``, a loss entry that does not keep the batch's
            leading shape.

    Examples:
        >>> import torch
        >>> from fabric_learner.onpolicy import GlobalMeanLoss
        >>> from fabric_learner.testing import dqn_example
        >>> dqn, _, batch = dqn_example(n=8, reduction="none")  # a loss per transition
        >>> batch["valid"] = torch.arange(8) < 6
        >>> loss = GlobalMeanLoss(dqn, mask_key="valid")
        >>> per_sample = loss.loss_module(batch)["loss"]
        >>> torch.allclose(loss(batch)["loss"], per_sample[:6].mean())
        True
    """

    def __init__(self, loss_module: nn.Module, *, mask_key: NestedKey | None = None, group: Any = DATA_PARALLEL) -> None:
        super().__init__()
        self.loss_module = loss_module
        self.mask_key = mask_key
        self.group = group

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_modules" not in self.__dict__ or "loss_module" not in self.__dict__["_modules"]:
                raise
            return getattr(self.__dict__["_modules"]["loss_module"], name)

    def forward(self, batch: TensorDictBase) -> TensorDictBase:
        out = self.loss_module(batch)
        mask = batch.get(self.mask_key) if self.mask_key is not None else None
        keys = loss_keys(out)
        sums, counts = [], []
        for key in keys:
            value = out.get(key)
            if mask is not None and value.ndim:
                m = _mask_like(mask, value, key)
                sums.append(torch.where(m, value, torch.zeros_like(value)).sum())
                counts.append(m.sum().to(torch.float64))
            else:
                sums.append(value.sum())
                counts.append(torch.tensor(float(value.numel()), dtype=torch.float64))
        world = distributed_world_size(self.group)
        total = all_reduce(torch.stack(counts), "sum", self.group) if counts else None
        result = out.empty()
        for i, key in enumerate(keys):
            denom = total[i].clamp_min(1).to(sums[i].dtype)
            result.set(key, sums[i] * world / denom)
        for key, value in out.items():
            if key in keys:
                continue
            if isinstance(value, torch.Tensor) and value.ndim and value.is_floating_point():
                value = value.detach().mean()
            result.set(key, value)
        return result


# ---- minibatch partitions -------------------------------------------------------------------


def partition_indices(n: int, minibatch_size: int, *, generator: torch.Generator | None = None,
                      num_minibatches: int | None = None) -> list[torch.Tensor]:
    """A random partition of ``range(n)`` into minibatches of ``minibatch_size`` (no replacement).

    The last ``n % minibatch_size`` indices of the permutation are dropped (every minibatch has
    the same size), or all beyond ``num_minibatches * minibatch_size`` when that is given.
    Draws one ``torch.randperm(n, generator=generator)``: the order
    :class:`EpochPartitionSampler` samples in with the same generator.

    Args:
        n (int): the number of samples.
        minibatch_size (int): samples per minibatch.

    Keyword Args:
        generator (torch.Generator, optional): the generator to draw from (default: torch's global one).
        num_minibatches (int, optional): take this many minibatches only.

    Returns:
        A list of index tensors, each of ``minibatch_size`` distinct indices, disjoint.

    Raises:
        ValueError: ``minibatch_size < 1``, or more minibatches asked than ``n`` samples make.

    Examples:
        >>> import torch
        >>> from fabric_learner.onpolicy import partition_indices
        >>> parts = partition_indices(10, 4, generator=torch.Generator().manual_seed(0))
        >>> [len(p) for p in parts], len(set(torch.cat(parts).tolist()))
        ([4, 4], 8)
    """
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}.")
    count = n // minibatch_size if num_minibatches is None else num_minibatches
    if count * minibatch_size > n:
        raise ValueError(f"{count} minibatches of {minibatch_size} need {count * minibatch_size} samples, have {n}.")
    perm = torch.randperm(n, generator=generator)
    return list(perm[: count * minibatch_size].split(minibatch_size))


class EpochPartitionSampler(TrainerHookBase):
    """Trainer hook: each epoch, minibatches that partition the rank's batch, the same count on every rank.

    The minibatches are torchrl's ``SamplerWithoutReplacement(drop_last=True)`` drawn over the
    flattened batch; what this adds is the agreement between ranks: every rank takes the
    smallest number of minibatches over ranks (one all-reduce per epoch; a rank with more data
    drops the extra samples of that epoch, with a warning), since a rank that stepped once more
    than another would hang the others. Each epoch starts from a fresh permutation.

    Registers at ``pre_epoch`` (:meth:`start_epoch`) and at ``process_optim_batch`` (returns
    the next minibatch, then raises ``StopIteration``, which ends torchrl's optimisation loop
    for the epoch). Use ``optim_steps_per_batch=None`` (or the number of minibatches) and
    ``num_epochs=`` for PPO epochs, and register it after the value estimator, so each epoch
    partitions the batch with fresh advantages.

    Args:
        minibatch_size (int): samples per minibatch.

    Keyword Args:
        seed (int, optional): seeds a generator with ``seed + rank`` (reproducible partitions,
            checkpointed with the sampler's state); without it the global torch RNG is used.
        group (str or ProcessGroup): the mesh dimension whose ranks agree (default ``"dp"``, the
            data-parallel ranks) or a process group.

    Raises:
        ValueError: ``minibatch_size`` is below 1.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fabric_learner.onpolicy import EpochPartitionSampler
        >>> sampler = EpochPartitionSampler(4, seed=0)
        >>> batch = TensorDict({"i": torch.arange(10)}, [10])
        >>> _ = sampler.start_epoch(batch)
        >>> [len(sampler(batch)) for _ in range(2)]
        [4, 4]
        >>> sampler(batch)
        Traceback (most recent call last):
        ...
        StopIteration
    """

    earlier_state_keys = (frozenset({"generator"}),)  # trainer checkpoints from before it used torchrl's sampler

    def __init__(self, minibatch_size: int, *, seed: int | None = None, group: Any = DATA_PARALLEL) -> None:
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}.")
        self.minibatch_size = minibatch_size
        self.group = group
        self.seed = seed
        self.generator: torch.Generator | None = None
        if seed is not None:
            rank = dist.get_rank(process_group(group)) if distributed_world_size(group) > 1 else 0
            self.generator = torch.Generator().manual_seed(seed + rank)
        self.sampler = self._new_sampler()
        self._fresh = True  # the sampler holds no permutation, or an untouched one
        self._flat: TensorDictBase | None = None
        self._storage: _Positions | None = None
        self._left = 0
        self._warned = False

    def _new_sampler(self) -> SamplerWithoutReplacement:
        sampler = SamplerWithoutReplacement(drop_last=True)
        sampler._rng = self.generator  # how torchrl's ReplayBuffer(generator=...) hands its sampler a generator
        return sampler

    def start_epoch(self, batch: TensorDictBase | None) -> TensorDictBase | None:
        """Agree on this epoch's number of minibatches over ranks and start a fresh permutation (a collective)."""
        if batch is None:
            return batch
        flat = batch.reshape(-1)
        local = flat.shape[0] // self.minibatch_size
        common = int(all_reduce(torch.tensor(local, dtype=torch.int64), "min", self.group))
        if common < local and not self._warned:
            warnings.warn(
                f"This rank has {local} minibatches of {self.minibatch_size} but another has {common}; every rank "
                f"takes {common} so that all step the same number of times.", stacklevel=2)
            self._warned = True
        if not self._fresh:  # the last epoch stopped before the permutation ran out
            self.sampler = self._new_sampler()
        self._flat = flat
        self._storage = _Positions(flat.shape[0])
        self._left = common
        return batch

    def __call__(self, batch: TensorDictBase | None) -> TensorDictBase:
        if self._left == 0:
            raise StopIteration
        index, _ = self.sampler.sample(self._storage, self.minibatch_size)
        self._left -= 1
        # drop_last: torchrl draws the next permutation as soon as fewer than a minibatch remain
        self._fresh = self.sampler.ran_out
        return self._flat[index]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state() if self.generator is not None else None,
                "sampler": dict(self.sampler.state_dict()), "fresh": self._fresh}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("generator")
        if state is not None and self.generator is not None:
            self.generator.set_state(state)
        self.sampler = self._new_sampler()
        if state_dict.get("sampler") is not None:
            self.sampler.load_state_dict(state_dict["sampler"])
        self._fresh = bool(state_dict.get("fresh", True))

    def register(self, trainer, name: str = "epoch_partition_sampler") -> None:
        trainer.register_op("pre_epoch", self.start_epoch)
        trainer.register_op("process_optim_batch", self)
        trainer.register_module(name, self)


class _Positions:
    """What torchrl's sampler reads of a storage: its length (one dimension, permuted on CPU).

    Building a ``TensorStorage`` over the batch each epoch cost about 3 ms; the sampler needs
    only the sample count, and the minibatch is indexed from the batch directly.
    """

    ndim = 1
    device = torch.device("cpu")

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n
