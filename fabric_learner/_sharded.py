"""FSDP2 for torchrl losses: shard the parameters a loss trains, not its modules.

``fully_shard`` cannot wrap a ``LossModule`` (its ``named_parameters`` rejects
``remove_duplicate``), and sharding the networks inside a functional loss leaves the loss's
``TensorDictParams`` pointing at the pre-shard tensors. So ``ShardedLoss`` takes the loss's
trainable parameters (``loss.named_parameters()``: functional params, SAC's stacked critic
ensemble, ``log_alpha``) as its own, ``fully_shard`` shards them, and each forward swaps the
all-gathered tensors into the loss with ``TensorDict.to_module`` for the duration of the call.
Entry points such as ``actor.get_dist`` need no hook: the whole loss call is inside the
unsharded window. Target networks are loss buffers and are never swapped, so target forwards
use target weights. The loss's own parameter objects are emptied to free their memory.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner._batch import Carrier, run_loss


def flat_name(name: str) -> str:
    return name.replace(".", "__")


class ShardedLoss(nn.Module):
    """Owns ``loss``'s trainable parameters under flat names, so FSDP2 can shard them.

    Scalars are stored with shape ``(1,)`` (FSDP2 shards along dim 0); ``shapes`` keeps the
    loss's own shapes. The loss is not a submodule: its parameters are replaced here.
    """

    def __init__(self, loss_module: nn.Module, device: torch.device, convert=None) -> None:
        super().__init__()
        self.__dict__["loss_module"] = loss_module
        self.__dict__["_device"] = device
        self.__dict__["_convert"] = convert
        names, shapes, originals = [], {}, {}
        for name, param in loss_module.named_parameters():
            data = param.detach()  # shares storage; the loss's own object is emptied below
            self.register_parameter(
                flat_name(name), nn.Parameter(data.reshape(1) if data.ndim == 0 else data, param.requires_grad)
            )
            names.append(name)
            shapes[name] = param.shape
            originals[name] = param
        self.__dict__["names"] = names
        self.__dict__["shapes"] = shapes
        self.__dict__["_originals"] = originals
        # SAC's ensemble params live under a batch-sized TensorDictParams; the swap needs that shape.
        self.__dict__["_skeleton"] = TensorDict.from_module(loss_module, as_module=False).select(
            *[tuple(n.split(".")) for n in names]
        )
        with torch.no_grad():
            for param in originals.values():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def named_loss_parameters(self):
        """``(loss name, sharded parameter)`` pairs, in the loss's parameter order."""
        for name in self.names:
            yield name, getattr(self, flat_name(name))

    def _params(self) -> TensorDict:
        td = self._skeleton.clone(False)
        for name in self.names:
            t = getattr(self, flat_name(name))
            td.set(tuple(name.split(".")), t.view(self.shapes[name]))
        return td

    def forward(self, carrier: Carrier):
        # FSDP2's pre-forward hook has all-gathered the parameters: they are plain tensors here.
        loss = self.loss_module
        _erase_cache(loss)
        try:
            with self._params().to_module(loss):
                output = run_loss(loss, carrier.value, self._device, self._convert)
        finally:
            _erase_cache(loss)
        # FSDP2 hooks the backward through the tensors it finds in the output; a TensorDict
        # hides them, so the leaves travel beside the carried output.
        return Carrier(output), tuple(output.values(include_nested=True, leaves_only=True))

    @contextlib.contextmanager
    def full_parameters_in_loss(self):
        """Collective: the loss's own parameter objects hold the full weights inside the block.

        For code that reads the loss's modules outside ``update``: target-network updaters
        (which keep references to those objects), value estimators, rollouts.
        """
        with torch.no_grad():
            for name in self.names:
                t = getattr(self, flat_name(name))
                full = t.full_tensor() if isinstance(t, DTensor) else t
                self._originals[name].data = full.detach().clone().view(self.shapes[name])
        _erase_cache(self.loss_module)
        try:
            yield self.loss_module
        finally:
            # The sharded parameters stay the truth; the full copies are dropped.
            with torch.no_grad():
                for original in self._originals.values():
                    original.data = torch.empty(0, dtype=original.dtype, device=original.device)
            _erase_cache(self.loss_module)


def _erase_cache(loss: nn.Module) -> None:
    erase = getattr(loss, "_erase_cache", None)
    if erase is not None:
        erase()


def shard_loss(module: nn.Module, mesh) -> nn.Module:
    """The default ``parallelize_fn``: one FSDP2 group over all the loss's trainable parameters.

    The loss needs all of them at once (actor and critics enter one objective), so finer
    groups would not lower the peak; gradients and optimizer state are sharded either way.
    """
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=whole_world(mesh))
    return module


def whole_world(mesh):
    """A 1-D mesh over every rank of ``mesh``.

    Every rank feeds its own batch, so gradients must be averaged over all ranks; Fabric's
    2-D (data, tensor) mesh is flattened since the learner does no tensor parallelism.
    """
    if mesh is None or mesh.ndim == 1:
        return mesh
    return mesh[tuple(mesh.mesh_dim_names)]._flatten("fabric_learner_shard")


def check_sharded(module: ShardedLoss, world_size: int) -> None:
    """Raise at construction when the parallelize_fn's sharding would train wrongly."""
    plain = [name for name, p in module.named_loss_parameters() if not isinstance(p, DTensor)]
    narrow = [name for name, p in module.named_loss_parameters()
              if isinstance(p, DTensor) and p.device_mesh.size() != world_size]
    if narrow:
        raise RuntimeError(
            f"The strategy's parallelize_fn sharded {narrow[:4]} over a mesh of "
            f"{getattr(module, flat_name(narrow[0])).device_mesh.size()} ranks, but {world_size} ranks run: every "
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
