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

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

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
