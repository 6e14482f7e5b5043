"""FSDP2 for torchrl losses: shard the parameters a loss trains, one FSDP2 unit per layer.

``fully_shard`` cannot wrap a ``LossModule`` (its ``named_parameters`` rejects
``remove_duplicate``), and sharding the networks inside a functional loss leaves the loss's
``TensorDictParams`` pointing at the pre-shard tensors. So ``ShardedLoss`` takes the loss's
trainable parameters (``loss.named_parameters()``) as its own: those a leaf module of the loss's
networks holds (each ``Linear``, ...) go to that layer's ``LayerUnit``; so do, one unit per layer,
the stacked ``[members, ...]`` weights of a critic ensemble that torchrl vmaps over (SAC's, TD3's,
see ``STACKED_LOSSES``); the rest (``log_alpha``, the ensembles of losses that concatenate theirs)
stay on the ``ShardedLoss``. The layer units inside one decoder layer of a transformers model
(``discovery.decoder_blocks``) are grouped under that layer's ``BlockUnit``, sharded as one unit
whatever its size; a parameter two layers share (tied embeddings) is owned by the first layer's unit
and read from there by the other's. ``shard_loss`` shards every unit of 1M parameters or more, then the
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

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner.sharding.agreement import BatchAgreement
from fabric_learner.sharding.discovery import decoder_blocks, loss_networks, stacked_layers
from fabric_learner.sharding.mesh import registered_mesh, use_mesh
from fabric_learner.sharding.routing import BlockUnit, LayerUnit, flat_name, marker, route, route_block, storage_of
from fabric_learner.step.carrier import Carrier, output_leaves, run_loss
from fabric_learner.utils import compat as _compat


class ShardedLoss(nn.Module):
    """Owns ``loss``'s trainable parameters, so FSDP2 can shard them, in one unit per layer.

    Each leaf module of the loss's networks that holds loss parameters, and each layer of a
    stacked critic ensemble, gets a ``LayerUnit`` (under ``layers``) owning them; the rest
    (``log_alpha``) is owned here under flat names and swapped into the loss for the whole call.
    Scalars are stored with shape ``(1,)`` (FSDP2 shards along dim 0); ``shapes`` keeps the
    loss's own shapes. The loss is not a submodule: its parameters are replaced here.
    ``serve`` lists modules whose parameters stay full outside ``update`` (see the module doc).

    Examples:
        >>> import torch
        >>> from fabric_learner.sharding import ShardedLoss
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> owner = ShardedLoss(loss, torch.device("cpu"))
        >>> owner.layer_units()  # the Q-network's one layer
        [LayerUnit()]
        >>> [tuple(p.shape) for _, p in owner.named_loss_parameters()]
        [(2, 4), (2,)]
        >>> net.weight.numel()  # still full until the first update, load or full_parameters block
        8
        >>> with owner.full_parameters():  # full weights for code outside update
        ...     net(torch.ones(1, 4)).shape
        torch.Size([1, 2])
        >>> net.weight.numel()  # from then on emptied: the owner's shards are the weights
        0

        ``FabricLearner(..., strategy="fsdp")`` builds it (``learner.sharded_module``) and the strategy's
        plan (:func:`shard_loss`) shards its units: with N ranks each holds about 1/N of every parameter,
        and ``full_parameters`` becomes a collective.
    """

    def __init__(self, loss_module: nn.Module, device: torch.device, convert=None, serve=(), mp_policy=None) -> None:
        super().__init__()
        self.__dict__["mp_policy"] = mp_policy  # FSDP2's MixedPrecisionPolicy the plans apply by default
        self.__dict__["loss_module"] = loss_module
        self.__dict__["_device"] = device
        self.__dict__["_convert"] = convert
        names, shapes, originals = [], {}, {}
        for name, param in loss_module.named_parameters():
            names.append(name)
            shapes[name] = param.shape
            originals[name] = param
        by_id = {id(p): n for n, p in originals.items()}
        leaves, claimed, seen, aliases = [], {}, set(), {}
        for path, module in loss_networks(loss_module):
            if id(module) in seen or module is loss_module or isinstance(module, TensorDictBase):
                continue  # a TensorDictParams holds parameters but is never called: not a layer
            seen.add(id(module))
            attrs = {a: by_id[id(p)] for a, p in module.named_parameters(recurse=False) if id(p) in by_id}
            if attrs:
                # a parameter another leaf already holds (tied embeddings: the LM head's weight is the input
                # embedding's) stays owned by that leaf's unit; this leaf's unit reads it from there
                aliases[id(module)] = frozenset(n for n in attrs.values() if n in claimed)
                leaves.append((path, module, attrs, None))
                claimed.update({n: path for n in attrs.values() if n not in claimed})
        stacked = stacked_layers(loss_module, [n for n in names if n not in claimed], shapes,
                                  {id(leaf) for _, leaf, _, _ in leaves})
        for path, module, attrs, members in stacked:
            leaves.append((path, module, attrs, members))
            claimed.update({n: path for n in attrs.values()})
        self.layers = nn.ModuleDict()
        self.blocks = nn.ModuleDict()
        inside = {}  # id of a module inside a decoder block -> that block's unit
        for path, block in decoder_blocks(loss_module):
            self.blocks[flat_name(path)] = BlockUnit(self, path, block)
            inside.update({id(m): self.blocks[flat_name(path)] for m in block.modules()})
        fqns, units = {}, []
        for path, module, attrs, members in leaves:
            unit = LayerUnit(self, path, module, attrs, members, aliases.get(id(module), frozenset()))
            units.append(unit)
            key = flat_name(path)
            block = inside.get(id(module)) if members is None else None
            prefix = f"blocks.{flat_name(block.path)}.layers" if block is not None else "layers"
            for name in attrs.values():
                if name in unit.aliases:
                    continue
                unit.register_parameter(flat_name(name), _as_parameter(originals[name]))
                fqns[name] = f"{prefix}.{key}.{flat_name(name)}"
            (block.layers if block is not None else self.layers)[key] = unit
        for key in [k for k, b in self.blocks.items() if not b.layers]:
            del self.blocks[key]  # a block holding none of the loss's parameters is no unit
        shared = {n for u in units for n in u.aliases}
        for unit in units:  # both sides of a tie must be gathered together: neither is sharded alone
            unit.__dict__["tied"] = any(n in shared for n in unit.attrs.values())
        # state-dict keys of tied parameters other than the loss's name for them (lm_head.weight)
        self.__dict__["tied_keys"] = {k: by_id[id(v)] for k, v in loss_module.state_dict(keep_vars=True).items()
                                      if id(v) in by_id and k != by_id[id(v)]}
        whole = [n for n in names if n not in claimed]
        for name in whole:
            self.register_parameter(flat_name(name), _as_parameter(originals[name]))
            fqns[name] = flat_name(name)
        self.__dict__["_units"] = units
        self.__dict__["names"] = names
        self.__dict__["shapes"] = shapes
        self.__dict__["_originals"] = originals
        self.__dict__["_fqns"] = fqns
        self.__dict__["_whole"] = whole  # gathered for the whole loss call
        self.__dict__["_members"] = {n: u.members for u in self.layer_units() if u.members for n in u.attrs.values()}
        self.__dict__["_served"] = set()
        self.__dict__["_inside"] = 0  # > 0 while the loss's parameters hold full tensors
        # the loss's own parameters still hold the current full weights: from construction until the first
        # update, load or full_parameters block, so what is built right after the learner (a target-network
        # updater copying the online weights) sees them (see _empty)
        self.__dict__["_current"] = True
        self.__dict__["_updating"] = 0  # > 0 while update() runs the loss: leaves route to their units
        self.__dict__["_online"] = {}
        self.__dict__["_guards"] = []
        self.__dict__["_agreement"] = BatchAgreement()  # tensor-parallel ranks must feed equal batches
        self.__dict__["mesh"] = None  # the mesh with tensor parallelism its parameters live on (check_sharded)
        # SAC's ensemble params live under a batch-sized TensorDictParams; the swap needs that shape.
        self.__dict__["_skeleton"] = TensorDict.from_module(loss_module, as_module=False).select(
            *[tuple(n.split(".")) for n in whole]
        ) if whole else None
        self._served.update(self._names_of(serve))
        with torch.no_grad():
            for name, param in originals.items():
                if name in self._served:
                    param.data = param.data.clone()  # its own storage: the shard will not alias it
        for unit in self.layer_units():
            unit.leaf.forward = types.MethodType(functools.partial(route, unit), unit.leaf)
        for unit in self.block_units():
            unit.block.forward = types.MethodType(functools.partial(route_block, unit), unit.block)
        _compat.watch_target_updaters(loss_module, self._updater_built)
        self._guard_emptied_modules()

    def layer_units(self) -> list[LayerUnit]:
        """The per-layer units, in the loss's order (those inside decoder blocks included)."""
        return list(self._units)

    def block_units(self) -> list[BlockUnit]:
        """One unit per decoder layer of the loss's transformers models (see ``decoder_blocks``), in order."""
        return list(self.blocks.values())

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
        if self.mesh is not registered_mesh():
            use_mesh(self.mesh)  # this learner's ranks: another learner of the process may have registered its own
        self._agreement.check(carrier.value)
        loss = self.loss_module
        if self._current:
            self._empty()
        _compat.erase_loss_cache(loss)
        self.__dict__["_online"] = {storage_of(p): n for n, p in self._originals.items()}
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

    def weights_changed(self) -> None:
        """Collective, after an optimizer step or a load: the served parameters refreshed, the others emptied."""
        if self._current:
            self._empty()
        self.refresh_served()

    def _empty(self) -> None:
        """Free the full weights of every parameter that is not served: the shards are the truth from now on."""
        with torch.no_grad():
            for name, original in self._originals.items():
                if name not in self._served:
                    original.data = marker(original, self._members.get(name))
        self.__dict__["_current"] = False
        _compat.erase_loss_cache(self.loss_module)

    def _updater_built(self) -> None:
        """A torchrl target-network updater is being built on the loss: it copies the online weights now."""
        if self._current or self._inside:
            return
        raise RuntimeError(
            "A target-network updater (torchrl's SoftUpdate/HardUpdate) was built on a loss whose FSDP learner has "
            "already trained or loaded, so the loss's own parameters hold no weights to copy into the targets; "
            "nothing was changed. Build the updater right after the learner (before its first update or load), "
            "as the README's Trainer example does, or inside `with learner.full_parameters():` (a collective: "
            "every rank must enter it)."
        )

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
            self._empty()  # the sharded parameters stay the truth; the full copies are dropped

    def _guard_emptied_modules(self) -> None:
        """A forward pre-hook on each loss submodule holding an emptied parameter (see the module doc)."""
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        emptied = {id(self._originals[n]) for n in self.names if n not in self._served}
        seen = set()
        for path, module in loss_networks(self.loss_module):
            if id(module) not in seen and any(id(p) in emptied for p in module.parameters()):
                seen.add(id(module))
                self._guards.append(module.register_forward_pre_hook(_EmptiedGuard(self, path, module)))


def _as_parameter(param: torch.Tensor) -> nn.Parameter:
    data = param.detach()  # shares storage until fully_shard gives the shard its own
    return nn.Parameter(data.reshape(1) if data.ndim == 0 else data, param.requires_grad)

def gather_full(params: list[torch.Tensor], into: list[torch.Tensor]) -> None:
    """Copy the full tensors of ``params`` into ``into`` (flat, same numel), one all-gather per dtype.

    ``full_tensor()`` per parameter costs one collective each, which dominates for the small
    networks RL policies often are; dim-0-sharded DTensors on a 1-D mesh (FSDP2's layout) travel
    together. Other layouts (and plain tensors) fall back to ``full_tensor()``.
    """
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
        _compat.all_gather_flat(received, send, mesh.get_group())
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
        if self.owner._inside or self.owner._current:
            return None
        raise RuntimeError(
            f"The loss's module {self.path!r} ({self.kind}) was called outside update(), but under FSDP its "
            "parameters live as shards in the learner and it holds no weights here. Either pass the module "
            "the collector or your code runs as policy=<module> when building the learner (it then stays full "
            "and current on every rank), or run this code inside `with learner.full_parameters():` (a "
            "collective: every rank must enter it)."
        )

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) copies the model's hooks; past this one it would reach the owner, an FSDP module,
        # and fail in torch with "FSDP does not support deepcopy", which names no fix
        if self.owner._inside or self.owner._current:
            return _unguarded  # the copy is taken of full weights: a plain module of its own
        raise RuntimeError(
            f"copy.deepcopy of the loss's module {self.path!r} ({self.kind}) or of a module holding it: under FSDP "
            "its parameters live as shards in the learner and it holds no weights here, so nothing was copied. "
            "Take the copy (a generation engine's, a collector's) before building the learner, or build the "
            "learner with policy=<module> (it then stays full and current on every rank and copies as it is), "
            "or copy inside `with learner.full_parameters():` (a collective: every rank must enter it)."
        )


def _unguarded(module, args) -> None:
    """A copy's stand-in for ``_EmptiedGuard``: the copy holds its own full weights."""
    return None

