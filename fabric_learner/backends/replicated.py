"""One device and DDP: every rank holds the whole loss, Fabric wraps it and syncs gradients.

The loss's own parameters are the trained ones, so a collector running the policy the loss
trains acts with the newest weights with no copy, and checkpoints are one file written by
rank 0 through ``fabric.save`` (atomically, see ``checkpoint.files.AtomicCheckpointIO``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from tensordict import TensorDictBase
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric_learner.checkpoint import sharded as sharded_files
from fabric_learner._carrier import LossForwarder
from fabric_learner._compat import wrapped_forward
from fabric_learner.checkpoint.files import FORMAT, AtomicCheckpointIO, overwrite_error
from fabric_learner._compile import fused_adam
from fabric_learner.optim import build_optimizer
from fabric_learner._stages import StageOptimizers, build_stage_optimizers
from fabric_learner.learner import plain_weights


class ReplicatedBackend:
    """The loss behind Fabric's module wrapper (DDP or none), its optimizer set up by Fabric."""

    sharded = False
    sharded_module = None

    def __init__(self, fabric, loss_module: nn.Module, optimizer, convert, call, compile: bool, stages=()) -> None:
        if type(fabric.strategy.checkpoint_io) is TorchCheckpointIO:  # a custom one is the user's
            fabric.strategy.checkpoint_io = AtomicCheckpointIO()
        self.fabric, self.loss_module = fabric, loss_module
        wrapper = LossForwarder(loss_module, fabric.device, convert, call=call)
        if stages:
            self.module = fabric.setup_module(wrapper)
            built = build_stage_optimizers(stages, loss_module.named_parameters())
            wrapped = fabric.setup_optimizers(*built.values())
            wrapped = wrapped if isinstance(wrapped, (tuple, list)) else (wrapped,)
            self.optimizer = StageOptimizers(dict(zip(built, wrapped)))
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.module, self.optimizer = fabric.setup(wrapper, optimizer)
        else:
            self.module = fabric.setup_module(wrapper)
            default = fused_adam if compile and optimizer is None else optimizer
            self.optimizer = fabric.setup_optimizers(build_optimizer(default, self.module.parameters()))
        # the output's tensors go unread by the bare forwarder and by DDP without find_unused_parameters
        # (static_graph is refused); any other wrapper keeps them
        inner = wrapped_forward(self.module)
        wrapper.expose_leaves = not (inner is wrapper or (
            type(inner) is DistributedDataParallel and not inner.find_unused_parameters))

    def named_parameters(self):
        return self.loss_module.named_parameters()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self.loss_module)

    def weights_changed(self) -> None:
        """Nothing to refresh: modules outside ``update`` use the trained parameters themselves."""

    def serve(self, module: nn.Module) -> bool:
        ours = {id(p) for p in self.loss_module.parameters()}
        return any(id(p) in ours for p in module.parameters())

    def served_parameters(self) -> set[int]:
        return {id(p) for p in self.loss_module.parameters()}

    def get_weights(self, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase:
        return plain_weights(self.loss_module, policy, cpu_offload)

    def model_state(self) -> dict[str, Any]:
        return self.loss_module.state_dict()

    def model_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.loss_module.state_dict(keep_vars=True).items()}

    def load_model_state(self, state) -> None:
        self.loss_module.load_state_dict(state, strict=True)

    def optimizer_state(self, param_names: list[str]) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state, param_names: list[str]) -> None:
        self.optimizer.load_state_dict(state)

    def save(self, learner, path: Path) -> None:
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder; a single-file checkpoint would replace it. Pass a file path.")
        error = overwrite_error(path) if learner.global_rank == 0 else None
        if learner.world_size > 1:  # rank 0 writes, so its answer holds for every rank
            error = self.fabric.broadcast(error, src=0)
        if error is not None:
            raise FileExistsError(error)
        # Fabric turns the module into a state dict itself; the rest is Learner._live_state's
        self.fabric.save(path, {"format": FORMAT, "model": self.loss_module, "optimizer": learner._optimizer_state(),
                                "param_names": learner._saved_param_names(), "accum_step": learner._accum_step,
                                "num_updates": learner.num_updates, "rng": learner._rng_states()})

    def load_folder(self, learner, path: Path) -> None:
        """A sharded checkpoint, read whole into this process (every rank reads it)."""
        learner.load_checkpoint(sharded_files.read_full(path))
