"""Frozen parameters are not the learner's state: checkpoints leave them out.

A parameter with ``requires_grad=False`` (a LoRA model's base weights, a frozen reference model)
never changes while the learner trains, so writing it into every checkpoint would only copy the
base model again. Checkpoints hold the trained parameters, the buffers and the optimizer state;
loading one into a learner built over the same base restores it exactly. A checkpoint that does
hold frozen entries (written before they were frozen) still loads, and they are restored too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def frozen_keys(module: nn.Module) -> frozenset[str]:
    """The ``state_dict`` keys of ``module``'s parameters that do not require a gradient."""
    return frozenset(k for k, v in module.state_dict(keep_vars=True).items()
                     if isinstance(v, nn.Parameter) and not v.requires_grad)


def without_frozen(state: Mapping[str, Any], frozen: frozenset[str]) -> Mapping[str, Any]:
    """``state`` without the ``frozen`` keys (the same object when there are none)."""
    if not frozen or not any(k in frozen for k in state):
        return state
    kept = type(state)() if isinstance(state, dict) else {}
    kept.update((k, v) for k, v in state.items() if k not in frozen)
    if hasattr(state, "_metadata"):  # nn.Module state dicts carry version metadata
        kept._metadata = state._metadata
    return kept
