"""Where a torchrl loss keeps the networks it trains, and which of their layers are stacked ensembles.

Functional losses keep their networks as plain attributes beside the ``TensorDictParams`` that own
the parameters, and some vmap a critic ensemble stored as ``[members, ...]`` tensors: both are
found here, read-only, for ``ShardedLoss`` to build its units from.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn

#: torchrl losses that hand their stacked ensemble parameters to ``vmap`` (or its loop) as they are,
#: or only ``.detach()``-ed. Others (CQL and REDQ concatenate them first, CrossQ's critics hold
#: batch-norm statistics) keep their ensemble in the ``ShardedLoss``'s unit, gathered for the call.
STACKED_LOSSES = ("SACLoss", "DiscreteSACLoss", "TD3Loss", "TD3BCLoss", "IQLLoss")


def stacked_layers(loss: nn.Module, names: list[str], shapes: dict, taken: set[int]):
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


def loss_networks(loss: nn.Module):
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


def decoder_blocks(loss: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for each decoder layer of the transformers models among the loss's networks.

    A transformers ``PreTrainedModel`` names its repeated blocks in ``_no_split_modules`` (class
    names, e.g. ``["Qwen2DecoderLayer"]``), which HF declares for exactly this: what must stay on
    one device. Any module of such a model whose class is named there is a block; a block inside
    another block is not one (the outer one is the unit). Models without the attribute give none.
    """
    names: set[str] = set()
    for _, module in loss_networks(loss):
        declared = getattr(type(module), "_no_split_modules", None) or getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    if not names:
        return []
    found, seen, inside = [], set(), set()
    for path, module in loss_networks(loss):
        if id(module) in seen or id(module) in inside or type(module).__name__ not in names:
            continue
        seen.add(id(module))
        inside.update(id(m) for m in module.modules() if m is not module)
        found.append((path, module))
    return found
