"""Carrying a TensorDict batch through Fabric's module wrapper intact.

Fabric's ``_FabricModule.forward`` converts inputs with ``apply_to_collection``, which rebuilds
a TensorDict as a plain mapping (losing ``batch_size``, device, lazy stacks and in-place
writes). Here the batch travels inside an opaque ``Carrier``; the loss forwarder applies the
precision's input conversion and any device move itself, and writes what the loss stored into
its input back into the caller's batch, as it would land without a learner.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torch import nn

from fabric_learner.step.output import as_tensordict


class Carrier:
    """An opaque box: Fabric's and DDP's input/output traversals do not look inside."""

    __slots__ = ("value", "method")

    def __init__(self, value: Any, method: str | None = None) -> None:
        self.value = value
        self.method = method  # a loss method to call instead of forward (several optimizers)


class LossForwarder(nn.Module):
    """The module Fabric wraps: calls the loss on the caller's batch, or on a converted copy.

    ``convert`` maps each batch tensor to what the loss must see (device move and precision
    cast) or is ``None`` when the batch goes in untouched. ``call`` replaces ``loss_module(batch)``
    when given (a ``CompiledLoss``). The output is returned as ``(Carrier(output), leaves)``: the
    leaves let DDP's unused-parameter search see the graph. Where nothing looks at them (plain DDP,
    no wrapper), ``expose_leaves = False`` saves their walk over the output: ~150 Python calls of a
    PPO update.
    """

    def __init__(self, loss_module: nn.Module, device: torch.device, convert: Callable | None,
                 call: Callable | None = None) -> None:
        super().__init__()
        self.loss_module = loss_module
        self._device = device
        self._convert = convert
        self._call = call
        self.expose_leaves = True

    def forward(self, carrier: Carrier):
        call = (self._call or self.loss_module) if carrier.method is None else getattr(self.loss_module, carrier.method)
        output = run_loss(call, carrier.value, self._device, self._convert)
        return Carrier(output), output_leaves(output) if self.expose_leaves else ()


def output_leaves(output: Any) -> tuple:
    """The tensors of a loss output, so that DDP and FSDP2 can find the graph behind it."""
    output = as_tensordict(output)  # torchrl's LLM losses return TensorClasses (GRPOLossOutput)
    if isinstance(output, TensorDictBase):
        return tuple(output.values(include_nested=True, leaves_only=True))
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)):
        return tuple(t for item in output for t in output_leaves(item))
    if isinstance(output, dict):
        return tuple(t for item in output.values() for t in output_leaves(item))
    return ()


def run_loss(loss_module: Callable, batch: TensorDictBase, device: torch.device, convert: Callable | None):
    """``loss_module(batch)``, on a converted copy when the batch needs a device move or cast."""
    if convert is None and _on_device(batch, device):
        return loss_module(batch)

    def to_loss(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=True)
        return convert(t) if convert is not None else t

    moves = batch.device is not None and batch.device != device
    fed = batch.apply(to_loss, device=device) if moves else batch.apply(to_loss)
    pairs = list(_parts(batch, fed))
    given = [dict(part.items(include_nested=True, leaves_only=True)) for _, part in pairs]
    output = loss_module(fed)
    for (original_part, part), before in zip(pairs, given):
        _write_back(original_part, part, before)
    return output


def _parts(batch: TensorDictBase, fed: TensorDictBase):
    """``(batch's, fed's)`` pairs of dense TensorDicts: the members of a lazy stack (ragged samples, as
    torchrl's LLM batches are: their entries cannot be stacked), else the two themselves."""
    if isinstance(batch, LazyStackedTensorDict) and isinstance(fed, LazyStackedTensorDict):
        for original, part in zip(batch.tensordicts, fed.tensordicts):
            yield from _parts(original, part)
    else:
        yield batch, fed


def _write_back(batch: TensorDictBase, fed: TensorDictBase, given: dict) -> None:
    """What the loss wrote into ``fed`` (a copy of ``batch``), set on ``batch`` in its own device and dtype."""
    written = [(key, value) for key, value in fed.items(include_nested=True, leaves_only=True)
               if given.get(key) is not value]
    for key, value in written:
        original = batch.get(key, None) if key in given else None
        dtype = original.dtype if isinstance(original, torch.Tensor) else value.dtype
        batch.set(key, value.to(device=_device_of(batch, key, value), dtype=dtype))


def _on_device(batch: TensorDictBase, device: torch.device) -> bool:
    bdev = batch.device
    if bdev is not None:
        return bdev == device
    if isinstance(batch, LazyStackedTensorDict):  # ragged members: walked one by one
        return all(_on_device(part, device) for part in batch.tensordicts)
    entries = getattr(batch, "_tensordict", None) if type(batch) is TensorDict else None
    if entries is not None:
        # a plain TensorDict's own entries, walked directly: ~10x cheaper than values(include_nested=True)
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                if value.device != device:
                    return False
            elif type(value) is TensorDict:
                if not _on_device(value, device):
                    return False
            else:  # anything else (lazy stacks, non-tensor data): the generic walk
                break
        else:
            return True
    return all(t.device == device for t in batch.values(include_nested=True, leaves_only=True))


def _device_of(batch: TensorDictBase, key, value: torch.Tensor) -> torch.device:
    if batch.device is not None:
        return batch.device
    original = batch.get(key, None)
    if isinstance(original, torch.Tensor):
        return original.device
    return next(iter(batch.values(include_nested=True, leaves_only=True)), value).device
