"""A torchrl algorithm trainer (``PPOTrainer``, ``DQNTrainer``, ...) driven by a learner.

torchrl's trainer factories (its Hydra configs) build the collector, the loss, the optimizer
and the algorithm's hooks (value estimation, replay buffer, exploration annealing, logging).
:func:`learner_trainer` keeps all of that and hands the optimisation step to a learner: the
result is a :class:`fabric_learner.Trainer` with the same collector, counters and hooks, whose
steps are ``learner.update(sub_batch)``, in one process or on many ranks.

Hooks that act on the loss's weights or on the optimizer are replaced by their learner-aware
counterparts: the value estimator runs with the learner's full weights (FSDP), the collector's
weight update is the learner's :class:`~fabric_learner.weights.PublishWeights`, the target
network update follows the learner's optimizer steps, and torchrl's optimizer hook is dropped
(the learner steps).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torchrl.trainers.algorithms.td3 import TD3OptimizationStepper
from torchrl.trainers.trainers import (
    DefaultOptimizationStepper,
    LRSchedulerHook,
    OptimizerHook,
    ReplayBufferTrainer,
    TargetNetUpdaterHook,
    UpdateWeights,
    ValueEstimatorHook,
)
from torchrl.trainers.trainers import Trainer as _TorchRLTrainer

from fabric_learner.onpolicy import LearnerValueEstimator
from fabric_learner.step.stages import Stage
from fabric_learner.trainer import Trainer

__all__ = ["learner_trainer", "optimizer_factory", "stages_of"]

# torchrl keeps each hook stage in a list; the stage name register_op() takes for each
_STAGES = {
    "_batch_process_ops": "batch_process", "_pre_optim_ops": "pre_optim_steps",
    "_process_optim_batch_ops": "process_optim_batch", "_post_loss_ops": "post_loss",
    "_process_loss_ops": "process_loss", "_optimizer_ops": "optimizer", "_post_steps_ops": "post_steps",
    "_post_optim_ops": "post_optim", "_pre_steps_log_ops": "pre_steps_log", "_post_steps_log_ops": "post_steps_log",
    "_post_optim_log_ops": "post_optim_log", "_pre_epoch_log_ops": "pre_epoch_log",
    "_post_epoch_log_ops": "post_epoch_log", "_post_optim_complete_log_ops": "post_optim_complete_log",
    "_pre_epoch_ops": "pre_epoch", "_post_epoch_ops": "post_epoch", "_setup_ops": "setup",
    "_shutdown_ops": "shutdown",
}
# the order torchrl's loop runs the stages in, so hooks land in the same relative order
_ORDER = ["_setup_ops", "_batch_process_ops", "_pre_steps_log_ops", "_pre_epoch_ops", "_pre_epoch_log_ops",
          "_pre_optim_ops", "_process_optim_batch_ops", "_post_loss_ops", "_process_loss_ops", "_optimizer_ops",
          "_post_optim_ops", "_post_optim_log_ops", "_post_epoch_ops", "_post_epoch_log_ops",
          "_post_optim_complete_log_ops", "_post_steps_ops", "_post_steps_log_ops", "_shutdown_ops"]


def optimizer_factory(optimizer: torch.optim.Optimizer) -> Callable[[Any], torch.optim.Optimizer]:
    """A factory ``params -> Optimizer`` building another optimizer like ``optimizer``.

    Same class and hyper-parameters (its ``defaults``); the learner builds it over the
    parameters it trains (after sharding, under FSDP). One parameter group only.

    Examples:
        >>> import torch
        >>> from fabric_learner.from_torchrl import optimizer_factory
        >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        >>> optimizer_factory(opt)([torch.nn.Parameter(torch.zeros(3))]).defaults["lr"]
        0.001
    """
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            f"The trainer's optimizer has {len(optimizer.param_groups)} parameter groups; a learner builds its "
            "optimizer over all the loss's parameters as one group. Give the trainer one optimizer over "
            "loss_module.parameters()."
        )
    return functools.partial(type(optimizer), **optimizer.defaults)


def policy_of(loss_module) -> torch.nn.Module | None:
    """The network a loss trains that a collector acts with (PPO/A2C: actor; DQN: value network)."""
    for name in ("actor_network", "value_network", "local_value_network"):
        module = getattr(loss_module, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def _clip_of(trainer: _TorchRLTrainer) -> float | None:
    """The norm the trainer clips gradients to (``None``: it does not clip); value clipping is refused."""
    if trainer.clip_norm is None:
        return None
    if not trainer.clip_grad_norm:
        raise NotImplementedError(
            f"The trainer clips gradients by value (clip_grad_norm=False, clip_norm={trainer.clip_norm}); a learner "
            "clips their norm only. Set clip_grad_norm=True in the trainer, or clip_norm=None.")
    return float(trainer.clip_norm)


def stages_of(trainer: _TorchRLTrainer) -> list[Stage] | None:
    """The learner stages doing what ``trainer``'s optimization stepper does (``None``: one optimizer).

    ``TD3OptimizationStepper`` becomes a critic stage on ``value_loss`` and an actor stage on
    ``actor_loss`` every ``policy_update_delay`` updates, each with an optimizer like the
    stepper's and the trainer's norm clipping, so its updates are the stepper's bit for bit.
    ``DefaultOptimizationStepper`` (CQL's) is the single-optimizer learner when it minimises all
    the loss's ``loss*`` outputs, else one stage ``"loss"`` over every trained parameter on the
    terms it selects (CQL leaves out ``loss_actor_bc``, which it only reports).

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.data import Bounded
        >>> from torchrl.modules import ValueOperator
        >>> from torchrl.objectives import TD3Loss
        >>> from torchrl.trainers import Trainer as TorchRLTrainer
        >>> from torchrl.trainers.algorithms.td3 import TD3OptimizationStepper
        >>> from fabric_learner.from_torchrl import stages_of
        >>> actor = TensorDictModule(torch.nn.Linear(3, 1), ["observation"], ["action"])
        >>> qvalue = ValueOperator(torch.nn.Linear(4, 1), in_keys=["observation", "action"])
        >>> loss = TD3Loss(actor, qvalue, action_spec=Bounded(-1.0, 1.0, shape=(1,)), num_qvalue_nets=2)
        >>> def adam(prefix):
        ...     return torch.optim.Adam([p for n, p in loss.named_parameters() if n.startswith(prefix)], lr=1e-3)
        >>> stepper = TD3OptimizationStepper(adam("actor"), adam("qvalue"), policy_update_delay=2)
        >>> trainer = TorchRLTrainer(collector=None, total_frames=0, frame_skip=1, optim_steps_per_batch=1,
        ...                          loss_module=loss, optimization_stepper=stepper, clip_norm=1.0, progress_bar=False)
        >>> [(stage.name, stage.method, stage.every, stage.clip_grad_norm) for stage in stages_of(trainer)]
        [('critic', 'value_loss', 1, 1.0), ('actor', 'actor_loss', 2, 1.0)]
    """
    stepper = getattr(trainer, "optimization_stepper", None)
    clip = _clip_of(trainer)
    if stepper is None:
        return None
    if isinstance(stepper, DefaultOptimizationStepper):
        chosen = stepper.loss_components
        produced = [str(k) for k in getattr(trainer.loss_module, "out_keys", ()) if str(k).startswith("loss")]
        if chosen is None or set(produced) <= chosen:
            return None
        if trainer.optimizer is None:
            raise ValueError(f"{type(trainer).__name__} has no optimizer to build the learner's from.")
        if not set(chosen) <= set(produced):
            raise NotImplementedError(
                f"{type(trainer).__name__}'s stepper minimises {sorted(chosen)}, but its loss declares the terms "
                f"{produced}: the learner cannot tell in which order to sum them. Select the loss's outputs instead "
                "(loss_module.select_out_keys(...)).")
        # one optimizer over every trained parameter, on the chosen terms summed in the loss's output order
        trained = sorted({n.split(".")[0] for n, p in trainer.loss_module.named_parameters() if p.requires_grad})
        return [Stage("loss", trained, optimizer_factory(trainer.optimizer),
                      loss=[k for k in produced if k in chosen], clip_grad_norm=clip)]
    if not isinstance(stepper, TD3OptimizationStepper):
        raise NotImplementedError(
            f"{type(trainer).__name__} steps its losses with a {type(stepper).__name__}, which has no learner "
            "counterpart yet (TD3's has). Drive the learner directly with stages=[Stage(...), ...]."
        )
    return [Stage("critic", "qvalue_network_params", optimizer_factory(stepper.optimizer_critic), method="value_loss",
                  clip_grad_norm=clip),
            Stage("actor", "actor_network_params", optimizer_factory(stepper.optimizer_actor), method="actor_loss",
                  every=stepper.policy_update_delay, clip_grad_norm=clip)]


def learner_trainer(trainer: _TorchRLTrainer, learner: Callable[..., Any], **overrides) -> Trainer:
    """The ``fabric_learner.Trainer`` running ``trainer``'s algorithm with a learner.

    Args:
        trainer: a torchrl trainer built by its factory (``hydra.utils.instantiate`` of a
            ``PPOTrainerConfig``, ``DQNTrainerConfig``, ...) with one optimizer over its loss.
        learner: ``(loss_module, optimizer_factory, policy=...) -> Learner``, e.g.
            ``functools.partial(FabricLearner, strategy="ddp", devices=2)``: built here on the
            trainer's loss, with an optimizer like the trainer's (see :func:`optimizer_factory`).
        **overrides: ``fabric_learner.Trainer`` arguments to use instead of the trainer's
            (``progress_bar``, ``logger``, ``save_trainer_file``, ...).

    Where the collector has ``init_random_frames``, the replay buffer stores every batch as it
    arrives, the warm-up's included (torchrl's own ``train()`` stores a batch only once it updates,
    so its off-policy trainers never see their random warm-up; otherwise both loops match).
    The trainer's norm clipping (``clip_norm`` with ``clip_grad_norm=True``) becomes the learner's
    ``clip_grad_norm`` (passed to ``learner`` unless it is a ``functools.partial`` fixing its own);
    value clipping is refused. The torchrl trainer hands its collector over (its ``collector``
    becomes ``None``), so only the returned trainer shuts it down.

    Returns:
        the trainer to ``train()``; the learner is its ``.learner``.

    Raises:
        NotImplementedError: the trainer uses something a learner cannot take over (a
            learning-rate scheduler bound to its optimizer, gradient clipping by value, ...);
            the message names it.

    Examples:
        >>> import torch
        >>> from torchrl.objectives import DQNLoss
        >>> from torchrl.trainers import Trainer as TorchRLTrainer
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.from_torchrl import learner_trainer
        >>> loss = DQNLoss(torch.nn.Linear(4, 2), action_space="categorical", delay_value=False)
        >>> original = TorchRLTrainer(collector=None, total_frames=0, frame_skip=1, optim_steps_per_batch=2,
        ...                           loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), lr=1e-3),
        ...                           progress_bar=False)
        >>> trainer = learner_trainer(original, LocalLearner)
        >>> type(trainer.learner).__name__, trainer.learner.loss_module is loss
        ('LocalLearner', True)
        >>> trainer.learner.optimizer.param_groups[0]["lr"]  # an optimizer like the trainer's
        0.001

        From a Hydra config, ``learner_trainer(instantiate(cfg.trainer),
        functools.partial(FabricLearner, strategy="ddp", devices=2)).train()``.
    """
    stages = stages_of(trainer)
    if stages is None and trainer.optimizer is None:
        raise ValueError(f"{type(trainer).__name__} has no optimizer to build the learner's from.")
    if getattr(trainer, "learner_backend", "local") != "local":
        raise ValueError("learner_trainer needs a torchrl trainer with learner_backend='local'.")
    hooks = [(attr, op, kwargs) for attr in _ORDER for op, kwargs in getattr(trainer, attr)]
    for _, op, _ in hooks:
        if isinstance(_unwrap(op), LRSchedulerHook):
            raise NotImplementedError(
                "The trainer has a learning-rate scheduler bound to its own optimizer, which the learner replaces. "
                "Leave lr_scheduler out of the trainer config and schedule learner.optimizer in a hook."
            )
    loss = trainer.loss_module
    if stages is None:
        clip = _clip_of(trainer)
        extra = {} if clip is None or _sets_clip(learner) else {"clip_grad_norm": clip}
        built = learner(loss, optimizer_factory(trainer.optimizer), policy=policy_of(loss), **extra)
    else:
        built = learner(loss, None, policy=policy_of(loss), stages=stages)
    target_updater = None
    for _, op, _ in hooks:
        if isinstance(_unwrap(op), TargetNetUpdaterHook):
            target_updater = _unwrap(op).target_params_updater
    kwargs = dict(
        learner=built, collector=trainer.collector, total_frames=trainer.total_frames,
        optim_steps_per_batch=trainer.optim_steps_per_batch, frame_skip=trainer.frame_skip, logger=trainer.logger,
        progress_bar=trainer.progress_bar, seed=trainer.seed, target_net_updater=target_updater,
        num_epochs=trainer.num_epochs, log_interval=trainer._log_interval,
        save_trainer_file=trainer.save_trainer_file, save_trainer_interval=trainer.save_trainer_interval,
        auto_log_optim_steps=trainer.auto_log_optim_steps,
    )
    kwargs.update(overrides)
    out = Trainer(**kwargs)
    if isinstance(getattr(trainer, "optimization_stepper", None), TD3OptimizationStepper):
        _write_td3_priorities(trainer, out)
    for attr, op, op_kwargs in hooks:
        hook = _unwrap(op)
        if isinstance(hook, (OptimizerHook, UpdateWeights, TargetNetUpdaterHook)):
            continue  # the learner steps; PublishWeights and the trainer's target update replace these
        if isinstance(hook, ValueEstimatorHook):
            LearnerValueEstimator(built, hook.value_estimator, stage=_STAGES[attr]).register(out)
            continue
        stage = _STAGES[attr]
        if stage == "pre_epoch" and _stores_replay(hook) and out.init_random_frames and out.num_epochs == 1:
            stage = "batch_process"  # every batch stored as it arrives, the random warm-up's too
        out.register_op(stage, _following(hook, trainer, out), **op_kwargs)
    for name, module in trainer._modules.items():
        if name not in out._modules and not isinstance(
                module, (OptimizerHook, UpdateWeights, TargetNetUpdaterHook, ValueEstimatorHook)):
            out.register_module(name, module)
    # The collector is the new trainer's now: torchrl's Trainer.__del__ would shut it down whenever
    # the old trainer is collected, mid-run or after the new trainer has already closed it.
    trainer.collector = None
    return out


def _stores_replay(hook) -> bool:
    """Whether ``hook`` is a ``ReplayBufferTrainer``'s ``extend``.

    torchrl's off-policy trainers (SAC, TD3, DDPG, DQN, IQL, CQL) register it at ``pre_epoch``, a
    stage their loop runs only once the collector's ``init_random_frames`` are past: the random
    warm-up would never reach the replay buffer. With one epoch per batch, ``batch_process`` stores
    the same batches once each, the warm-up's included, as torchrl's ``ReplayBufferTrainer.register``
    and its sota scripts do.
    """
    return getattr(hook, "__func__", None) is ReplayBufferTrainer.extend


def _sets_clip(learner: Callable[..., Any]) -> bool:
    """Whether a learner factory (a ``functools.partial``) already fixes ``clip_grad_norm``."""
    keywords = getattr(learner, "keywords", None) or {}
    return keywords.get("clip_grad_norm") is not None


def _following(hook, old: _TorchRLTrainer, new: Trainer):
    """``hook``, reading the new trainer's counters where it reads the old trainer's.

    torchrl's algorithm trainers register their own bound methods (DQN's epsilon annealing reads
    ``collected_frames``) and hooks holding the trainer (``UTDRHook`` reads ``_optim_count``);
    the old trainer's counters never move, so they are mirrored from the new one before each call.
    """
    if getattr(hook, "__self__", None) is not old and getattr(hook, "trainer", None) is not old:
        return hook

    @functools.wraps(hook)
    def mirrored(*args, **kwargs):
        old.collected_frames, old._optim_count = new.collected_frames, new._optim_count
        return hook(*args, **kwargs)

    return mirrored


def _write_td3_priorities(trainer: _TorchRLTrainer, out: Trainer) -> None:
    """After each update, replay priorities from the critic stage's ``td_error``, as TD3's stepper writes them."""
    replay_buffer = getattr(trainer, "replay_buffer", None)
    if replay_buffer is None or not hasattr(replay_buffer, "update_tensordict_priority"):
        return
    key = getattr(trainer.loss_module.tensor_keys, "priority", "td_error")

    def write(sub_batch, output) -> None:
        td_error = output.get("td_error", None)
        if td_error is not None:
            sub_batch.set(key, td_error.detach().max(0)[0])
            replay_buffer.update_tensordict_priority(sub_batch)

    out.optimization_stepper.on_output = write


def _unwrap(op):
    """The hook itself, without the timing wrapper torchrl's ``register_op`` puts around it."""
    if getattr(op, "__qualname__", "").endswith("._wrap_hook_with_timing.<locals>.timed_hook"):
        return op.__wrapped__
    return op
