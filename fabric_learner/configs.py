"""Hydra configs for the learners, registered beside torchrl's own (needs ``hydra-core``).

A torchrl trainer config (``trainer: ppo``, ``trainer: dqn``) runs on a learner, in one process
or distributed, by adding a ``learner`` to it and building the trainer with
:func:`instantiate_trainer`::

    # config.yaml: torchrl's PPO config, plus
    defaults:
      - learner: local          # or fabric; the group is registered by importing this module

    python train.py learner=fabric learner.strategy=ddp learner.devices=2 learner.accelerator=cpu
    fabric run --accelerator=cpu --strategy=ddp --devices=2 train.py learner=fabric
    torchrun --nproc-per-node=2 train.py learner=fabric

(``train.py``: ``trainer = instantiate_trainer(cfg); trainer.train()``.) Under ``fabric run`` and
``torchrun`` the launcher decides the world, as for ``FabricLearner`` itself. Tested with torchrl's
PPO, A2C, Reinforce, DQN and SAC configs (one optimizer over their loss) and TD3's (its two
optimizers become two learner stages, see :func:`fabric_learner.from_torchrl.stages_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torchrl.trainers.algorithms.configs  # noqa: F401  (registers torchrl's configs)
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fabric_learner.launch.build import DEFAULT_TIMEOUT

__all__ = ["FabricLearnerConfig", "LocalLearnerConfig", "instantiate_trainer", "register_configs"]


@dataclass
class LocalLearnerConfig:
    """Hydra config for :class:`fabric_learner.LocalLearner` (one process, plain PyTorch).

    Instantiates to a factory ``(loss_module, optimizer, policy=...) -> LocalLearner``: the loss
    comes from the trainer config.

    Args:
        optimizer: a torchrl optimizer config (``AdamConfig``, partial); ``None`` (default) takes
            the trainer config's ``optimizer``.
        clip_grad_norm: gradient-norm clipping (``None``: none).
        grad_accum_steps: micro-batches per optimizer step.
        on_nonfinite: ``"raise"`` or ``"skip"``.
        compile: ``torch.compile`` the loss forward.

    Examples:
        >>> from hydra.utils import instantiate
        >>> from fabric_learner.configs import LocalLearnerConfig
        >>> make = instantiate(LocalLearnerConfig(clip_grad_norm=1.0))
        >>> make.keywords["clip_grad_norm"]
        1.0
    """

    optimizer: Any = None
    clip_grad_norm: float | None = None
    grad_accum_steps: int = 1
    on_nonfinite: str = "raise"
    compile: bool = False
    _target_: str = "fabric_learner.LocalLearner"
    _partial_: bool = True


@dataclass
class FabricLearnerConfig(LocalLearnerConfig):
    """Hydra config for :class:`fabric_learner.FabricLearner` (any Fabric strategy and precision).

    Args:
        accelerator: ``"cpu"``, ``"gpu"``, ``"auto"``...
        strategy: ``"ddp"``, ``"fsdp"`` (FSDP2), ``"auto"``...
        devices: devices per node, or ``"auto"`` (under torchrun: the launched world).
        num_nodes: nodes.
        precision: a Fabric precision (``"32-true"``, ``"bf16-mixed"``, ...).
        timeout: seconds any collective may wait for the other ranks (``None``: torch's default).
        optimizer, clip_grad_norm, grad_accum_steps, on_nonfinite, compile: as ``LocalLearnerConfig``.

    Examples:
        >>> from hydra.utils import instantiate
        >>> from fabric_learner.configs import FabricLearnerConfig
        >>> make = instantiate(FabricLearnerConfig(strategy="ddp", devices=2))
        >>> make.keywords["strategy"], make.keywords["devices"]
        ('ddp', 2)
    """

    accelerator: str = "auto"
    strategy: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    timeout: float | None = DEFAULT_TIMEOUT.total_seconds()
    _target_: str = "fabric_learner.FabricLearner"


def register_configs(store: ConfigStore | None = None) -> None:
    """Register ``learner: local`` and ``learner: fabric`` in Hydra's ConfigStore (done on import).

    Args:
        store (ConfigStore, optional): the store to register in (default: Hydra's instance).

    Examples:
        >>> from hydra.core.config_store import ConfigStore
        >>> from fabric_learner.configs import register_configs
        >>> register_configs()
        >>> sorted(ConfigStore.instance().list("learner"))
        ['fabric.yaml', 'local.yaml']
    """
    store = store or ConfigStore.instance()
    store.store(group="learner", name="local", node=LocalLearnerConfig)
    store.store(group="learner", name="fabric", node=FabricLearnerConfig)


def instantiate_trainer(cfg: DictConfig, **overrides):
    """Build ``cfg.trainer`` (a torchrl trainer config); with a ``cfg.learner``, on that learner.

    Without a learner (``learner: null``) this is ``hydra.utils.instantiate(cfg.trainer)``,
    torchrl's trainer as it is. With one, the torchrl trainer is built first (collector, loss,
    optimizer, hooks), then driven by the learner: see
    :func:`fabric_learner.from_torchrl.learner_trainer`.

    Args:
        cfg: the composed config, with ``trainer`` and optionally ``learner``.
        **overrides: ``fabric_learner.Trainer`` arguments to use instead of the config's.

    Examples:
        >>> @hydra.main(config_path="config", config_name="config", version_base="1.3")  # doctest: +SKIP
        ... def main(cfg):
        ...     instantiate_trainer(cfg).train()
    """
    from fabric_learner.from_torchrl import learner_trainer

    learner_cfg = cfg.get("learner")
    trainer = instantiate(cfg.trainer)
    if learner_cfg is None:
        return trainer
    learner_cfg = OmegaConf.to_container(learner_cfg, resolve=True)
    optimizer_cfg = learner_cfg.pop("optimizer", None)
    make = instantiate(learner_cfg)
    if optimizer_cfg is not None:
        optimizer = instantiate(optimizer_cfg)

        def make_learner(loss, _trainer_optimizer, **kwargs):
            if kwargs.get("stages"):
                raise ValueError(
                    "learner.optimizer replaces the trainer's one optimizer, but this trainer steps several (TD3's "
                    "actor and critic); set them in the trainer config (optimizer, or optimizer_actor and "
                    "optimizer_critic) and leave learner.optimizer unset.")
            return make(loss, lambda params: optimizer(params=params), **kwargs)

        return learner_trainer(trainer, make_learner, **overrides)
    return learner_trainer(trainer, make, **overrides)


register_configs()
