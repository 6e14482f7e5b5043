"""Ready-made pieces for examples and quick checks: small torchrl losses and batches they train on.

The package's docstrings build their examples from these instead of each spelling out a loss and
a batch, and a script can use them the same way to try a learner before it has an environment.
Every builder is deterministic in ``seed`` and leaves the global random state alone.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import MLP, ValueOperator
from torchrl.objectives import DDPGLoss, DQNLoss

__all__ = ["ddpg_example", "dqn_batch", "dqn_example"]


def _transitions(n: int, seed: int, observation_size: int, action) -> TensorDict:
    """``n`` transitions with random observations and rewards, no episode ending; ``action(generator)``."""
    generator = torch.Generator().manual_seed(seed)
    never = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict(
        observation=torch.randn(n, observation_size, generator=generator),
        action=action(generator),
        next=TensorDict(observation=torch.randn(n, observation_size, generator=generator),
                        reward=torch.randn(n, 1, generator=generator), done=never, terminated=never.clone(),
                        batch_size=[n]),
        batch_size=[n],
    )


def dqn_batch(n: int = 8, seed: int = 0, *, observation_size: int = 4, num_actions: int = 2) -> TensorDict:
    """``n`` random transitions in the layout torchrl's ``DQNLoss`` reads.

    Entries: ``observation``, ``action`` (an index below ``num_actions``) and, under ``next``,
    ``observation``, ``reward``, ``done`` and ``terminated`` (no episode ends). The same
    ``seed`` gives the same batch.

    Examples:
        >>> from fabric_learner.testing import dqn_batch
        >>> batch = dqn_batch(n=4)
        >>> batch.batch_size, batch["observation"].shape, batch["next", "reward"].shape
        (torch.Size([4]), torch.Size([4, 4]), torch.Size([4, 1]))
        >>> (batch == dqn_batch(n=4)).all()
        True
    """
    return _transitions(n, seed, observation_size, lambda g: torch.randint(num_actions, (n,), generator=g))


def dqn_example(n: int = 8, seed: int = 0, **loss_kwargs: Any) -> tuple[DQNLoss, nn.Linear, TensorDict]:
    """A DQN loss over a linear Q-network, that network, and a batch of ``n`` transitions for it.

    The loss is ``DQNLoss(nn.Linear(4, 2), action_space="categorical", delay_value=False)``
    (``loss_kwargs`` are passed on, e.g. ``reduction="none"``); the network is the policy a
    collector would run (give it as ``policy=``); the batch is :func:`dqn_batch`. The network's
    initial weights depend on ``seed`` only.

    Returns:
        ``(loss, net, batch)``.

    Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example(n=8)
        >>> learner = LocalLearner(loss, lambda params: torch.optim.Adam(params, lr=1e-3), policy=net)
        >>> sorted(learner.update(batch).keys())
        ['grad_norm', 'loss']
        >>> torch.equal(dqn_example()[1].weight, dqn_example()[1].weight)  # same seed, same network
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.Linear(4, 2)
    loss = DQNLoss(net, **{"action_space": "categorical", "delay_value": False, **loss_kwargs})
    return loss, net, dqn_batch(n, seed)


def ddpg_example(n: int = 8, seed: int = 0) -> tuple[DDPGLoss, TensorDictModule, TensorDict]:
    """A DDPG loss with linear networks shaped for ``Pendulum-v1``, its actor, and ``n`` transitions.

    The actor maps a 3-d ``observation`` to a 1-d ``action``; the critic reads both (through a
    one-layer torchrl ``MLP``). No target networks (``delay_actor=False, delay_value=False``). The
    actor is the policy a collector on Pendulum would run (give it as ``policy=``).

    Returns:
        ``(loss, actor, batch)``.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import ddpg_example
        >>> loss, actor, batch = ddpg_example()
        >>> out = LocalLearner(loss, policy=actor).update(batch)
        >>> sorted(key for key in out.keys() if key.startswith("loss"))
        ['loss_actor', 'loss_value']
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actor = TensorDictModule(nn.Linear(3, 1), ["observation"], ["action"])
        critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[]), in_keys=["observation", "action"])
    loss = DDPGLoss(actor, critic, delay_actor=False, delay_value=False)
    batch = _transitions(n, seed, 3, lambda g: torch.rand(n, 1, generator=g) * 4 - 2)  # Pendulum's torque: [-2, 2]
    return loss, actor, batch
