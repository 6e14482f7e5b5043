"""FabricLearner: the Learner step with placement, wrapping, precision and sync left to Fabric."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from torch import nn

from fabric_learner._batch import Carrier, LossForwarder
from fabric_learner._checkpoint import FORMAT, check_format
from fabric_learner._launch import build_fabric, launch
from fabric_learner._optim import OptimizerLike, build_optimizer
from fabric_learner.learner import Capabilities, Learner


class FabricLearner(Learner):
    """The Learner contract on any Fabric strategy, precision and device.

    Building it launches the other ranks when needed (as ``fabric.launch()`` does) and returns
    on every rank with the learner ready; under ``fabric run`` or ``torchrun`` it picks the
    settings up from the launcher. Every rank feeds ``update`` its own local batch.
    """

    def __init__(
        self,
        loss_module: nn.Module,
        optimizer: OptimizerLike = None,
        *,
        policy: nn.Module | None = None,
        clip_grad_norm: float | None = None,
        grad_accum_steps: int = 1,
        accelerator: str = "auto",
        strategy: Any = "auto",
        devices: Any = "auto",
        num_nodes: int = 1,
        precision: Any = "32-true",
        fabric: Fabric | None = None,
    ) -> None:
        super().__init__(loss_module, policy=policy, clip_grad_norm=clip_grad_norm, grad_accum_steps=grad_accum_steps)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
            raise TypeError(
                f"optimizer must be None, a torch.optim.Optimizer or a callable params -> Optimizer, "
                f"got {type(optimizer).__name__}."
            )
        if fabric is None:
            fabric = build_fabric(
                accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision
            )
        launch(fabric)
        object.__setattr__(self, "fabric", fabric)
        plugin = fabric.strategy.precision
        convert = plugin.convert_input if type(plugin).convert_input is not Precision.convert_input else None
        object.__setattr__(self, "_precision", plugin)
        forwarder = LossForwarder(loss_module, fabric.device, convert)
        if isinstance(optimizer, torch.optim.Optimizer):
            module, opt = fabric.setup(forwarder, optimizer)
        else:
            module = fabric.setup_module(forwarder)
            opt = fabric.setup_optimizers(build_optimizer(optimizer, module.parameters()))
        object.__setattr__(self, "_module", module)
        self.optimizer = opt
        self.capabilities = Capabilities(sharded=False, distributed=fabric.world_size > 1)

    # ---- the step, through Fabric ---------------------------------------------------------

    def _forward(self, batch):
        carried, _ = self._module(Carrier(batch))
        return carried.value

    def _backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(self._precision.convert_output(loss), model=self._module)

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        if sync or isinstance(self.fabric.strategy, SingleDeviceStrategy):
            return contextlib.nullcontext()
        return self.fabric.no_backward_sync(self._module, enabled=True)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return self.fabric.clip_gradients(self._module, self.optimizer, max_norm=max_norm, error_if_nonfinite=False)

    def update(self, batch):
        result = super().update(batch)
        plugin = self._precision
        if type(plugin).convert_output is not Precision.convert_output:
            result = result.apply(plugin.convert_output)  # reported values in the default dtype
        return result

    # ---- attributes -----------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    # ---- checkpoints on disk --------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the learner's state with ``fabric.save`` (atomic; every rank must call it)."""
        state = self._live_state()
        self.fabric.save(path, {"format": FORMAT, "model": self.loss_module, "optimizer": self.optimizer,
                                "accum_step": state["accum_step"], "num_updates": state["num_updates"]})

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by any learner (``weights_only``: no code is unpickled)."""
        state = self.fabric.load(path, weights_only=True)
        check_format(state, path)
        self.load_checkpoint(state)
