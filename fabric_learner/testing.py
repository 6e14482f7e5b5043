"""Ready-made pieces for examples and quick checks: a small torchrl loss and a batch it trains on.

The package's docstrings build their examples from these instead of each spelling out a batch,
and a script can use them the same way to try a learner before it has an environment. Every
builder is deterministic in ``seed`` and leaves the global random state alone.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torchrl.objectives import DQNLoss

__all__ = ["dqn_batch", "dqn_example"]


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
    generator = torch.Generator().manual_seed(seed)
    never = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict(
        observation=torch.randn(n, observation_size, generator=generator),
        action=torch.randint(num_actions, (n,), generator=generator),
        next=TensorDict(observation=torch.randn(n, observation_size, generator=generator),
                        reward=torch.randn(n, 1, generator=generator), done=never, terminated=never.clone(),
                        batch_size=[n]),
        batch_size=[n],
    )


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
