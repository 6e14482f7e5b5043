"""Publishing a learner's weights to collectors: the rank's own collector, or remote ones.

Two cases, both written so that they stay correct once a sharded (FSDP) learner exists:

- :func:`publish_to_collector` / :class:`PublishWeights`: every rank's *own* collector acts
  with the new weights after each batch of updates. Under DDP (and with ``LocalLearner``) the
  collector usually runs the very policy module the loss trains, which shares the parameters'
  memory: nothing needs to move, and the call only checks that. When the collector holds its
  own copy (another device, a deep copy, or a sharded learner), every rank gathers the full
  weights with ``learner.get_weights(cpu_offload=False)`` (a collective under FSDP) and loads
  them into its collector.
- :func:`publish_from_rank0` / :class:`PublishFromRank0`: collectors living in other processes
  (a ``MultiSyncCollector``'s workers, Ray actors, ...), fed through a torchrl
  ``WeightSyncScheme``: every rank calls it (the gather is a collective under FSDP, with
  ``cpu_offload=True`` only rank 0 receives the weights), and only rank 0 sends.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.trainers import TrainerHookBase

__all__ = ["PublishFromRank0", "PublishWeights", "collector_policy", "publish_from_rank0", "publish_to_collector",
           "serve_collector_policy", "shares_policy_memory"]


def collector_policy(collector) -> nn.Module | None:
    """The module a (single-process) collector runs, the one whose weights must follow the learner.

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs import GymEnv
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import collector_policy
        >>> _, actor, _ = ddpg_example()
        >>> collector = Collector(GymEnv("Pendulum-v1"), actor, frames_per_batch=4, total_frames=8,
        ...                       auto_register_policy_transforms=False)
        >>> collector_policy(collector) is actor
        True
        >>> collector.shutdown()
    """
    for attr in ("_policy_w_state_dict", "policy", "_wrapped_policy"):
        module = getattr(collector, attr, None)
        if isinstance(module, nn.Module):
            return module
    return None


def shares_policy_memory(learner, collector) -> bool:
    """True when the collector's policy acts with the learner's newest weights with no copy.

    Unsharded: every parameter of the policy is a live parameter of the learner. Sharded: every
    parameter is one the learner serves (kept full and refreshed after each step, see
    ``FabricLearner.serve``).

    Examples:
        >>> import copy
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs import GymEnv
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import shares_policy_memory
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> same = Collector(GymEnv("Pendulum-v1"), actor, frames_per_batch=4, total_frames=8,
        ...                  auto_register_policy_transforms=False)
        >>> copied = Collector(GymEnv("Pendulum-v1"), copy.deepcopy(actor), frames_per_batch=4, total_frames=8,
        ...                    auto_register_policy_transforms=False)
        >>> shares_policy_memory(learner, same), shares_policy_memory(learner, copied)
        (True, False)
        >>> same.shutdown(); copied.shutdown()
    """
    from fabric_learner.remote.learner import RemoteLearner

    policy = collector_policy(collector)
    if policy is None or isinstance(learner, RemoteLearner):  # trained elsewhere: this process holds copies
        return False
    theirs = [p for p in policy.parameters() if p.numel()]
    if not theirs:
        return False
    if learner.capabilities.sharded:
        served = learner._backend.served_parameters()
        return all(id(p) in served for p in theirs)
    ours = {p.untyped_storage().data_ptr() for p in learner.loss_module.parameters() if p.numel()}
    ours |= {b.untyped_storage().data_ptr() for b in learner.loss_module.buffers() if b.numel()}
    return all(p.untyped_storage().data_ptr() in ours for p in theirs)


def serve_collector_policy(learner, collector) -> None:
    """Keep the policy the collector runs full and current when the loss trains it (every rank calls it).

    Under FSDP this is what lets a collector run the very module the loss trains, as under DDP
    (a collective: the policy's weights are gathered at once).

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs import GymEnv
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import serve_collector_policy, shares_policy_memory
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> collector = Collector(GymEnv("Pendulum-v1"), actor, frames_per_batch=4, total_frames=8,
        ...                       auto_register_policy_transforms=False)
        >>> serve_collector_policy(learner, collector)  # one process: the actor already holds the weights
        >>> shares_policy_memory(learner, collector)
        True
        >>> collector.shutdown()

        With ``FabricLearner(..., strategy="fsdp", devices=2)`` each rank calls it with its own collector;
        without it the actor would hold no weights outside ``update``.
    """
    policy = collector_policy(collector) if collector is not None else None
    if policy is not None:
        learner.serve(policy)


def publish_to_collector(learner, collector) -> bool:
    """Make ``collector`` act with the learner's current weights. Call it on every rank.

    Returns ``True`` when weights were copied, ``False`` when the collector already shares the
    learner's parameter memory (nothing to do). For a copy the learner must have been built with
    ``policy=`` (so ``get_weights`` has the policy's layout). Under a sharded learner this is a
    collective (every rank gathers the full weights into its own collector's copy).

    Args:
        learner (Learner): the learner whose weights the collector must act with.
        collector: a single-process torchrl collector (this rank's own).

    Returns:
        Whether weights were copied.

    Raises:
        ValueError: the collector runs a copy and the learner was built without ``policy=``.

    Examples:
        >>> import copy, torch
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs import GymEnv
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import collector_policy, publish_to_collector
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> collector = Collector(GymEnv("Pendulum-v1"), copy.deepcopy(actor), frames_per_batch=4, total_frames=8,
        ...                       auto_register_policy_transforms=False)
        >>> with torch.no_grad():
        ...     _ = actor.module.weight.add_(1.0)  # as an update would
        >>> publish_to_collector(learner, collector)
        True
        >>> torch.equal(collector_policy(collector).module.weight, actor.module.weight)
        True
        >>> collector.shutdown()
    """
    if shares_policy_memory(learner, collector):
        return False
    if learner.policy is None:
        raise ValueError(
            "The collector runs its own copy of the policy, so the learner must publish weights into it, "
            "but the learner was built without policy=: its get_weights() has the loss module's layout, "
            "not the policy's. Build the learner with policy=<the policy module the loss trains>."
        )
    # Under a sharded learner this is the collective that gives every rank the full tensors, laid
    # out as the learner's policy, i.e. as the collector's unsharded copy of it.
    weights = learner.get_weights(cpu_offload=False)
    policy = collector_policy(collector)
    weights = _to_policy_device(weights, policy)
    collector.update_policy_weights_(weights)
    return True


def _to_policy_device(weights: TensorDictBase, policy: nn.Module | None) -> TensorDictBase:
    if policy is None:
        return weights
    param = next(iter(policy.parameters()), None)
    if param is None or weights.device == param.device:
        return weights
    return weights.to(param.device)


class PublishWeights(TrainerHookBase):
    """Trainer hook: after each collected batch's updates, the rank's collector gets the weights.

    Registered at ``post_steps`` (like torchrl's ``UpdateWeights``) every ``interval`` batches;
    a no-op when the collector shares the learner's parameter memory. ``fabric_learner.Trainer``
    registers one by default (``publish_weights=True``). Its counter is checkpointed.

    Args:
        learner (Learner): the learner to publish from.
        collector: this rank's collector.
        interval (int): publish every ``interval`` calls (default 1).

    Raises:
        ValueError: ``interval < 1``.

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from torchrl.envs import GymEnv
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import PublishWeights
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> collector = Collector(GymEnv("Pendulum-v1"), actor, frames_per_batch=4, total_frames=8,
        ...                       auto_register_policy_transforms=False)
        >>> hook = PublishWeights(learner, collector)
        >>> hook()  # the collector runs the trained module itself: nothing to copy
        >>> hook.counter, hook.copies
        (1, 0)
        >>> collector.shutdown()
    """

    def __init__(self, learner, collector, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}.")
        self.learner, self.collector, self.interval = learner, collector, interval
        self.counter = 0
        self.copies = 0

    def __call__(self) -> None:
        self.counter += 1
        if self.counter % self.interval:
            return
        if publish_to_collector(self.learner, self.collector):
            self.copies += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counter = int(state_dict.get("counter", 0))

    def register(self, trainer, name: str = "publish_weights") -> None:
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)


def _send(target: Any, weights: TensorDictBase) -> None:
    if hasattr(target, "update_policy_weights_"):  # a collector whose workers live elsewhere
        target.update_policy_weights_(weights)
    elif hasattr(target, "send"):  # a WeightSyncScheme initialised on the sender side
        target.send(weights)
    elif hasattr(target, "update_weights"):  # a scheme's sender object
        target.update_weights(weights)
    elif callable(target):
        target(weights)
    else:
        raise TypeError(
            f"Cannot publish weights to a {type(target).__name__}: expected a collector "
            "(update_policy_weights_), a WeightSyncScheme (send), a sender (update_weights) or a callable."
        )


def publish_from_rank0(learner, target: Any) -> TensorDictBase | None:
    """Publish the learner's weights to remote collectors from rank 0 only. Call on every rank.

    ``target`` is a torchrl ``WeightSyncScheme`` initialised on the sender side (``send``), its
    sender (``update_weights``), a collector whose workers are other processes
    (``update_policy_weights_``), or any callable taking the weights. The gather goes through
    ``learner.get_weights(cpu_offload=True)``: under a sharded learner every rank must take
    part and only rank 0 receives the full weights; unsharded learners gather on rank 0 only.

    Args:
        learner (Learner): the learner to publish from.
        target: where rank 0 sends the weights (see above).

    Returns:
        The weights sent (rank 0) or ``None`` (other ranks).

    Raises:
        TypeError: ``target`` is none of the above.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import publish_from_rank0
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> received = []
        >>> sent = publish_from_rank0(learner, received.append)
        >>> received[0] is sent, sorted(sent.keys())
        (True, ['module'])
    """
    if learner.capabilities.sharded:
        weights = learner.get_weights(cpu_offload=True)  # collective: full on rank 0, empty elsewhere
    elif learner.global_rank == 0:
        weights = learner.get_weights(cpu_offload=True)
    else:
        weights = None
    if learner.global_rank != 0:
        return None
    _send(target, weights)
    return weights


class PublishFromRank0(TrainerHookBase):
    """Trainer hook: :func:`publish_from_rank0` every ``interval`` collected batches (``post_steps``).

    With ``lazy=True``, ``target`` is a zero-argument callable returning the scheme/collector
    (resolved on each call, so it can be built lazily on rank 0 only); on other ranks it is
    never called. Its counter is checkpointed.

    Args:
        learner (Learner): the learner to publish from.
        target: as :func:`publish_from_rank0`'s, or a factory of it with ``lazy=True``.
        interval (int): publish every ``interval`` calls (default 1).

    Keyword Args:
        lazy (bool): ``target`` is a factory.

    Raises:
        ValueError: ``interval < 1``.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> from fabric_learner.weights import PublishFromRank0
        >>> loss, actor, _ = ddpg_example()  # DDPG on linear networks shaped for Pendulum-v1
        >>> learner = LocalLearner(loss, policy=actor)
        >>> received = []
        >>> hook = PublishFromRank0(learner, received.append, interval=2)
        >>> hook(); hook(); hook()
        >>> hook.sent, len(received)
        (1, 1)
    """

    def __init__(self, learner, target: Any, interval: int = 1, *, lazy: bool = False) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}.")
        self.learner, self.target, self.interval, self.lazy = learner, target, interval, lazy
        self.counter = 0
        self.sent = 0

    def __call__(self) -> None:
        self.counter += 1
        if self.counter % self.interval:
            return
        target = self.target() if (self.lazy and self.learner.global_rank == 0) else self.target
        if publish_from_rank0(self.learner, target) is not None:
            self.sent += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counter = int(state_dict.get("counter", 0))

    def register(self, trainer, name: str = "publish_from_rank0") -> None:
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)
