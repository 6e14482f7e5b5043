"""A checkpoint's optimizer state, paired with parameters by name, and checked before any load.

Optimizer state is keyed by index; a checkpoint records the loss-module name of every index
(per stage for a staged learner), so a learner whose optimizer lists the same parameters in
another order, or under another strategy, restores each moment onto the right tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fabric_learner.checkpoint.validate import check_optimizer_state, check_optimizer_structure, reindex_optimizer_state
from fabric_learner.optim import optimizer_params


def optimizer_param_names(named_parameters: Iterable[tuple[str, torch.Tensor]], optimizer: Any) -> list[str]:
    """Loss-module names of ``optimizer``'s parameters (all stages together), in index order."""
    names = {id(p): n for n, p in named_parameters}
    return [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(optimizer_params(optimizer))]


def saved_param_names(named_parameters: Iterable[tuple[str, torch.Tensor]], optimizer: Any,
                      staged: bool) -> list[str] | dict[str, list[str]]:
    """What a checkpoint records to pair moments with parameters: names per stage when ``staged``."""
    if not staged:
        return optimizer_param_names(named_parameters, optimizer)
    names = {id(p): n for n, p in named_parameters}
    return {stage: [names[id(p)] for p in optimizer_params(o)] for stage, o in optimizer.by_stage.items()}


def optimizer_state_for(checkpoint: Mapping[str, Any], optimizer: Any,
                        ours: list[str] | dict[str, list[str]]) -> Mapping[str, Any]:
    """``checkpoint``'s optimizer state re-indexed and checked for ``optimizer``, whose parameters
    ``ours`` names (``saved_param_names``); raises, naming the mismatch, before anything changes."""
    state, saved = checkpoint["optimizer"], checkpoint.get("param_names")
    if isinstance(ours, Mapping):
        return _stage_state(state, saved or {}, optimizer, ours)
    if isinstance(saved, Mapping):
        raise ValueError("The checkpoint was written by a learner with several optimizers (stages); this one "
                         "has one. Nothing was loaded: build the learner with the same stages.")
    if saved is not None:  # index-keyed file state: see reindex_optimizer_state
        state = reindex_optimizer_state(state, saved, ours, [len(g["params"]) for g in optimizer.param_groups])
    check_optimizer_state(state, optimizer)
    return state


def _stage_state(state: Any, saved: Any, optimizer: Any, ours: dict[str, list[str]]) -> dict[str, Any]:
    if not isinstance(state, Mapping) or not isinstance(state.get("stages"), Mapping) \
            or set(state["stages"]) != set(ours) or not isinstance(saved, Mapping):
        found = sorted(state["stages"]) if isinstance(state, Mapping) and isinstance(state.get("stages"), Mapping) \
            else "a single optimizer"
        raise ValueError(f"The checkpoint holds optimizer state for {found}; this learner has stages "
                         f"{sorted(ours)}. Nothing was loaded: load it into a learner built with the same stages.")
    out = {}
    for stage, one_optimizer in optimizer.by_stage.items():
        one, names = state["stages"][stage], saved.get(stage)
        if names is not None:
            check_optimizer_structure(one, len(names))
            one = reindex_optimizer_state(one, names, ours[stage], [len(g["params"]) for g in one_optimizer.param_groups])
        check_optimizer_state(one, one_optimizer)
        out[stage] = one
    return {"stages": out}
