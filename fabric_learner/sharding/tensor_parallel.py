"""Tensor parallelism for the layers a ``ShardedLoss`` owns: torch's Colwise/Rowwise styles on its units.

``parallelize_module`` places ``nn.Linear`` modules; a ``ShardedLoss`` holds each ``Linear`` of the
loss's networks in a ``LayerUnit`` (its parameters under the loss's names, the leaf module left in
the loss), which torch's styles do not recognise. ``parallelize_layers`` applies the same placements
to those units: the plan names the loss's own layers, the style says how they are cut.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def parallelize_layers(module: nn.Module, tp_mesh: Any, plan: dict[str, Any], *, replicate_rest: bool = True) -> list[str]:
    """Cut the ``Linear`` layers of a ``ShardedLoss`` named in ``plan`` over the 1-D mesh ``tp_mesh``.

    ``ColwiseParallel`` shards a layer's weight and bias along its outputs (each rank computes
    its slice of the features), ``RowwiseParallel`` its weight along its inputs (each rank takes
    its slice of the features, the partial outputs are summed): as torch's ``parallelize_module``
    does for ``nn.Linear``, with the style's ``input_layouts``, ``output_layouts`` and
    ``use_local_output``. Call it in a ``parallelize_fn`` before ``fully_shard`` over the
    data-parallel mesh, as for any FSDP2 x TP model.

    With ``replicate_rest`` (the default) every other layer (embeddings, norms, an LM head) is
    placed whole on each tensor-parallel rank (``Replicate``), its inputs and outputs plain tensors
    as before: then every parameter lives on the same 2-D mesh once ``fully_shard`` has run, which
    torch's gradient norm and clipping need (they cannot combine DTensors of different meshes).
    Its ranks compute those layers alike, so their gradients need no reduction over the
    tensor-parallel ranks.

    Args:
        module: the ``ShardedLoss`` a ``parallelize_fn`` receives.
        tp_mesh: the tensor-parallel mesh, e.g. ``mesh["tensor_parallel"]`` of Lightning's.
        plan: the loss's name for a ``Linear`` (its path in the loss, as ``loss.named_modules()``
            gives it; ``fnmatch`` patterns allowed) -> a ``ColwiseParallel`` or ``RowwiseParallel``.
        replicate_rest: place the layers outside ``plan`` whole on every tensor-parallel rank.

    Returns:
        The paths of the layers cut, in the loss's order.

    Examples:
        The names a plan can use are the units' paths:

        >>> import torch
        >>> from fabric_learner.sharding import ShardedLoss, parallelize_layers
        >>> from fabric_learner.testing import dqn_example
        >>> owner = ShardedLoss(dqn_example()[0], torch.device("cpu"))
        >>> [unit.path for unit in owner.layer_units()]
        ['value_network.module.0.module']
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> parallelize_layers(owner, None, {"critic.*": ColwiseParallel()})
        Traceback (most recent call last):
            ...
        ValueError: The tensor-parallel plan names layers the loss does not have: ['critic.*']; ....
    """
    units = {unit.path: unit for unit in module.layer_units()}
    matched: dict[str, Any] = {}
    unused = []
    for pattern, style in plan.items():
        hits = [path for path in units if fnmatch.fnmatchcase(path, pattern)]
        if not hits:
            unused.append(pattern)
        for path in hits:
            matched.setdefault(path, style)
    if unused:
        raise ValueError(f"The tensor-parallel plan names layers the loss does not have: {unused}; nothing was "
                         f"cut. Its layers: {list(units)[:12]}.")
    wrong = [p for p in matched if not isinstance(units[p].leaf, nn.Linear) or units[p].members is not None
             or not isinstance(matched[p], ColwiseParallel | RowwiseParallel)]
    if wrong:
        raise ValueError(f"parallelize_layers cuts single nn.Linear layers with ColwiseParallel or RowwiseParallel; "
                         f"{wrong[:4]} are not (nothing was cut). Leave them out of the plan: fully_shard shards "
                         "them over the data-parallel ranks.")
    for path, unit in units.items():
        if path in matched:
            _cut(unit, matched[path], tp_mesh)
        elif replicate_rest and unit.members is None:
            _replicate(unit, tp_mesh)
    return [p for p in units if p in matched]


def _own(unit: nn.Module) -> list[str]:
    """The flat names of the parameters ``unit`` holds itself (not those it reads from a tied unit)."""
    return [name.replace(".", "__") for name in unit.attrs.values() if name not in unit.aliases]


def _replicate(unit: nn.Module, mesh: Any) -> None:
    def partition(_name, mod, device_mesh):
        for flat in _own(mod):
            param = getattr(mod, flat)
            placed = distribute_tensor(param.detach(), device_mesh, [Replicate()])
            mod.register_parameter(flat, nn.Parameter(placed, requires_grad=param.requires_grad))

    def prepare_input(_mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def prepare_output(_mod, out, _device_mesh):
        return _to_local(out)

    distribute_module(unit, mesh, partition, prepare_input, prepare_output)


def _to_local(out: Any) -> Any:
    if isinstance(out, DTensor):
        return out.to_local()
    if isinstance(out, tuple | list):
        return type(out)(_to_local(o) for o in out)
    return out


def _cut(unit: nn.Module, style: Any, mesh: Any) -> None:
    rowwise = isinstance(style, RowwiseParallel)
    names = {attr: name.replace(".", "__") for attr, name in unit.attrs.items() if name not in unit.aliases}
    placements = {"weight": Shard(1) if rowwise else Shard(0), "bias": Replicate() if rowwise else Shard(0)}

    def partition(_name, mod, device_mesh):
        for attr, flat in names.items():
            param = getattr(mod, flat)
            placed = distribute_tensor(param.detach(), device_mesh, [placements[attr]])
            mod.register_parameter(flat, nn.Parameter(placed, requires_grad=param.requires_grad))

    given, wanted = style.input_layouts, (Shard(-1),) if rowwise else (Replicate(),)

    def prepare_input(_mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, given, run_check=False)
        if tuple(x.placements) != wanted:
            x = x.redistribute(placements=wanted)
        return (x, *inputs[1:])

    def prepare_output(_mod, out, device_mesh):
        if tuple(out.placements) != tuple(style.output_layouts):
            out = out.redistribute(placements=style.output_layouts)
        return out.to_local() if style.use_local_output else out

    distribute_module(unit, mesh, partition, prepare_input, prepare_output)
