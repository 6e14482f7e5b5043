"""What every backend answers for ``FabricLearner``, and what the learner hands it to answer.

A backend owns the placement of the loss's parameters (replicated or sharded): how the loss is
set up under Fabric, its optimizer, full weights, model and optimizer state, and checkpoints on
disk. It never reads the learner: the set-up arrives as a ``Setup``, a save's counters as
``Counters``, and a load in place hands back ``Resumed`` for the learner to apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from tensordict import TensorDictBase
from torch import nn


@dataclass(frozen=True)
class Setup:
    """What a backend is built from: Fabric (launched), the loss and how the learner runs it.

    Examples:
        >>> from lightning.fabric import Fabric
        >>> from fabric_learner.backends import ReplicatedBackend, Setup
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> setup = Setup(Fabric(accelerator="cpu", devices=1), loss, optimizer=None, convert=None, call=None,
        ...               compile=False, policy=net, stages=())
        >>> backend = ReplicatedBackend(setup)  # optimizer=None: Adam over the loss's parameters
        >>> type(backend.optimizer.optimizer).__name__
        'Adam'
    """

    fabric: Any
    loss_module: nn.Module
    optimizer: Any  # an Optimizer, a factory params -> Optimizer, or None
    convert: Any  # the precision plugin's input conversion, or None
    call: Any  # the loss through torch.compile (CompiledLoss), or None: call the loss
    compile: bool
    policy: nn.Module | None
    stages: Sequence[Any]


@dataclass(frozen=True)
class Counters:
    """What a checkpoint records of the learner beside the model and optimizer state.

    Examples:
        >>> import os, tempfile, torch
        >>> from pathlib import Path
        >>> from lightning.fabric import Fabric
        >>> from fabric_learner.backends import Counters, ReplicatedBackend, Setup
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> backend = ReplicatedBackend(Setup(Fabric(accelerator="cpu", devices=1), loss, None, None, None,
        ...                                   compile=False, policy=net, stages=()))
        >>> names = [name for name, _ in backend.named_parameters()]
        >>> counters = Counters(num_updates=3, accum_step=0, param_names=names, optimizer_param_names=names, rng=[])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     backend.save(Path(folder) / "learner.ckpt", counters, blocking=True)
        ...     torch.load(os.path.join(folder, "learner.ckpt"), weights_only=True)["num_updates"]
        3
    """

    num_updates: int
    accum_step: int
    param_names: list[str] | dict[str, list[str]]  # pairs moments with parameters (per stage when staged)
    optimizer_param_names: list[str]  # the optimizer's parameters in index order, all stages together
    rng: list[dict[str, torch.Tensor]]  # every rank's generator states, in rank order


@dataclass(frozen=True)
class Resumed:
    """A checkpoint a backend loaded in place: the counters the learner resumes from.

    Examples:
        >>> from fabric_learner.backends import Resumed
        >>> Resumed(num_updates=3, accum_step=0, rng=None)
        Resumed(num_updates=3, accum_step=0, rng=None)

        A sharded backend's ``load_folder`` returns one after every rank has read its shards into
        place; a replicated backend returns the whole checkpoint instead, for the learner to load.
    """

    num_updates: int
    accum_step: int
    rng: Any


class Backend(Protocol):
    """The placement of a loss's parameters under one family of Fabric strategies.

    Examples:
        ``FabricLearner`` picks the backend from its strategy and builds it from a ``Setup``:

        >>> from lightning.fabric import Fabric
        >>> from fabric_learner.backends import Setup, backend_for
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> fabric = Fabric(accelerator="cpu", devices=1)
        >>> backend = backend_for(fabric.strategy)(Setup(fabric, loss, None, None, None, compile=False, policy=net,
        ...                                              stages=()))
        >>> type(backend).__name__, backend.sharded, backend.sharded_module
        ('ReplicatedBackend', False, None)
        >>> backend.model_shapes()
        {'value_network_params.module.0.module.weight': (2, 4), 'value_network_params.module.0.module.bias': (2,)}
        >>> sorted(backend.get_weights(net, cpu_offload=True).keys())
        ['bias', 'weight']
    """

    sharded: ClassVar[bool]
    module: nn.Module  # what the learner's forward calls (Fabric's wrapper of the loss)
    optimizer: Any  # Fabric's optimizer, or the stages' (StageOptimizers)
    sharded_module: nn.Module | None  # the ShardedLoss holding the shards, or None

    @classmethod
    def refuse(cls, optimizer: Any, compile: bool) -> None:
        """Raise, before any rank is launched, for arguments this placement cannot honour."""

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained parameters, named as in the loss."""

    def full_parameters(self) -> contextlib.AbstractContextManager: ...

    def weights_changed(self) -> None:
        """After an optimizer step or a load: refresh what runs outside ``update``."""

    def serve(self, module: nn.Module) -> bool: ...

    def served_parameters(self) -> set[int]: ...

    def get_weights(self, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase: ...

    def model_state(self) -> dict[str, Any]: ...

    def model_shapes(self) -> dict[str, tuple]: ...

    def load_model_state(self, state: Mapping[str, Any]) -> None: ...

    def optimizer_state(self, param_names) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: Mapping[str, Any], param_names) -> None: ...

    def save(self, path: Path, counters: Counters, blocking: bool) -> Future | None:
        """Write a checkpoint (a collective); a future when written in the background."""

    def load_folder(self, path: Path) -> Mapping[str, Any] | Resumed:
        """Read a sharded folder: a whole checkpoint for the learner to load, or ``Resumed`` after loading
        it in place."""


def setup_stage_optimizers(fabric: Any, stages: Sequence[Any], named_parameters) -> Any:
    """Each stage's optimizer over its parameters (``named_parameters``: loss names), set up by Fabric."""
    from fabric_learner.step.stages import StageOptimizers, build_stage_optimizers

    built = build_stage_optimizers(stages, named_parameters)
    wrapped = fabric.setup_optimizers(*built.values())
    wrapped = wrapped if isinstance(wrapped, (tuple, list)) else (wrapped,)
    return StageOptimizers(dict(zip(built, wrapped)))
