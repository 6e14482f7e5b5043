"""LocalLearner: the single-process reference every other backend is tested against."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import nn

from fabric_learner.checkpoint.dcp_folder import is_sharded_checkpoint, read_full
from fabric_learner.checkpoint.files import atomic_torch_save, file_state, naming, overwrite_error, read_learner_file
from fabric_learner.learner import Capabilities, Learner, clipped_norm
from fabric_learner.optim import OptimizerLike, build_optimizer, optimizer_params
from fabric_learner.step.compile import fused_adam
from fabric_learner.step.stages import Stage, StageOptimizers, build_stage_optimizers


class LocalLearner(Learner):
    """The Learner step in plain PyTorch: no Fabric, no process group, no device moves.

    The reference the other backends are tested against: ``FabricLearner`` on N ranks, each
    fed its share of a batch, reaches the weights this learner reaches on the whole batch.

    Args:
        loss_module (nn.Module): a torchrl loss, or any module returning a TensorDict whose
            ``"loss*"`` entries are summed and backpropagated.
        optimizer: an optimizer instance, a factory ``f(params)`` or ``None`` (Adam over the
            loss's parameters, fused with ``compile=True``).

    Keyword Args:
        policy (nn.Module, optional): the module the loss trains that collectors run;
            ``get_weights`` is then laid out as ``TensorDict.from_module(policy)``.
        clip_grad_norm (float, optional): clip the gradients' total norm before each step.
        grad_accum_steps (int): micro-batches per optimizer step (default 1).
        on_nonfinite (str): ``"raise"`` (default) or ``"skip"`` a step whose loss or grad norm
            is not finite.
        compile (bool): run the loss forward through ``torch.compile``.
        stages (list of Stage, optional): several optimizers, each over part of the loss and
            with its own loss method (then ``optimizer=None``).

    Raises:
        TypeError, ValueError: a bad argument, named with its fix, before anything is built.

    Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()  # DQNLoss(nn.Linear(4, 2), ...) and 8 transitions
        >>> learner = LocalLearner(loss, lambda params: torch.optim.Adam(params, lr=1e-3), policy=net,
        ...                        clip_grad_norm=1.0)
        >>> sorted(learner.update(batch).keys())
        ['grad_norm', 'loss']
        >>> learner.num_updates, learner.world_size
        (1, 1)
    """

    capabilities = Capabilities(sharded=False, distributed=False)

    def __init__(
        self,
        loss_module: nn.Module,
        optimizer: OptimizerLike = None,
        *,
        policy: nn.Module | None = None,
        clip_grad_norm: float | None = None,
        grad_accum_steps: int = 1,
        on_nonfinite: str = "raise",
        compile: bool = False,
        stages: Sequence[Stage] | None = None,
    ) -> None:
        super().__init__(loss_module, policy=policy, clip_grad_norm=clip_grad_norm, grad_accum_steps=grad_accum_steps,
                         on_nonfinite=on_nonfinite, compile=compile, stages=stages)
        if stages is not None:
            if optimizer is not None:
                raise ValueError("With stages=, each Stage builds its own optimizer; pass optimizer=None.")
            self.optimizer = StageOptimizers(build_stage_optimizers(stages, loss_module.named_parameters()))
            return
        default = fused_adam if compile and optimizer is None else optimizer
        self.optimizer = build_optimizer(default, loss_module.parameters())

    def _forward(self, batch, method=None):
        if method is not None:
            return getattr(self.loss_module, method)(batch)
        return self._loss_call(batch)

    def _backward(self, loss: torch.Tensor, seed: torch.Tensor) -> None:
        loss.backward(seed)

    def _clip_gradients(self, max_norm: float, optimizer=None) -> torch.Tensor:
        # torch's default kernel choice, as a hand-written loop and Fabric's clip_gradients use:
        # forcing foreach measured a few percent slower per PPO update on CPU
        return clipped_norm(optimizer_params(optimizer or self.optimizer), max_norm)

    def save(self, path: str | os.PathLike, blocking: bool = True) -> Future | None:
        """Write ``checkpoint()`` to ``path`` atomically (the same file format as FabricLearner).

        Replaces only a checkpoint this package wrote: any other file at ``path`` raises
        ``FileExistsError`` before anything is written. ``blocking=False`` saves synchronously
        too (one process has no shards to write in the background) and returns a finished future.
        """
        error = overwrite_error(path)
        if error is not None:
            raise FileExistsError(error)
        atomic_torch_save(file_state(self._live_state()), path)
        return None if blocking else self._track_save(path, None)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by any learner; never unpickles code."""
        with naming(path):
            self.load_checkpoint(read_full(path) if is_sharded_checkpoint(path) else read_learner_file(path))
