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


def check_model_state(state: Mapping[str, Any], shapes: Mapping[str, tuple], optional: frozenset[str] = frozenset()) -> None:
    """Raise before loading if ``state`` does not have exactly the keys and shapes expected.

    Keys in ``optional`` (frozen parameters, which checkpoints leave out) may be absent.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint['model'] must be a state dict, got {type(state).__name__}.")
    missing = [k for k in shapes if k not in state and k not in optional]
    unexpected = [k for k in state if k not in shapes]
    wrong = [
        f"{k}: {tuple(getattr(state[k], 'shape', ()))} vs {shape}"
        for k, shape in shapes.items()
        if k in state and (not isinstance(state[k], torch.Tensor) or tuple(state[k].shape) != tuple(shape))
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            "The checkpoint's model state does not match this loss module; nothing was loaded. "
            f"Missing keys: {missing[:8]}; unexpected keys: {unexpected[:8]}; shape mismatches: {wrong[:8]}. "
            "Load it into a loss module built the same way as the one that was saved."
        )


def check_optimizer_structure(state: Any, num_params: int) -> None:
    """Raise unless ``state`` is shaped like a torch optimizer state dict over ``num_params`` parameters."""
    if not isinstance(state, Mapping) or not isinstance(state.get("state"), Mapping) \
            or not isinstance(state.get("param_groups"), (list, tuple)):
        raise ValueError("checkpoint['optimizer'] is not an optimizer state dict (needs 'state' and 'param_groups'); "
                         "nothing was loaded.")
    indices = []
    for group in state["param_groups"]:
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)) or not all(_is_index(i, num_params) for i in params):
            raise ValueError(f"checkpoint['optimizer']['param_groups'] has a group whose 'params' are not indices "
                             f"below {num_params}; nothing was loaded.")
        indices.extend(params)
    if len(set(indices)) != len(indices):
        raise ValueError("checkpoint['optimizer']['param_groups'] lists a parameter twice; nothing was loaded.")
    for index, fields in state["state"].items():
        if not _is_index(index, num_params) or index not in indices:
            raise ValueError(f"checkpoint['optimizer']['state'] holds state for parameter {index!r}, which none of "
                             f"its param groups lists (indices below {num_params}); nothing was loaded.")
        if not isinstance(fields, Mapping) or not all(
                isinstance(f, str) and (v is None or isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool))
                for f, v in fields.items()):
            raise ValueError(f"checkpoint['optimizer']['state'][{index!r}] is not a mapping of state names to "
                             "tensors or numbers; nothing was loaded.")


def check_optimizer_state(state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Raise before loading if ``state`` cannot be an optimizer state for ``optimizer``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    check_optimizer_structure(state, len(params))
    groups = state["param_groups"]
    ours = optimizer.param_groups
    sizes = [len(g["params"]) for g in groups]
    our_sizes = [len(g["params"]) for g in ours]
    if sizes != our_sizes:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {sizes}, this learner's optimizer "
            f"{our_sizes}; nothing was loaded. Build the optimizer over the same parameters as when saving."
        )
    wrong = [f"state[{i}][{f!r}]: {tuple(v.shape)} vs {tuple(params[int(i)].shape)}"
             for i, fields in state["state"].items() for f, v in fields.items()
             if f in _PER_ELEMENT and isinstance(v, torch.Tensor) and v.numel() != params[int(i)].numel()]
    if wrong:
        raise ValueError(f"checkpoint['optimizer'] holds state of other shapes than the parameters ({wrong[:4]}); "
                         "nothing was loaded. Load it into a learner built the same way as the one that saved it.")


# torch optimizers' state fields that hold one value per parameter element
_PER_ELEMENT = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "acc_delta",
                "sum", "exp_inf", "prev", "step_size", "ax"}


def _is_index(value: Any, bound: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound


def reindex_optimizer_state(state: Any, saved_names: list[str], names: list[str],
                            group_sizes: list[int] | None = None) -> Any:
    """``state`` (a torch optimizer state dict whose indices follow ``saved_names``) re-indexed
    for an optimizer whose parameters, in state-dict order, are ``names``.

    torch pairs saved and live parameters by position, so moments are moved to the live index
    of the parameter with the same name, and each live group takes the hyper-parameters of the
    saved group holding the same parameters.
    """
    # Hand-written, not DCP's set_optimizer_state_dict: single files (fabric_learner/1) store torch's
    # index-keyed state plus these names, and the index->name step is needed for them either way.
    if not isinstance(state, Mapping) or "param_groups" not in state or list(saved_names) == list(names):
        return state
    if sorted(saved_names) != sorted(names):
        raise ValueError(
            "The checkpoint's optimizer trains other parameters than this learner's; nothing was loaded. "
            f"Only in the checkpoint: {sorted(set(saved_names) - set(names))[:8]}; only here: "
            f"{sorted(set(names) - set(saved_names))[:8]}."
        )
    new_index = {name: i for i, name in enumerate(names)}
    moments = {new_index[saved_names[int(i)]]: v for i, v in state["state"].items()}
    sizes = group_sizes or [len(names)]
    groups, start = [], 0
    for size in sizes:
        members = set(names[start:start + size])
        saved = [g for g in state["param_groups"] if {saved_names[i] for i in g["params"]} == members]
        if not saved:
            raise ValueError("The checkpoint's optimizer groups its parameters differently from this learner's; "
                             "nothing was loaded. Build the optimizer with the same param groups.")
        groups.append(dict(saved[0], params=list(range(start, start + size))))
        start += size
    return {"state": moments, "param_groups": groups}


def check_checkpoint(checkpoint: Mapping[str, Any], model_shapes: Mapping[str, tuple],
                     optional: frozenset[str] = frozenset()) -> None:
    """The structure and model part of a learner checkpoint (the optimizer is checked apart);
    ``optional``: model keys that may be absent (frozen parameters)."""
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"A learner checkpoint is a dict, got {type(checkpoint).__name__}.")
    missing = [k for k in ("model", "optimizer") if k not in checkpoint]
    if missing:
        raise ValueError(
            f"Not a learner checkpoint: missing {missing} (has {sorted(map(str, checkpoint))}). "
            "Pass what Learner.checkpoint() returned or what Learner.save() wrote."
        )
    for key in ("num_updates", "accum_step"):
        value = checkpoint.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"checkpoint[{key!r}] is {value!r}, expected a non-negative integer; nothing was loaded.")
    names = checkpoint.get("param_names")
    if isinstance(names, Mapping):  # several optimizers: checked per stage by the learner
        names = None
    if names is not None and (not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names)
                              or len(set(names)) != len(names)):
        raise ValueError("checkpoint['param_names'] is not a list of distinct parameter names; nothing was loaded.")
    if names is not None:
        check_optimizer_structure(checkpoint["optimizer"], len(names))
    check_model_state(checkpoint["model"], model_shapes, optional)
