"""Per-layer units and how a layer's call reaches its unit while a ``ShardedLoss`` owns its weights.

A ``LayerUnit`` holds the parameters of one leaf module (a ``Linear``) or one layer of a stacked
critic ensemble, so FSDP2 can gather exactly that layer. ``route`` replaces the leaf's ``forward``:
called with the loss's own (emptied) parameters in its slots, the call goes through the unit;
called with anything else (target weights) it runs the leaf as it is. Parameters are recognised
by storage (``marker``, ``storage_of``), which survives the detaching and slicing torchrl does.

A unit sees its owner only through ``UnitOwner``, which ``owner.ShardedLoss`` satisfies: this module
imports nothing from ``owner`` (which builds the units from it).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner.utils import compat as _compat


class UnitOwner(Protocol):
    """What a unit reads of the ``ShardedLoss`` owning its parameters (and, while the owner runs the loss,
    the counters it moves)."""

    shapes: dict[str, torch.Size]  # each loss parameter's full shape
    _updating: int  # > 0 while update() runs the loss: leaves route to their units
    _inside: int  # > 0 while the loss's parameters hold full tensors
    _online: dict[int | None, str]  # storage of a loss parameter (see storage_of) -> its name

    def param(self, name: str) -> torch.Tensor:
        """The (sharded) parameter holding the loss's parameter ``name``."""


def flat_name(name: str) -> str:
    return name.replace(".", "__")


def marker(param: torch.Tensor, members: int | None = None) -> torch.Tensor:
    """An empty tensor with a storage of its own, so a loss slot holding it (or a detached view
    of it) can be traced back to its parameter by storage while holding no weights.

    For a stacked ensemble parameter (``members`` given) it is ``[members, 0]``, so torchrl can
    still vmap over (or unbind) its first dimension: member ``i``'s slice starts at storage
    offset ``i``, which tells a loop over the members which one runs.
    """
    if members is None:
        return torch.empty(1, dtype=param.dtype, device=param.device)[:0]
    return torch.empty(members, dtype=param.dtype, device=param.device).as_strided((members, 0), (1, 1))


def storage_of(t) -> int | None:
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # functorch wrappers (vmap) have no storage
        return None


class LayerUnit(nn.Module):
    """One FSDP unit: the loss's parameters that one leaf module of its networks holds.

    While the loss runs in ``update``, a call of that leaf with the loss's own parameters in
    its slots is routed through this module, so FSDP2's hooks gather these parameters just for
    that call (and again for its backward) and free them after. Calls with other tensors in
    the slots (target networks) run the leaf untouched.

    ``members`` is set for one layer of a stacked ensemble (SAC's critics): the parameters are
    ``[members, ...]``, all members' weights of that layer, and torchrl calls the leaf either
    under ``vmap`` (the unit then runs the leaf over all members at once, outside torchrl's
    batching, see ``_route_vmapped``) or once per member (the unit then gathers the stack and
    runs that member's slice).
    """

    def __init__(self, owner: UnitOwner, path: str, leaf: nn.Module, attrs: dict[str, str],
                 members: int | None = None, aliases: frozenset = frozenset()) -> None:
        super().__init__()
        self.__dict__["aliases"] = aliases  # loss names held by another unit (tied weights): read from there
        self.__dict__["tied"] = False  # set by the owner: this unit shares a parameter with another
        self.__dict__["owner"] = owner
        self.__dict__["path"] = path
        self.__dict__["leaf"] = leaf
        self.__dict__["attrs"] = attrs  # leaf attribute -> loss parameter name
        self.__dict__["members"] = members
        self.__dict__["_detached"] = ()
        self.__dict__["_call"] = None  # how a stacked unit runs this call: ("member", i) or ("vmap", ...)

    def _full(self, attr: str, name: str) -> torch.Tensor:
        held = self.owner.param(name) if name in self.aliases else getattr(self, flat_name(name))
        full = held.view(self.owner.shapes[name])
        return full.detach() if attr in self._detached else full

    def _run_leaf(self, weights, args, kwargs):
        leaf = self.leaf
        swapped = []
        try:
            for attr, full in zip(self.attrs, weights):
                store = _compat.tensor_slots(leaf, attr)
                swapped.append((store, attr, store[attr]))
                store[attr] = full
            return type(leaf).forward(leaf, *args, **kwargs)
        finally:
            for store, attr, old in reversed(swapped):
                store[attr] = old

    def forward(self, *args, **kwargs):
        # FSDP2's pre-forward hook (when this unit is sharded on its own) has gathered the
        # parameters; otherwise they are full because the root's window is open.
        weights = [self._full(attr, name) for attr, name in self.attrs.items()]
        call = self._call
        if call is None:
            return self._run_leaf(weights, args, kwargs)
        if call[0] == "member":
            return self._run_leaf([w[call[1]] for w in weights], args, kwargs)
        _, spec, dims, randomness = call  # args: the flattened (args, kwargs), unbatched

        def member(member_weights, *flat):
            inner_args, inner_kwargs = torch.utils._pytree.tree_unflatten(list(flat), spec)
            return self._run_leaf(member_weights, inner_args, inner_kwargs)

        return torch.vmap(member, in_dims=(0, *dims), randomness=randomness)(tuple(weights), *args)


def route(unit: LayerUnit, leaf: nn.Module, *args, **kwargs):
    """``leaf.forward`` while a ``ShardedLoss`` owns its parameters (see ``LayerUnit``).

    Bound with ``types.MethodType``, so ``copy.deepcopy(leaf)`` binds the copy, which runs plain.
    """
    owner = unit.owner
    if owner._updating and leaf is unit.leaf:
        if unit.members is not None:
            return _route_stacked(unit, leaf, args, kwargs)
        online = owner._online
        detached = []
        for attr, name in unit.attrs.items():
            held = getattr(leaf, attr, None)
            if online.get(storage_of(held)) != name:
                break
            if not held.requires_grad:
                detached.append(attr)  # e.g. a critic run with detached weights for the actor's loss
        else:
            unit.__dict__["_detached"] = tuple(detached)
            unit.__dict__["_call"] = None
            return unit(*args, **kwargs)
    return type(leaf).forward(leaf, *args, **kwargs)


def _route_stacked(unit: LayerUnit, leaf: nn.Module, args, kwargs):
    """One layer of a stacked ensemble, called by torchrl under ``vmap`` or once per member.

    Under ``vmap`` the leaf's slots hold batched views of the placeholders; otherwise (torchrl's
    ``deactivate_vmap=True`` loop) they hold member ``i``'s slice of them. Anything else in the
    slots (the target ensemble) runs the leaf as it is.
    """
    online = unit.owner._online
    detached, index = [], None
    for attr, name in unit.attrs.items():
        held = getattr(leaf, attr, None)
        if not isinstance(held, torch.Tensor):
            return type(leaf).forward(leaf, *args, **kwargs)
        parts = _compat.batched_parts(held)
        base = held if parts is None else parts[0]
        if online.get(storage_of(base)) != name:
            if base.numel() == 0 and held.numel() == 0:
                raise RuntimeError(
                    f"The loss called its ensemble layer {unit.path!r} with a tensor made from its stacked "
                    f"parameter {name!r} (e.g. by torch.cat), not with the parameter itself. Under FSDP the "
                    "learner gathers an ensemble's layers only where torchrl's SAC/TD3/IQL losses hand the "
                    "stacked parameters to vmap as they are; train this loss with strategy='ddp', or leave "
                    "the stacked parameters unchanged before calling the network."
                )
            return type(leaf).forward(leaf, *args, **kwargs)
        if parts is not None and parts[2] != 0:
            return type(leaf).forward(leaf, *args, **kwargs)
        # batched: the whole stack, at its vmap level; a member's slice: its offset (see marker)
        where = ("vmap", parts[1]) if parts is not None else ("member", base.storage_offset())
        if index is not None and where != index:
            return type(leaf).forward(leaf, *args, **kwargs)
        index = where
        if not base.requires_grad:
            detached.append(attr)  # a critic run with detached weights for the actor's loss
    unit.__dict__["_detached"] = tuple(detached)
    if index[0] == "member":
        unit.__dict__["_call"] = index
        return unit(*args, **kwargs)
    return _route_vmapped(unit, index[1], args, kwargs)


def _route_vmapped(unit: LayerUnit, level: int, args, kwargs):
    """Run the ensemble layer for all members outside torchrl's ``vmap``, then hand the result back
    batched.

    FSDP2's hooks (the all-gather, the autograd functions it puts on the unit's inputs and
    outputs) then see plain tensors, exactly as for any other layer: the inputs are unwrapped
    from the vmap level, the unit runs its own ``vmap`` over the gathered ``[members, ...]``
    weights with the same randomness, and its output (members first) is re-wrapped at the level
    it came from.
    """
    levels = _compat.vmap_levels()
    if len(levels) != 1 or levels[0][0] != level:
        raise RuntimeError(
            f"The ensemble layer {unit.path!r} was called under {len(levels)} nested functorch transforms; "
            "the FSDP learner gathers a stacked ensemble's layer only under torchrl's own single vmap. "
            "Call the loss outside any vmap/grad transform of your own, set its deactivate_vmap=True, "
            "or train it with strategy='ddp'."
        )
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    plain, dims = [], []
    for x in flat:
        parts = _compat.batched_parts(x)
        if parts is not None and parts[1] == level:
            plain.append(parts[0])
            dims.append(parts[2])
        else:
            plain.append(x)
            dims.append(None)
    unit.__dict__["_call"] = ("vmap", spec, tuple(dims), levels[0][1])
    with _compat.outside_functorch():
        out = unit(*plain)
    return torch.utils._pytree.tree_map(
        lambda t: _compat.batch_at(t, level) if isinstance(t, torch.Tensor) else t, out)


class BlockUnit(nn.Module):
    """One FSDP unit for one decoder layer of a transformers model: the ``LayerUnit`` of each leaf inside it.

    While the loss runs in ``update``, a call of the decoder layer goes through this module, so
    FSDP2's hooks gather the whole layer once for its forward (and again for its backward) and
    free it after; the leaves inside then route to their ``LayerUnit`` as always, finding the
    gathered weights. With ``checkpointed`` set (the plan's ``activation_checkpointing``), the
    layer's activations are not kept: its forward is recomputed in the backward, inside the unit's
    re-gather, under ``torch.utils.checkpoint`` (non-reentrant, random state preserved).
    """

    def __init__(self, owner: UnitOwner, path: str, block: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self.__dict__["owner"] = owner
        self.__dict__["path"] = path
        self.__dict__["block"] = block
        self.__dict__["checkpointed"] = False

    def _run(self, *args, **kwargs):
        owner = self.owner
        # the recompute in the backward (activation checkpointing) runs after the loss call: its leaves
        # route to their units, and their guards let them run, as in the forward
        owner.__dict__["_updating"] += 1
        owner.__dict__["_inside"] += 1
        try:
            return type(self.block).forward(self.block, *args, **kwargs)
        finally:
            owner.__dict__["_updating"] -= 1
            owner.__dict__["_inside"] -= 1

    def forward(self, *args, **kwargs):
        if self.checkpointed and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            # a recomputed forward would append its keys and values to the KV cache a second time (as
            # transformers' own gradient checkpointing, train without one: no training step reads it)
            kwargs = {k: (None if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            return checkpoint(self._run, *args, use_reentrant=False, **kwargs)
        return self._run(*args, **kwargs)


#: The names transformers' decoder layers take their KV cache under.
_CACHE_ARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


def route_block(unit: BlockUnit, block: nn.Module, *args, **kwargs):
    """``block.forward`` while a ``ShardedLoss`` owns its parameters: through its ``BlockUnit`` in ``update``."""
    if unit.owner._updating and block is unit.block:
        return unit(*args, **kwargs)
    return type(block).forward(block, *args, **kwargs)
