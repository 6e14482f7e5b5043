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

from fabric_learner.backends.base import Counters, Setup, setup_stage_optimizers
from fabric_learner.checkpoint import dcp_folder
from fabric_learner.checkpoint.files import FORMAT, AtomicCheckpointIO, overwrite_error
from fabric_learner.checkpoint.frozen import frozen_keys, without_frozen
from fabric_learner.learner import holds_trained, plain_weights
from fabric_learner.optim import build_optimizer, check_no_frozen
from fabric_learner.step.carrier import LossForwarder
from fabric_learner.step.compile import fused_adam
from fabric_learner.utils.compat import wrapped_forward


def match_bucket_strides(parameters) -> int:
    """Give each gradient its parameter's strides where they differ only on size-1 dimensions.

    DDP copies each gradient into a bucket view laid out with its parameter's strides and warns
    ("Grad strides do not match bucket view strides") when the strides differ, even on a size-1
    dimension, where the layouts hold the same elements at the same addresses. torchrl's stacked
    ensembles (TD3's and SAC's two critics: a ``(2, 1, 16)`` weight with strides ``(16, 16, 1)``)
    get gradients with strides ``(16, 1, 1)`` from their vmapped backward. Re-striding such a
    gradient is a free view, so autograd stores it as it is and DDP's copy then matches. Returns
    how many parameters got the hook (only those with a size-1 dimension can need it).
    """
    hooked = 0
    for param in parameters:
        if param.requires_grad and param.dim() > 1 and 1 in param.shape and param.is_contiguous():
            param.register_hook(_restride_to(param.stride()))
            hooked += 1
    return hooked


def _restride_to(stride: tuple[int, ...]):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        own = grad.stride() if grad.layout is torch.strided else stride
        if own == stride or any(a != b for n, a, b in zip(grad.shape, own, stride) if n != 1):
            return grad  # already matching, or a genuinely different layout (autograd copies it)
        return grad.as_strided(grad.shape, stride, grad.storage_offset())

    return hook


class ReplicatedBackend:
    """The loss behind Fabric's module wrapper (DDP or none), its optimizer set up by Fabric.

    Examples:
        >>> import torch
        >>> from lightning.fabric import Fabric
        >>> from fabric_learner.backends import ReplicatedBackend, Setup
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> backend = ReplicatedBackend(Setup(Fabric(accelerator="cpu", devices=1), loss,
        ...                                   lambda params: torch.optim.SGD(params, lr=0.1), None, None,
        ...                                   compile=False, policy=net, stages=()))
        >>> backend.serve(net)  # the policy runs on the trained parameters themselves: nothing to copy
        True
        >>> with backend.full_parameters() as whole:
        ...     whole is loss
        True

        Under ``strategy="ddp"`` with N ranks each holds the same whole loss behind DDP's wrapper.
    """

    sharded = False
    sharded_module = None

    @classmethod
    def refuse(cls, optimizer: Any, compile: bool) -> None:
        """Every optimizer form and ``compile`` work here."""

    def __init__(self, setup: Setup) -> None:
        fabric, loss_module, optimizer = setup.fabric, setup.loss_module, setup.optimizer
        if type(fabric.strategy.checkpoint_io) is TorchCheckpointIO:  # a custom one is the user's
            fabric.strategy.checkpoint_io = AtomicCheckpointIO()
        self.fabric, self.loss_module = fabric, loss_module
        wrapper = LossForwarder(loss_module, fabric.device, setup.convert, call=setup.call)
        if setup.stages:
            self.module = fabric.setup_module(wrapper)
            self.optimizer = setup_stage_optimizers(fabric, setup.stages, loss_module.named_parameters())
        elif isinstance(optimizer, torch.optim.Optimizer):
            check_no_frozen(optimizer)
            self.module, self.optimizer = fabric.setup(wrapper, optimizer)
        else:
            self.module = fabric.setup_module(wrapper)
            default = fused_adam if setup.compile and optimizer is None else optimizer
            self.optimizer = fabric.setup_optimizers(build_optimizer(default, self.module.parameters()))
        # the output's tensors go unread by the bare forwarder and by DDP without find_unused_parameters
        # (static_graph is refused); any other wrapper keeps them
        inner = wrapped_forward(self.module)
        wrapper.expose_leaves = not (inner is wrapper or (
            type(inner) is DistributedDataParallel and not inner.find_unused_parameters))
        if isinstance(inner, DistributedDataParallel):
            match_bucket_strides(loss_module.parameters())

    def named_parameters(self):
        return self.loss_module.named_parameters()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self.loss_module)

    def weights_changed(self) -> None:
        """Nothing to refresh: modules outside ``update`` use the trained parameters themselves."""

    def serve(self, module: nn.Module) -> bool:
        return holds_trained(self.loss_module, module)

    def served_parameters(self) -> set[int]:
        return {id(p) for p in self.loss_module.parameters()}

    def get_weights(self, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase:
        return plain_weights(self.loss_module, policy, cpu_offload)

    def model_state(self) -> dict[str, Any]:
        """The loss's state without its frozen parameters (see ``checkpoint.frozen``)."""
        return without_frozen(self.loss_module.state_dict(), frozen_keys(self.loss_module))

    def model_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.loss_module.state_dict(keep_vars=True).items()}

    def load_model_state(self, state) -> None:
        self.loss_module.load_state_dict(state, strict=True)

    def optimizer_state(self, param_names: list[str]) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state, param_names: list[str]) -> None:
        self.optimizer.load_state_dict(state)

    def save(self, path: Path, counters: Counters, blocking: bool = True) -> None:
        """Rank 0 writes one file (atomically); ``blocking`` has nothing to overlap here."""
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder; a single-file checkpoint would replace it. Pass a file path.")
        fabric = self.fabric
        error = overwrite_error(path) if fabric.global_rank == 0 else None
        if fabric.world_size > 1:  # rank 0 writes, so its answer holds for every rank
            error = fabric.broadcast(error, src=0)
        if error is not None:
            raise FileExistsError(error)
        # Fabric turns the module into a state dict itself; the rest is what Learner.checkpoint holds
        fabric.save(path, {"format": FORMAT, "model": self.model_state(),
                           "optimizer": self.optimizer_state(counters.param_names),
                           "param_names": counters.param_names, "accum_step": counters.accum_step,
                           "num_updates": counters.num_updates, "rng": counters.rng})

    def load_folder(self, path: Path) -> dict[str, Any]:
        """A sharded checkpoint, read whole into this process (every rank reads it)."""
        return dcp_folder.read_full(path)
