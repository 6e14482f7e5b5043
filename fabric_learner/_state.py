"""Cloning and validating learner state, so restores are all-or-nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def clone_state(value: Any) -> Any:
    """A deep copy of a state structure in which every tensor is a fresh clone."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        out = type(value)()
        out.update((k, clone_state(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # nn.Module state dicts carry version metadata
            out._metadata = value._metadata
        return out
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_state(v) for v in value)
    return value


def check_model_state(state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise before loading if ``state`` does not have exactly the keys and shapes expected."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint['model'] must be a state dict, got {type(state).__name__}.")
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and isinstance(v, torch.Tensor)
        and (not isinstance(state[k], torch.Tensor) or tuple(state[k].shape) != tuple(v.shape))
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            "The checkpoint's model state does not match this loss module; nothing was loaded. "
            f"Missing keys: {missing[:8]}; unexpected keys: {unexpected[:8]}; shape mismatches: {wrong[:8]}. "
            "Load it into a loss module built the same way as the one that was saved."
        )


def check_optimizer_state(state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Raise before loading if ``state`` cannot be an optimizer state for ``optimizer``."""
    if not isinstance(state, Mapping) or "param_groups" not in state or "state" not in state:
        raise ValueError("checkpoint['optimizer'] is not an optimizer state dict (needs 'state' and 'param_groups').")
    groups = state["param_groups"]
    ours = optimizer.param_groups
    sizes = [len(g["params"]) for g in groups]
    our_sizes = [len(g["params"]) for g in ours]
    if sizes != our_sizes:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {sizes}, this learner's optimizer "
            f"{our_sizes}; nothing was loaded. Build the optimizer over the same parameters as when saving."
        )


def check_checkpoint(checkpoint: Mapping[str, Any], model_state: Mapping[str, Any], optimizer) -> None:
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"A learner checkpoint is a dict, got {type(checkpoint).__name__}.")
    missing = [k for k in ("model", "optimizer") if k not in checkpoint]
    if missing:
        raise ValueError(
            f"Not a learner checkpoint: missing {missing} (has {sorted(map(str, checkpoint))}). "
            "Pass what Learner.checkpoint() returned or what Learner.save() wrote."
        )
    check_model_state(checkpoint["model"], model_state)
    check_optimizer_state(checkpoint["optimizer"], optimizer)
