"""FSDP2 for torchrl losses: shard the parameters a loss trains, one FSDP2 unit per layer.

``fully_shard`` cannot wrap a ``LossModule`` (its ``named_parameters`` rejects
``remove_duplicate``), and sharding the networks inside a functional loss leaves the loss's
``TensorDictParams`` pointing at the pre-shard tensors. So ``ShardedLoss`` takes the loss's
trainable parameters (``loss.named_parameters()``) as its own: those a leaf module of the loss's
networks holds (each ``Linear``, ...) go to that layer's ``LayerUnit``; so do, one unit per layer,
the stacked ``[members, ...]`` weights of a critic ensemble that torchrl vmaps over (SAC's, TD3's,
see ``STACKED_LOSSES``); the rest (``log_alpha``, the ensembles of losses that concatenate theirs)
stay on the ``ShardedLoss``. ``shard_loss`` shards every unit of 1M parameters or more, then the
``ShardedLoss`` (smaller layers join its unit), so FSDP2 gathers one large layer at a time, as
hand-written per-layer FSDP2 does, and the largest model it trains is not bounded by what fits on
one rank.

The loss's own parameter objects stay in the loss as placeholders. While ``update`` runs the
loss, a layer called with them in its slots (swapped in by a functional loss, or held by the
network) is routed through its unit, whose FSDP2 hooks gather the layer for that forward and its
backward; a layer called with anything else (target-network buffers) runs as it is. A placeholder
seen detached (a critic evaluated for the actor's loss) gets the gathered weights detached. An
ensemble layer is called by torchrl under ``vmap`` with batched views of its placeholders in its
slots: the unit then runs outside that ``vmap`` on the unwrapped inputs (so FSDP2's hooks see
plain tensors), over all members at once, and its output is re-batched (``_route_vmapped``); in
torchrl's loop over the members (``deactivate_vmap=True``) the slot holds one member's slice of
the placeholder, and the unit gathers the stack and runs that member. The ``ShardedLoss``'s own
parameters are gathered for the whole call and swapped into the loss with
``TensorDict.to_module``. Entry points such as ``actor.get_dist`` need no hook: layers are routed
wherever they are called from.

Outside ``update`` the loss's own parameter objects are of two kinds:

- *served*: those of modules that also run outside the learner (the ``policy=`` module, the
  policy a Trainer's collector runs). They keep full-size tensors, refreshed from the shards
  after every optimizer step and every load, so a rollout on any rank sees the last step's
  weights with no collective of its own. Costs one copy of the policy per rank and one
  all-gather of the policy's parameters per optimizer step.
- every other one is emptied to free its memory. Calling a module that holds one outside
  ``update`` raises an error naming it and the fix, instead of a shape error deep in a layer.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner import _compat
from fabric_learner.checkpoint import sharded as sharded_files
from fabric_learner._carrier import Carrier, output_leaves, run_loss
from fabric_learner.optim import build_optimizer
from fabric_learner._stages import StageOptimizers, build_stage_optimizers

__all__ = ["ShardedLoss", "shard_loss", "whole_world"]


def flat_name(name: str) -> str:
    return name.replace(".", "__")


def _marker(param: torch.Tensor, members: int | None = None) -> torch.Tensor:
    """An empty tensor with a storage of its own, so a loss slot holding it (or a detached view
    of it) can be traced back to its parameter by storage while holding no weights.

    For a stacked ensemble parameter (``members`` given) it is ``[members, 0]``, so torchrl can
    still vmap over (or unbind) its first dimension: member ``i``'s slice starts at storage
    offset ``i``, which tells a loop over the members which one runs.
    """
    if members is None:
        return torch.empty(1, dtype=param.dtype, device=param.device)[:0]
    return torch.empty(members, dtype=param.dtype, device=param.device).as_strided((members, 0), (1, 1))


def _storage(t) -> int | None:
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

    def __init__(self, owner: ShardedLoss, path: str, leaf: nn.Module, attrs: dict[str, str],
                 members: int | None = None) -> None:
        super().__init__()
        self.__dict__["owner"] = owner
        self.__dict__["path"] = path
        self.__dict__["leaf"] = leaf
        self.__dict__["attrs"] = attrs  # leaf attribute -> loss parameter name
        self.__dict__["members"] = members
        self.__dict__["_detached"] = ()
        self.__dict__["_call"] = None  # how a stacked unit runs this call: ("member", i) or ("vmap", ...)

    def _full(self, attr: str, name: str) -> torch.Tensor:
        full = getattr(self, flat_name(name)).view(self.owner.shapes[name])
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


def _route(unit: LayerUnit, leaf: nn.Module, *args, **kwargs):
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
            if online.get(_storage(held)) != name:
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
        if online.get(_storage(base)) != name:
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
        # batched: the whole stack, at its vmap level; a member's slice: its offset (see _marker)
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


class ShardedLoss(nn.Module):
    """Owns ``loss``'s trainable parameters, so FSDP2 can shard them, in one unit per layer.

    Each leaf module of the loss's networks that holds loss parameters, and each layer of a
    stacked critic ensemble, gets a ``LayerUnit`` (under ``layers``) owning them; the rest
    (``log_alpha``) is owned here under flat names and swapped into the loss for the whole call.
    Scalars are stored with shape ``(1,)`` (FSDP2 shards along dim 0); ``shapes`` keeps the
    loss's own shapes. The loss is not a submodule: its parameters are replaced here.
    ``serve`` lists modules whose parameters stay full outside ``update`` (see the module doc).
    """

    def __init__(self, loss_module: nn.Module, device: torch.device, convert=None, serve=()) -> None:
        super().__init__()
        self.__dict__["loss_module"] = loss_module
        self.__dict__["_device"] = device
        self.__dict__["_convert"] = convert
        names, shapes, originals = [], {}, {}
        for name, param in loss_module.named_parameters():
            names.append(name)
            shapes[name] = param.shape
            originals[name] = param
        by_id = {id(p): n for n, p in originals.items()}
        leaves, claimed, seen = [], {}, set()
        for path, module in _loss_networks(loss_module):
            if id(module) in seen or module is loss_module or isinstance(module, TensorDictBase):
                continue  # a TensorDictParams holds parameters but is never called: not a layer
            seen.add(id(module))
            attrs = {a: by_id[id(p)] for a, p in module.named_parameters(recurse=False) if id(p) in by_id}
            attrs = {a: n for a, n in attrs.items() if n not in claimed}
            if attrs:
                leaves.append((path, module, attrs, None))
                claimed.update({n: path for n in attrs.values()})
        stacked = _stacked_layers(loss_module, [n for n in names if n not in claimed], shapes,
                                  {id(leaf) for _, leaf, _, _ in leaves})
        for path, module, attrs, members in stacked:
            leaves.append((path, module, attrs, members))
            claimed.update({n: path for n in attrs.values()})
        self.layers = nn.ModuleDict()
        fqns = {}
        for path, module, attrs, members in leaves:
            unit = LayerUnit(self, path, module, attrs, members)
            key = flat_name(path)
            for name in attrs.values():
                unit.register_parameter(flat_name(name), _as_parameter(originals[name]))
                fqns[name] = f"layers.{key}.{flat_name(name)}"
            self.layers[key] = unit
        whole = [n for n in names if n not in claimed]
        for name in whole:
            self.register_parameter(flat_name(name), _as_parameter(originals[name]))
            fqns[name] = flat_name(name)
        self.__dict__["names"] = names
        self.__dict__["shapes"] = shapes
        self.__dict__["_originals"] = originals
        self.__dict__["_fqns"] = fqns
        self.__dict__["_whole"] = whole  # gathered for the whole loss call
        self.__dict__["_members"] = {n: u.members for u in self.layers.values() if u.members for n in u.attrs.values()}
        self.__dict__["_served"] = set()
        self.__dict__["_inside"] = 0  # > 0 while the loss's parameters hold full tensors
        self.__dict__["_updating"] = 0  # > 0 while update() runs the loss: leaves route to their units
        self.__dict__["_online"] = {}
        self.__dict__["_guards"] = []
        # SAC's ensemble params live under a batch-sized TensorDictParams; the swap needs that shape.
        self.__dict__["_skeleton"] = TensorDict.from_module(loss_module, as_module=False).select(
            *[tuple(n.split(".")) for n in whole]
        ) if whole else None
        self._served.update(self._names_of(serve))
        with torch.no_grad():
            for name, param in originals.items():
                if name in self._served:
                    param.data = param.data.clone()  # its own storage: the shard will not alias it
                else:
                    param.data = _marker(param, self._members.get(name))
        for unit in self.layers.values():
            unit.leaf.forward = types.MethodType(functools.partial(_route, unit), unit.leaf)
        self._guard_emptied_modules()

    def layer_units(self) -> list[LayerUnit]:
        """The per-layer units, in the loss's order: ``fully_shard`` each, then this module."""
        return list(self.layers.values())

    def fqn(self, name: str) -> str:
        """The name torch's state-dict API gives the loss's parameter ``name`` here."""
        return self._fqns[name]

    def param(self, name: str) -> torch.Tensor:
        """The (sharded) parameter holding the loss's parameter ``name``."""
        return self.get_parameter(self._fqns[name])

    def _names_of(self, modules) -> set[str]:
        ids = {id(p) for m in modules for p in m.parameters()}
        return {name for name in self.names if id(self._originals[name]) in ids}

    def named_loss_parameters(self):
        """``(loss name, sharded parameter)`` pairs, in the loss's parameter order."""
        for name in self.names:
            yield name, self.param(name)

    def _params(self) -> TensorDict:
        td = self._skeleton.clone(False)
        for name in self._whole:
            td.set(tuple(name.split(".")), self.param(name).view(self.shapes[name]))
        return td

    def forward(self, carrier: Carrier):
        # FSDP2's pre-forward hook has gathered the parameters owned here (not the layers'):
        # they are plain tensors now. Each layer gathers its own when the loss reaches it.
        loss = self.loss_module
        _compat.erase_loss_cache(loss)
        self.__dict__["_online"] = {_storage(p): n for n, p in self._originals.items()}
        self.__dict__["_inside"] += 1
        self.__dict__["_updating"] += 1
        try:
            with self._params().to_module(loss) if self._whole else contextlib.nullcontext():
                call = loss if carrier.method is None else getattr(loss, carrier.method)
                output = run_loss(call, carrier.value, self._device, self._convert)
        finally:
            self.__dict__["_inside"] -= 1
            self.__dict__["_updating"] -= 1
            _compat.erase_loss_cache(loss)
        # FSDP2 hooks the backward through the tensors it finds in the output; a TensorDict
        # hides them, so the leaves travel beside the carried output.
        return Carrier(output), output_leaves(output)

    # ---- full weights outside update ----------------------------------------------------------

    def serve(self, module: nn.Module) -> bool:
        """Collective: keep ``module``'s parameters full and current from now on.

        Returns whether ``module`` holds any of the loss's trained parameters.
        """
        names = self._names_of([module]) - self._served
        if not names:
            return bool(self._names_of([module]))
        with torch.no_grad():
            for name in names:
                original = self._originals[name]
                original.data = torch.empty(self.shapes[name], dtype=original.dtype, device=original.device)
        self._served.update(names)
        self.refresh_served(names)
        self._guard_emptied_modules()
        return True

    def refresh_served(self, names=None) -> None:
        """Collective: copy the current full weights into the served parameters (one all-gather)."""
        names = [n for n in self.names if n in self._served and (names is None or n in names)]
        if not names:
            return
        with torch.no_grad():
            gather_full([self.param(n) for n in names],
                        into=[self._originals[n].data.view(-1) for n in names])

    def served_parameters(self) -> set[int]:
        return {id(self._originals[n]) for n in self._served}

    @contextlib.contextmanager
    def full_parameters(self):
        """Collective: the loss's own parameter objects hold the full weights inside the block.

        For code that reads the loss's modules outside ``update``: target-network updaters
        (which keep references to those objects), value estimators, rollouts.
        """
        with torch.no_grad():
            for name in self.names:
                if name in self._served:
                    continue  # already full and current
                t = self.param(name)
                full = t.full_tensor() if isinstance(t, DTensor) else t
                self._originals[name].data = full.detach().clone().view(self.shapes[name])
        _compat.erase_loss_cache(self.loss_module)
        self.__dict__["_inside"] += 1
        try:
            yield self.loss_module
        finally:
            self.__dict__["_inside"] -= 1
            # The sharded parameters stay the truth; the full copies are dropped.
            with torch.no_grad():
                for name, original in self._originals.items():
                    if name not in self._served:
                        original.data = _marker(original, self._members.get(name))
            _compat.erase_loss_cache(self.loss_module)

    def _guard_emptied_modules(self) -> None:
        """A forward pre-hook on each loss submodule holding an emptied parameter (see the module doc)."""
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        emptied = {id(self._originals[n]) for n in self.names if n not in self._served}
        seen = set()
        for path, module in _loss_networks(self.loss_module):
            if id(module) not in seen and any(id(p) in emptied for p in module.parameters()):
                seen.add(id(module))
                self._guards.append(module.register_forward_pre_hook(_EmptiedGuard(self, path, module)))


def _as_parameter(param: torch.Tensor) -> nn.Parameter:
    data = param.detach()  # shares storage until fully_shard gives the shard its own
    return nn.Parameter(data.reshape(1) if data.ndim == 0 else data, param.requires_grad)


#: torchrl losses that hand their stacked ensemble parameters to ``vmap`` (or its loop) as they are,
#: or only ``.detach()``-ed. Others (CQL and REDQ concatenate them first, CrossQ's critics hold
#: batch-norm statistics) keep their ensemble in the ``ShardedLoss``'s unit, gathered for the call.
STACKED_LOSSES = ("SACLoss", "DiscreteSACLoss", "TD3Loss", "TD3BCLoss", "IQLLoss")


def _stacked_layers(loss: nn.Module, names: list[str], shapes: dict, taken: set[int]):
    """``(path, leaf, {attr: name}, members)`` for each layer of a stacked ensemble among ``names``.

    torchrl keeps an ensemble (SAC's, TD3's critics) as ``<net>_params``, a ``TensorDictParams`` of
    batch ``[members]`` mirroring the module tree of the network ``<net>``, which it vmaps over:
    ``qvalue_network_params.module.0.weight`` is all members' weight of ``qvalue_network.module.0``.
    Only for ``STACKED_LOSSES``, and only layers whose every tensor is such a parameter.
    """
    import torchrl.objectives as objectives

    known = tuple(getattr(objectives, c) for c in STACKED_LOSSES if hasattr(objectives, c))
    if not isinstance(loss, known):
        return []
    found: dict[str, tuple] = {}
    for name in names:
        prefix, _, rest = name.partition(".")
        path, _, attr = rest.rpartition(".")
        params, network = getattr(loss, prefix, None), getattr(loss, prefix.removesuffix("_params"), None)
        if not (prefix.endswith("_params") and isinstance(params, TensorDictBase) and params.batch_dims == 1
                and isinstance(network, nn.Module)):
            continue
        members = params.batch_size[0]
        try:
            leaf = network.get_submodule(path) if path else network
        except AttributeError:
            continue
        own = getattr(leaf, attr, None)
        if id(leaf) in taken or not isinstance(own, torch.Tensor) or len(shapes[name]) < 1 \
                or shapes[name][0] != members or tuple(shapes[name][1:]) != tuple(own.shape):
            continue
        key = f"{prefix.removesuffix('_params')}.{path}" if path else prefix.removesuffix("_params")
        entry = found.setdefault(key, (key, leaf, {}, members))
        if entry[1] is leaf and entry[3] == members:
            entry[2][attr] = name
    return [entry for entry in found.values()
            if not any(True for _ in entry[1].buffers(recurse=False))
            and {a for a, _ in entry[1].named_parameters(recurse=False)} == set(entry[2])]


def _loss_networks(loss: nn.Module):
    """``(path, module)`` for the loss and every network it holds, registered or not.

    torchrl's functional losses keep the networks they were given (``actor_network``,
    ``qvalue_network``, ...) as plain attributes beside the ``TensorDictParams`` that own their
    parameters, so ``named_modules`` alone does not reach them.
    """
    yield "<the loss>", loss
    for attr, value in vars(loss).items():
        if isinstance(value, nn.Module) and not attr.startswith("_"):
            for path, module in value.named_modules(prefix=attr):
                yield path, module
    for path, module in loss.named_modules():
        if path:
            yield path, module


def gather_full(params: list[torch.Tensor], into: list[torch.Tensor]) -> None:
    """Copy the full tensors of ``params`` into ``into`` (flat, same numel), one all-gather per dtype.

    ``full_tensor()`` per parameter costs one collective each, which dominates for the small
    networks RL policies often are; dim-0-sharded DTensors on a 1-D mesh (FSDP2's layout) travel
    together. Other layouts (and plain tensors) fall back to ``full_tensor()``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    batches: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.ndim:
            batches.setdefault((p.device_mesh, p.dtype, p.to_local().device), []).append(i)
        else:
            into[i].copy_((p.full_tensor() if isinstance(p, DTensor) else p.detach()).reshape(-1))
    for (mesh, dtype, device), members in batches.items():
        world = mesh.size()
        rows = [math.ceil(params[i].shape[0] / world) for i in members]  # torch.chunk's split, as DTensor's
        widths = [r * math.prod(params[i].shape[1:]) for r, i in zip(rows, members)]
        send = torch.zeros(sum(widths), dtype=dtype, device=device)
        offset = 0
        for i, width in zip(members, widths):
            local = params[i].to_local().detach().reshape(-1)
            send[offset:offset + local.numel()] = local
            offset += width
        received = torch.empty(world * send.numel(), dtype=dtype, device=device)
        dist.all_gather_into_tensor(received, send, group=mesh.get_group())
        received = received.view(world, send.numel())
        offset = 0
        for i, r, width in zip(members, rows, widths):
            shape = params[i].shape
            block = received[:, offset:offset + width].reshape(world * r, *shape[1:])
            into[i].copy_(block[: shape[0]].reshape(-1))
            offset += width


class _EmptiedGuard:
    def __init__(self, owner: ShardedLoss, path: str, module: nn.Module) -> None:
        self.owner, self.path, self.kind = owner, path, type(module).__name__

    def __call__(self, module, args):
        if self.owner._inside:
            return None
        raise RuntimeError(
            f"The loss's module {self.path!r} ({self.kind}) was called outside update(), but under FSDP its "
            "parameters live as shards in the learner and it holds no weights here. Either pass the module "
            "the collector or your code runs as policy=<module> when building the learner (it then stays full "
            "and current on every rank), or run this code inside `with learner.full_parameters():` (a "
            "collective: every rank must enter it)."
        )


#: Layers with fewer parameters than this share the ``ShardedLoss``'s unit (see ``shard_loss``).
MIN_UNIT_NUMEL = 1 << 20


def shard_loss(module: nn.Module, mesh, min_unit_numel: int = MIN_UNIT_NUMEL) -> nn.Module:
    """The default ``parallelize_fn``: one FSDP2 unit per layer, then one for the rest.

    ``fully_shard`` on each of the ``ShardedLoss``'s layer units holding at least
    ``min_unit_numel`` parameters (1M: 4 MiB in float32; a critic ensemble's layer counts all its
    members), then on the ``ShardedLoss`` itself: a large layer is gathered when the loss reaches
    it and freed after, as in hand-written per-layer FSDP2, so no rank ever holds the whole model.
    Smaller layers (and what no layer holds, e.g. ``log_alpha``) are gathered together for the
    loss call: for the small networks RL often trains, one all-gather costs less than one per layer, as FSDP's
    size-based wrapping policies trade it. ``functools.partial(shard_loss, min_unit_numel=1)``
    gives every layer its own unit.
    """
    from torch.distributed.fsdp import fully_shard

    world = whole_world(mesh)
    for unit in getattr(module, "layer_units", list)():
        if sum(p.numel() for p in unit.parameters()) >= min_unit_numel:
            fully_shard(unit, mesh=world)
    fully_shard(module, mesh=world)
    return module


def whole_world(mesh):
    """A 1-D mesh over every rank of ``mesh``.

    Every rank feeds its own batch, so gradients must be averaged over all ranks; Fabric's
    2-D (data, tensor) mesh is flattened since the learner does no tensor parallelism.
    """
    if mesh is None or mesh.ndim == 1:
        return mesh
    return _compat.flatten_mesh(mesh, "fabric_learner_shard")


def check_sharded(module: ShardedLoss, world_size: int) -> None:
    """Raise at construction when the parallelize_fn's sharding would train wrongly."""
    plain = [name for name, p in module.named_loss_parameters() if not isinstance(p, DTensor)]
    narrow = [name for name, p in module.named_loss_parameters()
              if isinstance(p, DTensor) and p.device_mesh.size() != world_size]
    if narrow:
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded {narrow[:4]} over a mesh of "
            f"{module.param(narrow[0]).device_mesh.size()} ranks, but {world_size} ranks run: every "
            "rank feeds its own batch, so gradients must be averaged over all of them. Shard over the "
            "whole world (fabric_learner.whole_world(mesh)), or use strategy='fsdp'."
        )
    if plain:
        raise RuntimeError(
            f"The strategy's parallelize_fn left these parameters unsharded: {plain[:8]}. It receives a "
            "fabric_learner ShardedLoss holding the loss's trainable parameters; call "
            "torch.distributed.fsdp.fully_shard on it (or use strategy='fsdp' for the default)."
        )


def is_sharded_strategy(strategy: Any) -> bool:
    from lightning.fabric.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def default_sharded_strategy(timeout=None):
    """What ``strategy="fsdp"`` means here: Fabric's FSDP2 strategy with ``shard_loss``."""
    from lightning.fabric.strategies import ModelParallelStrategy

    kwargs = {} if timeout is None else {"timeout": timeout}
    return ModelParallelStrategy(parallelize_fn=shard_loss, **kwargs)


class ShardedBackend:
    """FSDP2 placement: a ``ShardedLoss`` set up by Fabric, its optimizer built after sharding.

    Weights and state go through torch's distributed state-dict API; every method that reads or
    writes them is a collective.
    """

    sharded = True

    @staticmethod
    def check_optimizer(optimizer) -> None:
        """Raise, before anything is launched, for an optimizer that cannot follow the sharding."""
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "A sharded strategy builds the optimizer after sharding, so it needs a factory, not an "
                "instance: pass e.g. optimizer=functools.partial(torch.optim.Adam, lr=3e-4), or None for Adam."
            )

    def __init__(self, fabric, loss_module: nn.Module, optimizer, convert, policy: nn.Module | None,
                 stages=()) -> None:
        self.check_optimizer(optimizer)
        loss_module.to(fabric.device)  # buffers (targets) stay in the loss, replicated
        self.fabric, self.loss_module = fabric, loss_module
        self.wrapper = ShardedLoss(loss_module, fabric.device, convert, serve=[policy] if policy is not None else [])
        self.module = fabric.setup_module(self.wrapper)
        check_sharded(self.wrapper, fabric.world_size)
        if stages:
            built = build_stage_optimizers(stages, self.wrapper.named_loss_parameters())
            wrapped = fabric.setup_optimizers(*built.values())
            wrapped = wrapped if isinstance(wrapped, (tuple, list)) else (wrapped,)
            self.optimizer = StageOptimizers(dict(zip(built, wrapped)))
        else:
            # the loss's order, as a one-process learner lists them
            params = [p for _, p in self.wrapper.named_loss_parameters()]
            self.optimizer = fabric.setup_optimizers(build_optimizer(optimizer, params))

    @property
    def sharded_module(self) -> ShardedLoss:
        return self.wrapper

    def raw_optimizer(self):
        """The torch optimizer, or the list of the stages' (torch's state-dict API takes either)."""
        if isinstance(self.optimizer, StageOptimizers):
            return [getattr(o, "optimizer", o) for o in self.optimizer.by_stage.values()]
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def named_parameters(self):
        return self.wrapper.named_loss_parameters()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        return self.wrapper.full_parameters()

    def weights_changed(self) -> None:
        self.wrapper.refresh_served()

    def serve(self, module: nn.Module) -> bool:
        return self.wrapper.serve(module)

    def served_parameters(self) -> set[int]:
        return self.wrapper.served_parameters()

    # ---- weights and state (collectives) -----------------------------------------------------

    def full_weights(self, cpu_offload: bool) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        wrapper = self.wrapper
        state = get_model_state_dict(wrapper, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
        if not state:
            return {}
        return {n: state[wrapper.fqn(n)].detach().reshape(wrapper.shapes[n]).clone() for n in wrapper.names}

    def get_weights(self, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase:
        full = self.full_weights(cpu_offload)
        if not full:
            return TensorDict()
        wrapper = self.wrapper
        by_id = {id(wrapper._originals[name]): name for name in wrapper.names}
        if policy is None:
            return TensorDict({n: full[n] for n in wrapper.names}, batch_size=[]).unflatten_keys(".")
        layout = TensorDict.from_module(policy)
        device = torch.device("cpu") if cpu_offload else None

        def fill(t):
            name = by_id.get(id(t))
            if name is not None:
                return full[name]
            t = t.detach()
            return t.to(device) if device is not None and t.device != device else t.clone()

        return layout.apply(fill, batch_size=[])

    def loss_buffers(self) -> dict[str, torch.Tensor]:
        names = set(self.wrapper.names)
        return {k: v for k, v in self.loss_module.state_dict(keep_vars=True).items() if k not in names}

    def model_state(self) -> dict[str, Any]:
        full = self.full_weights(cpu_offload=False)
        state = self.loss_module.state_dict()
        return {k: full[k] if k in full else v for k, v in state.items()}

    def model_shapes(self) -> dict[str, tuple]:
        shapes = {k: tuple(v.shape) for k, v in self.loss_buffers().items()}
        shapes.update({n: tuple(s) for n, s in self.wrapper.shapes.items()})
        return {k: shapes[k] for k in self.loss_module.state_dict(keep_vars=True)}

    def load_model_state(self, state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        wrapper = self.wrapper
        params = {wrapper.fqn(n): state[n].reshape(wrapper.param(n).shape) for n in wrapper.names}
        set_model_state_dict(wrapper, params, options=StateDictOptions(full_state_dict=True, strict=False))
        with torch.no_grad():
            for k, buffer in self.loss_buffers().items():
                buffer.copy_(state[k])

    def optimizer_state(self, param_names) -> dict[str, Any]:
        """Full optimizer state indexed as ``param_names`` (per stage when it is a dict of them)."""
        if isinstance(param_names, dict):
            return {"stages": {stage: self._optimizer_state(raw, param_names[stage])
                               for stage, raw in zip(self.optimizer.by_stage, self.raw_optimizer())}}
        return self._optimizer_state(self.raw_optimizer(), param_names)

    def _optimizer_state(self, raw, param_names: list[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        wrapper = self.wrapper
        # torch's state-dict API keys by the wrapper's FQNs (scalars (1,)); checkpoints by loss names and
        # shapes, so they reshard
        by_flat = {wrapper.fqn(n): n for n in wrapper.names}
        full = get_optimizer_state_dict(wrapper, raw, options=StateDictOptions(full_state_dict=True))
        index = {n: i for i, n in enumerate(param_names)}
        state = {}
        for fqn, fields in full["state"].items():
            name = by_flat[fqn]
            state[index[name]] = {f: sharded_files.as_param_shape(v, wrapper.shapes[name]) for f, v in fields.items()}
        groups = [dict(g, params=[index[by_flat[p]] for p in g["params"]]) for g in full["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, state, param_names) -> None:
        if isinstance(param_names, dict):
            for stage, raw in zip(self.optimizer.by_stage, self.raw_optimizer()):
                self._load_optimizer_state(raw, state["stages"][stage], param_names[stage])
            return
        self._load_optimizer_state(self.raw_optimizer(), state, param_names)

    def _load_optimizer_state(self, raw, state, param_names: list[str]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        wrapper = self.wrapper
        moments = {}  # loss names -> the wrapper's FQNs DCP expects (see _optimizer_state)
        for i, fields in state["state"].items():
            param = wrapper.param(param_names[int(i)])
            moments[wrapper.fqn(param_names[int(i)])] = {
                f: v.reshape(param.shape) if isinstance(v, torch.Tensor) and v.shape != param.shape
                and v.numel() == param.numel() else v
                for f, v in fields.items()
            }
        groups = [dict(g, params=[wrapper.fqn(param_names[i]) for i in g["params"]]) for g in state["param_groups"]]
        set_optimizer_state_dict(wrapper, raw, {"state": moments, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))

    # ---- checkpoints on disk: a DCP folder (see checkpoint/sharded.py) ------------------------------------------

    def save(self, learner, path: Path, blocking: bool = True):
        """Write a sharded version of ``path`` (a collective); with ``blocking=False`` return the
        future of its background write and publish (``sharded_files.save_version_async``)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        wrapper, rank, fabric = self.wrapper, learner.global_rank, self.fabric
        if rank == 0:
            sharded_files.check_target(path)
        fabric.barrier()
        version = fabric.broadcast(sharded_files.new_version_name(learner.num_updates) if rank == 0 else None, src=0)
        model = get_model_state_dict(wrapper)
        tensors = {f"model/{n}": model[wrapper.fqn(n)] for n in wrapper.names}
        tensors.update({f"model/{k}": v.detach() for k, v in self.loss_buffers().items()})
        optim = get_optimizer_state_dict(wrapper, self.raw_optimizer())
        by_flat = {wrapper.fqn(n): n for n in wrapper.names}
        scalars: dict[str, dict[str, Any]] = {}
        for fqn, fields in optim["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{by_flat[fqn]}/{field}"] = value
                else:
                    scalars.setdefault(by_flat[fqn], {})[field] = value
        groups = [{**_jsonable(g), "params": [by_flat[p] for p in g["params"]]} for g in optim["param_groups"]]
        tensors.update(sharded_files.rng_tensors(learner._rng_states()))
        meta = {
            "num_updates": learner.num_updates, "accum_step": learner._accum_step,
            "model_keys": list(self.loss_module.state_dict(keep_vars=True)),
            "param_names": learner._optimizer_param_names(), "param_groups": groups, "optim_scalars": scalars,
            "shapes": {**{k: list(v.shape) for k, v in self.loss_buffers().items()},
                       **{n: list(s) for n, s in wrapper.shapes.items()}},
            "world_size": learner.world_size,
        }
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        fabric.barrier()
        if not blocking:
            group = sharded_files.async_group(_compat.strategy_timeout(fabric.strategy))
            stager = self.__dict__.setdefault("_stager", sharded_files.Stager())  # buffers kept between saves
            return sharded_files.save_version_async(path, version, tensors, meta, rank, group, stager)
        sharded_files.save_version(path, version, tensors, meta, rank)
        fabric.barrier()
        if rank == 0:
            sharded_files.publish(path, version)
        fabric.barrier()

    def load_folder(self, learner, path: Path) -> None:
        """Each rank reads its own shards of a sharded checkpoint (a collective), resharding as needed."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        from fabric_learner import _rng

        folder = sharded_files.latest_version(path)
        meta = sharded_files.read_meta(folder)  # checked against the stored tensors
        wrapper = self.wrapper
        self._check_meta(learner, meta, path)
        rng = sharded_files.read_rng(folder)
        _rng.check(rng)
        # Fresh targets of the same sharding: a read that fails mid-way leaves live state untouched.
        model = get_model_state_dict(wrapper)
        tensors = {f"model/{n}": torch.empty_like(model[wrapper.fqn(n)]) for n in wrapper.names}
        buffers = {k: torch.empty_like(v) for k, v in self.loss_buffers().items()}
        tensors.update({f"model/{k}": v for k, v in buffers.items()})
        optim = get_optimizer_state_dict(wrapper, self.raw_optimizer())
        by_flat = {wrapper.fqn(n): n for n in wrapper.names}
        for fqn, fields in optim["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{by_flat[fqn]}/{field}"] = torch.empty_like(value)
        sharded_files.load_into(tensors, folder, distributed=True)
        set_model_state_dict(wrapper, {wrapper.fqn(n): tensors[f"model/{n}"] for n in wrapper.names},
                             options=StateDictOptions(strict=False))
        with torch.no_grad():
            for k, buffer in self.loss_buffers().items():
                buffer.copy_(buffers[k])
        for fqn, fields in optim["state"].items():
            for field in list(fields):
                key = f"optim/{by_flat[fqn]}/{field}"
                if key in tensors:
                    fields[field] = tensors[key]
                else:
                    fields[field] = meta["optim_scalars"].get(by_flat[fqn], {}).get(field, fields[field])
        for group, saved in zip(optim["param_groups"], meta["param_groups"]):
            # JSON has no tuples: give hyper-parameters such as Adam's betas their type back
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v
                          for k, v in saved.items() if k != "params"})
        set_optimizer_state_dict(wrapper, self.raw_optimizer(), optim)
        learner._resume_counters(int(meta["num_updates"]), int(meta["accum_step"]), rng)
        self.weights_changed()

    def _check_meta(self, learner, meta: dict[str, Any], path: Path) -> None:
        """Raise before anything is read if the checkpoint is not of this loss module and optimizer."""
        shapes = self.model_shapes()
        if sorted(meta["model_keys"]) != sorted(shapes) or \
                sorted(meta["param_names"]) != sorted(learner._optimizer_param_names()):
            raise ValueError(
                f"The checkpoint at {path} was saved from a different loss module or optimizer; nothing was "
                "loaded. Load it into a learner built the same way as the one that saved it."
            )
        wrong = [f"{k}: {meta['shapes'][k]} vs {list(s)}" for k, s in shapes.items()
                 if math.prod(meta["shapes"][k]) != math.prod(s)]
        if wrong:
            raise ValueError(f"The checkpoint at {path} has other shapes than this loss module ({wrong[:8]}); "
                             "nothing was loaded. Load it into a learner built the same way as the one that saved it.")
        ours, theirs = len(self.optimizer.param_groups), len(meta["param_groups"])
        if ours != theirs:
            raise ValueError(f"The checkpoint at {path} has {theirs} optimizer param group(s), this learner "
                             f"{ours}; nothing was loaded. Build the optimizer with the same param groups.")


def _jsonable(group: dict[str, Any]) -> dict[str, Any]:
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
