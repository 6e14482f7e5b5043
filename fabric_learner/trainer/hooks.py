"""Trainer hooks: the optimisation step as one ``learner.update``, target-network updates,
and logging hooks whose values are taken over every rank's data."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.trainers import LogScalar, OptimizationStepper, TrainerHookBase

from fabric_learner.collectives import all_reduce

__all__ = ["GlobalLogScalar", "LearnerStepper", "LogThroughput"]


# ---- the step -----------------------------------------------------------------------------------


class LearnerStepper(OptimizationStepper):
    """One torchrl optimisation step = one ``learner.update(sub_batch)``, then the ``post_loss`` hooks.

    With ``max_tokens`` (an LLM loss) the step is ``update_by_tokens(learner, sub_batch, max_tokens)``:
    the sub-batch cut into micro-batches of at most that many padded tokens, one optimizer step.

    The learner forwards the loss, sums its ``"loss"`` entries, backpropagates (synchronising
    gradients across ranks), clips and steps. ``post_loss`` hooks then see the minibatch as the
    loss left it (DQN's ``td_error`` for priority updates). Its state lives in the learner.

    Examples:
        ``Trainer`` installs it as its ``optimization_stepper``:

        >>> from fabric_learner import LocalLearner, Trainer
        >>> from fabric_learner.testing import dqn_example
        >>> from fabric_learner.trainer import LearnerStepper
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, policy=net)
        >>> trainer = Trainer(learner=learner, collector=None, total_frames=0, optim_steps_per_batch=1,
        ...                   progress_bar=False)
        >>> stepper = trainer.optimization_stepper
        >>> isinstance(stepper, LearnerStepper), sorted(stepper.step(trainer, batch).keys())
        (True, ['grad_norm', 'loss'])
        >>> stepper.optimizer_step_count, learner.num_updates
        (1, 1)
    """

    def __init__(self, learner, *, max_tokens: int | None = None) -> None:
        self.learner = learner
        self.max_tokens = max_tokens  # cut each sub-batch by tokens (fabric_learner.llm.update_by_tokens)
        # ``(sub_batch, output) -> None`` run before the ``post_loss`` hooks (TD3's priority write-back)
        self.on_output = None

    def step(self, trainer, sub_batch: TensorDictBase) -> TensorDictBase:
        if self.max_tokens is None:
            out = self.learner.update(sub_batch)
        else:
            from fabric_learner.llm import update_by_tokens

            out = update_by_tokens(self.learner, sub_batch, self.max_tokens)
        if self.on_output is not None:
            self.on_output(sub_batch, out)
        trainer._post_loss_hook(sub_batch)
        return out

    @property
    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (``UpdateWeights(interval_unit="optim_steps")`` reads this)."""
        return self.learner.num_updates

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return


class _TargetNetUpdate(TrainerHookBase):
    """Steps a torchrl ``TargetNetUpdater`` once per optimizer step (not per accumulation micro-step)."""

    def __init__(self, updater, learner) -> None:
        self.updater, self.learner = updater, learner
        self._last = learner.num_updates

    def __call__(self) -> None:
        steps = self.learner.num_updates - self._last
        if steps <= 0:
            return
        # A sharded learner keeps the loss's own parameter objects empty outside update(); the
        # updater reads them, so they hold the gathered weights for the call (a collective).
        with _full_parameters(self.learner):
            for _ in range(steps):
                self.updater.step()
        self._last = self.learner.num_updates

    def state_dict(self) -> dict[str, Any]:
        state = self.updater.state_dict() if hasattr(self.updater, "state_dict") else {}
        return {"updater": state, "last": self._last}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if hasattr(self.updater, "load_state_dict"):
            self.updater.load_state_dict(state_dict.get("updater", {}))
        self._last = int(state_dict.get("last", self.learner.num_updates))

    def register(self, trainer, name: str = "target_net_updater") -> None:
        trainer.register_op("post_optim", self)
        trainer.register_module(name, self)


def _full_parameters(learner):
    """Inside the block the loss's modules hold the full weights (a collective when sharded; for a
    ``RemoteLearner`` the group's weights, and what the block changes goes back to its ranks)."""
    if not learner.capabilities.sharded and not trains_elsewhere(learner):
        return contextlib.nullcontext()
    return learner.full_parameters()


def trains_elsewhere(learner) -> bool:
    """Whether the loss's modules in this process are a copy the learner does not train (``RemoteLearner``)."""
    from fabric_learner.remote.learner import RemoteLearner

    return isinstance(learner, RemoteLearner)



class GlobalLogScalar(LogScalar):
    """torchrl's ``LogScalar`` over every rank's batch: all-reduced sums, counts, minima, maxima.

    A collective at ``pre_steps_log``: every rank must register it (they all run the same
    program). Logs e.g. the mean reward of all ranks' rollouts, not just rank 0's.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fabric_learner.trainer import GlobalLogScalar
        >>> hook = GlobalLogScalar(("next", "reward"), logname="r_training")
        >>> batch = TensorDict(next=TensorDict(reward=torch.tensor([[1.0], [3.0], [5.0]]), batch_size=[3]),
        ...                    batch_size=[3])
        >>> hook(batch)  # one process: this batch's mean and standard deviation
        {'r_training': 3.0, 'log_pbar': False, 'r_training_std': 2.0}

        On N ranks every rank logs the same values, taken over the N batches together.
    """

    def __call__(self, batch: TensorDictBase) -> dict:
        tensor = batch.get(self.key)
        if ("collector", "mask") in batch.keys(True):
            tensor = tensor[batch.get(("collector", "mask"))]
        t = tensor.detach().to(torch.float64)
        if self.reduction in ("mean", "sum"):
            stats = all_reduce(torch.stack([t.sum(), (t * t).sum(), torch.tensor(float(t.numel()), dtype=torch.float64)]))
            total, sq, n = stats.tolist()
            value = total / max(n, 1.0) if self.reduction == "mean" else total
        else:
            value = all_reduce(t.min() if self.reduction == "min" else t.max(), self.reduction).item()
            n = 0.0
        result = {self.logname: float(value), "log_pbar": self.log_pbar}
        if self.include_std and self.reduction in ("mean", "sum") and n > 1:
            mean = total / n
            result[f"{self.logname}_std"] = math.sqrt(max(sq - n * mean * mean, 0.0) / (n - 1))
        return result


class LogThroughput(TrainerHookBase):
    """Logs global frames per second and optimizer updates per second (``post_steps_log``).

    Examples:
        ``Trainer`` registers one unless built with ``log_throughput=False``; by hand:

        >>> from fabric_learner import LocalLearner, Trainer
        >>> from fabric_learner.testing import dqn_example
        >>> from fabric_learner.trainer import LogThroughput
        >>> loss, net, _ = dqn_example()
        >>> trainer = Trainer(learner=LocalLearner(loss, policy=net), collector=None, total_frames=0,
        ...                   optim_steps_per_batch=1, progress_bar=False, log_throughput=False)
        >>> hook = LogThroughput(trainer)
        >>> hook()  # the first call starts the clock
        {}
        >>> sorted(hook())  # rates since the previous call
        ['fps', 'log_pbar', 'updates_per_s']
    """

    def __init__(self, trainer, log_pbar: bool = True) -> None:
        self.trainer, self.log_pbar = trainer, log_pbar
        self._t0: float | None = None
        self._frames0 = 0
        self._updates0 = 0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._frames0 = self.trainer.collected_frames
        self._updates0 = self.trainer.learner.num_updates

    def __call__(self, batch=None) -> dict:
        if self._t0 is None:
            self.start()
            return {}
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        frames, updates = self.trainer.collected_frames, self.trainer.learner.num_updates
        out = {"fps": (frames - self._frames0) / dt, "updates_per_s": (updates - self._updates0) / dt,
               "log_pbar": self.log_pbar}
        self._t0, self._frames0, self._updates0 = now, frames, updates
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return

    def register(self, trainer, name: str = "log_throughput") -> None:
        trainer.register_op("setup", self.start)
        trainer.register_op("post_steps_log", self)
        trainer.register_module(name, self)
