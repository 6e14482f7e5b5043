"""Reading a torchrl loss output: which entries are losses, and their sum."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass


def loss_keys(output: TensorDictBase) -> list[str]:
    """Top-level keys starting with ``"loss"``.

    The prefix is ``"loss"``, not ``"loss_"``: DQN, GAIL and OnlineDT emit a bare ``"loss"``.
    """
    return [k for k in output.keys() if isinstance(k, str) and k.startswith("loss")]


def as_tensordict(output) -> TensorDictBase:
    """``output`` as a TensorDict: a TensorClass (torchrl's LLM losses return ``GRPOLossOutput``) gives its own.

    The TensorClass's TensorDict shares its tensors; fields left ``None`` are absent from it.
    """
    inner = getattr(output, "_tensordict", None)
    return inner if is_tensorclass(output) and isinstance(inner, TensorDictBase) else output


def total_loss(output: TensorDictBase) -> torch.Tensor:
    """Sum of the loss entries of ``output``, checked to be a scalar.

    Raises ``ValueError`` (before anything is differentiated) when there is no loss entry
    or when the sum is not a scalar, which is what ``reduction="none"`` produces.
    """
    if type(output) is not TensorDict and not isinstance(output, TensorDictBase):  # an ABC check costs ~1 us
        raise TypeError(
            f"The loss module returned {type(output).__name__}; a torchrl LossModule must return a "
            "TensorDict whose 'loss'-prefixed entries are summed."
        )
    keys = [k for k in output.keys() if isinstance(k, str) and k.startswith("loss")]  # loss_keys, inlined
    if not keys:
        raise ValueError(
            "The loss module's output has no 'loss'-prefixed entry to optimise; it holds "
            f"{sorted(map(str, output.keys(include_nested=True)))}. Return the objective under a key "
            "that starts with 'loss' (e.g. 'loss' or 'loss_actor')."
        )
    total = output.get(keys[0])
    for key in keys[1:]:
        total = total + output.get(key)
    if total.numel() != 1:
        shapes = {k: tuple(output.get(k).shape) for k in keys}
        raise ValueError(
            f"The summed loss over {keys} has shape {tuple(total.shape)} (entry shapes {shapes}), "
            "but a scalar is needed to backpropagate. Build the loss with reduction='mean' or "
            "reduction='sum' instead of reduction='none'."
        )
    return total if total.dim() == 0 else total.reshape(())


def detached(output: TensorDictBase) -> TensorDictBase:
    """``output.detach()``: the same keys, batch size, device and values, none requiring grad.

    A plain, unlocked, unnamed ``TensorDict`` of tensors (what torchrl losses return) is rebuilt
    directly, about 4x cheaper than ``detach()``'s generic apply, keeping the plain tensors that
    already require no grad as they are; anything else goes through ``detach()``.
    """
    entries = getattr(output, "_tensordict", None) if type(output) is TensorDict else None
    if entries is None or output.is_locked or getattr(output, "_td_dim_names", 0) is not None:
        return output.detach()
    values = {}
    for key, value in entries.items():
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
            return output.detach()
        # a plain tensor that needs no grad (most metrics) is kept as it is; a Parameter becomes a tensor
        values[key] = value if type(value) is torch.Tensor and not value.requires_grad else value.detach()
    return TensorDict._new_unsafe(values, batch_size=output.batch_size, device=output.device)


def set_entry(result: TensorDictBase, key: str, value: torch.Tensor) -> None:
    """``result.set(key, value)``; on an unlocked, batch-less plain ``TensorDict`` on ``value``'s device (or
    none), where ``set`` has nothing to check or move, without its validation (~7 us of an update)."""
    if type(result) is TensorDict and not result.batch_size and not result.is_locked \
            and (result.device is None or result.device == value.device):
        result._set_str(key, value, inplace=False, validated=True)
    else:
        result.set(key, value)
