"""Small pieces of the step that the single-optimizer and the staged step share."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase


def check_batch(batch: Any) -> int:
    """The number of samples in ``batch``; raises when it is not a TensorDict or holds nothing."""
    plain = type(batch) is TensorDict
    if not plain and not isinstance(batch, TensorDictBase):
        raise TypeError(f"update() takes a TensorDict batch, got {type(batch).__name__}.")
    samples = batch.batch_size.numel()
    if samples:
        if plain:  # a first entry that is a tensor answers is_empty() without its nested walk
            for value in batch._tensordict.values():
                if type(value) is torch.Tensor:
                    return samples
                break
        if not batch.is_empty():
            return samples
    raise ValueError(
        f"update() got an empty batch (batch_size {tuple(batch.batch_size)}, keys "
        f"{sorted(map(str, batch.keys()))}); a loss over no samples has nothing to learn from. "
        "Skip empty batches before calling update()."
    )


def backward_seed(loss: torch.Tensor) -> torch.Tensor:
    """The gradient to start ``loss``'s backward from: 1, or NaN when ``loss`` is non-finite.

    The NaN makes a non-finite loss poison the gradients it reaches, which ``Learner._refuse_step`` relies
    on; 1 and NaN are exact in every dtype. No host sync.
    """
    return (loss.detach() * 0).add_(1.0)  # 0 * x is NaN exactly when x is non-finite


def reported_norm(grad_norm: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """The norm as ``update`` reports it: a detached scalar on the output's device (usually as it is)."""
    if grad_norm.requires_grad or grad_norm.dim() != 0:
        grad_norm = grad_norm.detach().reshape(())
    return grad_norm if device is None or grad_norm.device == device else grad_norm.to(device)
