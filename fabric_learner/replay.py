"""Prioritized replay: torchrl's own sampler where its C++ extension loads, a plain-torch one where not.

torchrl's ``PrioritizedSampler`` (and ``TensorDictPrioritizedReplayBuffer``, built on it) keeps
its priorities in sum/min segment trees from the compiled ``torchrl._torchrl`` extension. The
extension is in torchrl's wheel, but it only loads with the torch release it was built against:
torchrl 0.14.1's fails on torch 2.13.0 (``undefined symbol``), and constructing the sampler then
raises ``RuntimeError: SumSegmentTreeFp32 is not available``. :func:`prioritized_sampler` returns
torchrl's sampler whenever the extension loads, else :class:`TorchPrioritizedSampler`, the
same sampler (same priorities, importance weights, ``alpha``/``beta``/``eps`` and max-priority
rules: it *is* a ``PrioritizedSampler`` subclass) with the trees replaced by flat tensors:
sampling is a cumulative sum and a ``searchsorted``, O(capacity) per sample instead of
O(log capacity), which is negligible for buffers up to a few hundred thousand entries on CPU.
Its ``state_dict`` holds plain tensors, so replay-buffer checkpoints load with
``weights_only=True``.

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000),
                                sampler=prioritized_sampler(100_000, alpha=0.6, beta=0.4),
                                priority_key="td_error", batch_size=256)

``ReplayBufferTrainer`` then updates priorities from the loss's ``td_error`` as usual.
"""

from __future__ import annotations

import functools
from copy import deepcopy
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler

__all__ = ["TorchPrioritizedSampler", "prioritized_sampler", "torchrl_extension_error"]


@functools.cache
def torchrl_extension_error() -> str | None:
    """Why torchrl's compiled extension does not load in this install, or ``None`` when it does (tried once).

    Examples:
        >>> from fabric_learner.replay import prioritized_sampler, torchrl_extension_error
        >>> error = torchrl_extension_error()  # e.g. "...undefined symbol..." on a torch torchrl was not built for
        >>> type(prioritized_sampler(8, alpha=0.6, beta=0.4)).__name__ == (
        ...     "PrioritizedSampler" if error is None else "TorchPrioritizedSampler")
        True
    """
    try:
        import torchrl._torchrl  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def prioritized_sampler(max_capacity: int, alpha: float, beta: float, **kwargs) -> PrioritizedSampler:
    """torchrl's ``PrioritizedSampler`` when its extension loads, else :class:`TorchPrioritizedSampler`.

    Both take the same arguments and sample alike (same priorities, importance weights and
    max-priority rule), so a script runs unchanged on either install.

    Args:
        max_capacity: the replay buffer's capacity.
        alpha: priority exponent.
        beta: importance-sampling exponent.
        **kwargs: ``eps``, ``dtype``, ``reduction``, ``max_priority_within_buffer``, ``device``.

    Returns:
        A ``PrioritizedSampler`` (torchrl's class, or this module's subclass of it).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer
        >>> from fabric_learner.replay import prioritized_sampler
        >>> sampler = prioritized_sampler(8, alpha=1.0, beta=1.0)
        >>> isinstance(sampler, PrioritizedSampler)
        True
        >>> buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler, batch_size=4)
        >>> _ = buffer.extend(TensorDict(x=torch.arange(8), batch_size=[8]))
        >>> buffer.update_priority(torch.arange(8), torch.tensor([0.0] * 7 + [1.0]))
        >>> buffer.sample()["x"]  # only the sample with a priority is drawn
        tensor([7, 7, 7, 7])
    """
    if torchrl_extension_error() is None:
        return PrioritizedSampler(max_capacity, alpha, beta, **kwargs)
    return TorchPrioritizedSampler(max_capacity, alpha, beta, **kwargs)


class _FlatTree:
    """The subset of torchrl's segment-tree interface that ``PrioritizedSampler`` uses."""

    def __init__(self, capacity: int, dtype: torch.dtype, neutral: float) -> None:
        self.values = torch.full((capacity,), neutral, dtype=dtype)
        self.neutral = neutral

    def __getitem__(self, index):
        return self.values[torch.as_tensor(index, dtype=torch.long)]

    def __setitem__(self, index, value) -> None:
        index = torch.as_tensor(index, dtype=torch.long)
        self.values[index] = torch.as_tensor(value, dtype=self.values.dtype)

    def __len__(self) -> int:
        return self.values.numel()


class _SumTree(_FlatTree):
    def __init__(self, capacity: int, dtype: torch.dtype) -> None:
        super().__init__(capacity, dtype, 0.0)

    def query(self, left, right) -> float:
        return float(self.values[int(left):int(right)].double().sum())

    def scan_lower_bound(self, mass) -> torch.Tensor:
        """For each ``mass``, the first index whose inclusive prefix sum exceeds it."""
        if isinstance(mass, np.ndarray):
            mass = torch.from_numpy(mass)
        mass = torch.as_tensor(mass, dtype=torch.float64)
        prefix = self.values.double().cumsum(0)
        return torch.searchsorted(prefix, mass, right=True).clamp_max(self.values.numel() - 1)


class _MinTree(_FlatTree):
    def __init__(self, capacity: int, dtype: torch.dtype) -> None:
        super().__init__(capacity, dtype, float("inf"))

    def query(self, left, right) -> float:
        part = self.values[int(left):int(right)]
        return float(part.min()) if part.numel() else float("inf")


class TorchPrioritizedSampler(PrioritizedSampler):
    """``PrioritizedSampler`` with pure-torch priority storage (no C++ extension needed).

    Same arguments and sampling as :class:`torchrl.data.PrioritizedSampler` (its state dict
    too, so checkpoints move between the two); priorities are kept on CPU. Use it through
    :func:`prioritized_sampler`, which prefers torchrl's where its extension loads.

    Raises:
        ValueError: ``alpha`` or ``beta`` negative, or a ``device`` other than CPU.
        NotImplementedError: a ``dtype`` other than float32 or float64.

    Examples:
        >>> from fabric_learner import TorchPrioritizedSampler
        >>> sampler = TorchPrioritizedSampler(1000, alpha=0.6, beta=0.4)
        >>> sampler.alpha, sampler.beta
        (0.6, 0.4)
    """

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max",
                 max_priority_within_buffer: bool = False, device: torch.device | str | None = None) -> None:
        # PrioritizedSampler.__init__ without its "C++ extension missing" warning, which does not apply.
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        self._max_capacity = max_capacity
        self._alpha = alpha
        self._beta = beta
        self._eps = eps
        self.reduction = reduction
        self.dtype = dtype
        self._max_priority_within_buffer = max_priority_within_buffer
        self._device = torch.device(device) if device is not None else None
        self._init()

    def _init(self) -> None:
        if self._device is not None and self._device.type != "cpu":
            raise ValueError("TorchPrioritizedSampler keeps its priorities on CPU; pass device=None or 'cpu'.")
        if self.dtype in (torch.float, torch.float32):
            dtype = torch.float32
        elif self.dtype in (torch.double, torch.float64):
            dtype = torch.float64
        else:
            raise NotImplementedError(f"dtype {self.dtype} not supported by TorchPrioritizedSampler")
        self._sum_tree = _SumTree(self._max_capacity, dtype)
        self._min_tree = _MinTree(self._max_capacity, dtype)
        self._max_priority = None

    def _tree_device_from_storage(self, storage):
        return None  # priorities stay on CPU whatever the storage device

    def state_dict(self) -> dict[str, Any]:
        max_p, max_i = self._max_priority
        return {
            "_schema_version": self._STATE_SCHEMA_VERSION,
            "_alpha": self._alpha,
            "_beta": self._beta,
            "_eps": self._eps,
            "_max_priority": (_plain(max_p), _plain(max_i)),
            "_sum_tree": self._sum_tree.values.clone(),
            "_min_tree": self._min_tree.values.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._alpha = state_dict["_alpha"]
        self._beta = state_dict["_beta"]
        self._eps = state_dict["_eps"]
        max_p, max_i = state_dict["_max_priority"]
        self._max_priority = None if max_p is None else (deepcopy(max_p), deepcopy(max_i))
        for tree, key in ((self._sum_tree, "_sum_tree"), (self._min_tree, "_min_tree")):
            values = state_dict[key]
            if isinstance(values, _FlatTree):
                values = values.values
            tree.values = torch.as_tensor(values).clone().to(tree.values.dtype)


def _plain(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x
