"""Names and shapes between torch's distributed state-dict API and the loss's own.

torch's API keys a ``ShardedLoss``'s tensors by its FQNs (``layers.<path>.<flat name>``, scalars
stored as ``(1,)``); the learner's checkpoints and weights use the loss's own names and shapes, so
one checkpoint loads under FSDP, DDP and in one process. Every function that reads or writes the
sharded tensors here is a collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fabric_learner.checkpoint.dcp_folder import as_param_shape
from fabric_learner.sharding import ShardedLoss

_FULL = StateDictOptions(full_state_dict=True)


def full_weights(owner: ShardedLoss, cpu_offload: bool) -> dict[str, torch.Tensor]:
    """Full tensors by loss name (on rank 0 only when ``cpu_offload``; empty elsewhere)."""
    state = get_model_state_dict(owner, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    if not state:
        return {}
    return {n: state[owner.fqn(n)].detach().reshape(owner.shapes[n]).clone() for n in owner.names}


def policy_weights(owner: ShardedLoss, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase:
    """``get_weights``: the full weights laid out as ``policy`` (or the loss's parameters)."""
    full = full_weights(owner, cpu_offload)
    if not full:
        return TensorDict()
    if policy is None:
        return TensorDict({n: full[n] for n in owner.names}, batch_size=[]).unflatten_keys(".")
    by_id = {id(owner._originals[name]): name for name in owner.names}
    device = torch.device("cpu") if cpu_offload else None

    def fill(t):
        name = by_id.get(id(t))
        if name is not None:
            return full[name]
        t = t.detach()
        return t.to(device) if device is not None and t.device != device else t.clone()

    return TensorDict.from_module(policy).apply(fill, batch_size=[])


def loss_buffers(owner: ShardedLoss) -> dict[str, torch.Tensor]:
    """The loss's state that is not a trained parameter (targets, estimator constants), replicated."""
    names = set(owner.names) | set(owner.tied_keys)
    return {k: v for k, v in owner.loss_module.state_dict(keep_vars=True).items() if k not in names}


def _tied(owner: ShardedLoss, tensors: dict[str, Any]) -> dict[str, Any]:
    """The state-dict keys of tied parameters (``lm_head.weight``), each the tensor of the name that owns it."""
    return {k: tensors[n] for k, n in owner.tied_keys.items() if n in tensors}


def model_state(owner: ShardedLoss) -> dict[str, Any]:
    full = full_weights(owner, cpu_offload=False)
    full.update(_tied(owner, full))
    return {k: full[k] if k in full else v for k, v in owner.loss_module.state_dict().items()}


def model_shapes(owner: ShardedLoss) -> dict[str, tuple]:
    shapes = {k: tuple(v.shape) for k, v in loss_buffers(owner).items()}
    shapes.update({n: tuple(s) for n, s in owner.shapes.items()})
    shapes.update(_tied(owner, shapes))
    return {k: shapes[k] for k in owner.loss_module.state_dict(keep_vars=True)}


def load_model_state(owner: ShardedLoss, state) -> None:
    params = {owner.fqn(n): state[n].reshape(owner.param(n).shape) for n in owner.names}
    set_model_state_dict(owner, params, options=StateDictOptions(full_state_dict=True, strict=False))
    with torch.no_grad():
        for k, buffer in loss_buffers(owner).items():
            buffer.copy_(state[k])


def optimizer_state(owner: ShardedLoss, raw, param_names: list[str]) -> dict[str, Any]:
    """The full state of torch optimizer ``raw``, indexed as ``param_names`` with the loss's shapes."""
    by_flat = {owner.fqn(n): n for n in owner.names}
    full = get_optimizer_state_dict(owner, raw, options=_FULL)
    index = {n: i for i, n in enumerate(param_names)}
    state = {}
    for fqn, fields in full["state"].items():
        name = by_flat[fqn]
        state[index[name]] = {f: as_param_shape(v, owner.shapes[name]) for f, v in fields.items()}
    groups = [dict(g, params=[index[by_flat[p]] for p in g["params"]]) for g in full["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(owner: ShardedLoss, raw, state, param_names: list[str]) -> None:
    """Load an index-keyed full optimizer state (as ``optimizer_state`` returns) into ``raw``."""
    # each field in the shape this optimizer keeps it (a scalar parameter's moments are (1,) here, its
    # step stays ()), read from the optimizer's own (sharded, initialised) state: no gather
    live = get_optimizer_state_dict(owner, raw)["state"]
    moments = {}
    for i, fields in state["state"].items():
        fqn = owner.fqn(param_names[int(i)])
        shapes = {f: v.shape for f, v in live.get(fqn, {}).items() if isinstance(v, torch.Tensor)}
        moments[fqn] = {
            f: v.reshape(shapes[f]) if isinstance(v, torch.Tensor) and f in shapes and v.shape != shapes[f]
            and v.numel() == math.prod(shapes[f]) else v
            for f, v in fields.items()
        }
    if not moments:
        # an optimizer without per-parameter state (plain SGD): torch's full-state loader finds no tensor
        # to place and refuses ("Expected device to be set"); the groups' settings are all there is to load
        for live_group, saved in zip(raw.param_groups, state["param_groups"]):
            live_group.update({k: v for k, v in saved.items() if k != "params"})
        return
    groups = [dict(g, params=[owner.fqn(param_names[i]) for i in g["params"]]) for g in state["param_groups"]]
    set_optimizer_state_dict(owner, raw, {"state": moments, "param_groups": groups}, options=_FULL)


def sharded_tensors(owner: ShardedLoss, raw, frozen: frozenset[str] = frozenset(),
                    ) -> tuple[dict[str, torch.Tensor], dict[str, dict], list[dict]]:
    """This rank's shards under checkpoint keys (``model/<name>``, ``optim/<name>/<field>``), the
    optimizer's non-tensor state by loss name, and its param groups naming loss parameters. The
    ``frozen`` parameters are left out (see ``checkpoint.frozen``)."""
    model = get_model_state_dict(owner)
    tensors = {f"model/{n}": model[owner.fqn(n)] for n in owner.names if n not in frozen}
    tensors.update({f"model/{k}": model[owner.fqn(n)] for k, n in owner.tied_keys.items()  # as one process saves
                    if k not in frozen})
    tensors.update({f"model/{k}": v.detach() for k, v in loss_buffers(owner).items()})
    optim = get_optimizer_state_dict(owner, raw)
    by_flat = {owner.fqn(n): n for n in owner.names}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, fields in optim["state"].items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{by_flat[fqn]}/{field}"] = value
            else:
                scalars.setdefault(by_flat[fqn], {})[field] = value
    groups = [{**group_settings(g), "params": [by_flat[p] for p in g["params"]]} for g in optim["param_groups"]]
    return tensors, scalars, groups


def shapes_meta(owner: ShardedLoss) -> dict[str, list[int]]:
    return {**{k: list(v.shape) for k, v in loss_buffers(owner).items()},
            **{n: list(s) for n, s in owner.shapes.items()},
            **{k: list(owner.shapes[n]) for k, n in owner.tied_keys.items()}}


def load_targets(owner: ShardedLoss, raw) -> tuple[dict[str, torch.Tensor], Any]:
    """Fresh tensors of this rank's sharding for every checkpoint key, and the optimizer state they
    will fill: a read that fails mid-way leaves the live state untouched."""
    model = get_model_state_dict(owner)
    tensors = {f"model/{n}": torch.empty_like(model[owner.fqn(n)]) for n in owner.names}
    tensors.update({f"model/{k}": torch.empty_like(v) for k, v in loss_buffers(owner).items()})
    optim = get_optimizer_state_dict(owner, raw)
    by_flat = {owner.fqn(n): n for n in owner.names}
    for fqn, fields in optim["state"].items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{by_flat[fqn]}/{field}"] = torch.empty_like(value)
    return tensors, optim


def apply_loaded(owner: ShardedLoss, raw, tensors: dict[str, torch.Tensor], optim, meta: dict[str, Any]) -> None:
    """Copy what ``load_targets`` received from a checkpoint into the live shards and optimizer."""
    # frozen parameters a folder does not hold (checkpoint.frozen) keep their values
    set_model_state_dict(owner, {owner.fqn(n): tensors[f"model/{n}"] for n in owner.names if f"model/{n}" in tensors},
                         options=StateDictOptions(strict=False))
    with torch.no_grad():
        for k, buffer in loss_buffers(owner).items():
            buffer.copy_(tensors[f"model/{k}"])
    by_flat = {owner.fqn(n): n for n in owner.names}
    for fqn, fields in optim["state"].items():
        for field in list(fields):
            key = f"optim/{by_flat[fqn]}/{field}"
            if key in tensors:
                fields[field] = tensors[key]
            else:
                fields[field] = meta["optim_scalars"].get(by_flat[fqn], {}).get(field, fields[field])
    saved_groups = {frozenset(g["params"]): g for g in meta["param_groups"]}  # checked: the same groups
    for group in optim["param_groups"]:
        saved = saved_groups[frozenset(by_flat[p] for p in group["params"])]
        # JSON has no tuples: give hyper-parameters such as Adam's betas their type back
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v
                      for k, v in saved.items() if k != "params"})
    set_optimizer_state_dict(owner, raw, optim)


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters as JSON keeps them (tensors as numbers, tuples as lists), without params."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else v.tolist()
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
