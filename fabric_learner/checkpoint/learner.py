"""The Learner's checkpoints: ``checkpoint``/``load_checkpoint`` in memory, ``save``/``load`` on disk.

``LearnerCheckpoints`` is a base of ``Learner``: what a checkpoint holds (the loss's state without its
frozen parameters, the optimizer's state paired by parameter name, the counters, every rank's random
state), its validation before anything changes, and the resume of the counters after a load. A backend
gives the parts that differ (``_model_state``, ``_load_model_state``, ``_rng_states``, ``save``, ``load``,
...); the format itself is ``checkpoint.learner_state``, ``checkpoint.validate`` and ``checkpoint.files``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from fabric_learner.checkpoint import learner_state
from fabric_learner.checkpoint.frozen import frozen_keys, without_frozen
from fabric_learner.checkpoint.validate import check_checkpoint, clone_state
from fabric_learner.step import rng as _rng


class LearnerCheckpoints:
    """The checkpoint side of ``Learner``: reads the learner's ``loss_module``, ``optimizer``, ``stages``, counters,
    rank and world size, ``_pending_save`` and the backend's state hooks."""

    def checkpoint(self) -> dict[str, Any]:
        """The learner's state in memory: every tensor cloned, nothing aliasing live state.

        Holds the loss's ``state_dict`` (``"model"``) without its frozen parameters (a LoRA model's
        base: see ``checkpoint.frozen``), the optimizer's state with the parameter names it pairs
        with, the update counters and every rank's random state; restore it with
        :meth:`load_checkpoint` into a learner of any backend. A collective on sharded learners.

        Returns:
            A dict of tensors and plain containers (weights-only loadable).

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> _ = learner.update(batch)
        >>> state = learner.checkpoint()
        >>> sorted(state)
        ['accum_step', 'model', 'num_updates', 'optimizer', 'param_names', 'rng']
        >>> _ = learner.update(batch)
        >>> learner.load_checkpoint(state)
        >>> learner.num_updates
        1
        """
        return clone_state(self._live_state())

    def _live_state(self) -> dict[str, Any]:
        """The checkpoint's content aliasing live tensors: only for immediate serialisation."""
        return {
            "model": without_frozen(self._model_state(), frozen_keys(self.loss_module)),  # checkpoint/frozen.py
            "optimizer": self._optimizer_state(),
            "param_names": self._saved_param_names(),
            "accum_step": self._accum_step,
            "num_updates": self.num_updates,
            "rng": self._rng_states(),
        }

    def _rng_states(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's generator states, in rank order (a collective where there are several)."""
        return [_rng.local_state()]

    def _optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def _optimizer_param_names(self) -> list[str]:
        """Loss-module names of the optimizer's parameters, in its state-dict index order."""
        return learner_state.optimizer_param_names(self._named_parameters(), self.optimizer)

    def _saved_param_names(self) -> list[str] | dict[str, list[str]]:
        """What checkpoints record to pair moments with parameters: names per stage when staged."""
        return learner_state.saved_param_names(self._named_parameters(), self.optimizer, bool(self.stages))

    def load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore a ``checkpoint()``; everything is validated before anything is changed.

        A checkpoint taken mid-window resumes at the start of a window (gradients are not
        checkpointed), with a warning. Each rank's random state is restored too, so a resumed run
        draws what the uninterrupted one would have (not across world sizes: see ``step.rng``).
        """
        frozen = frozen_keys(self.loss_module)
        check_checkpoint(checkpoint, self._model_shapes(), optional=frozen)
        _rng.check(checkpoint.get("rng"))
        optimizer_state = learner_state.optimizer_state_for(checkpoint, self.optimizer, self._saved_param_names())
        model = checkpoint["model"]
        absent = frozen.difference(model)
        if absent:  # frozen parameters are not checkpointed: they keep the values they have
            model = {**self._frozen_state(absent), **model}
        self._load_model_state(model)
        self._load_optimizer_state(optimizer_state)
        self._resume_counters(int(checkpoint.get("num_updates", 0)), int(checkpoint.get("accum_step", 0)),
                              checkpoint.get("rng"))
        self._weights_changed()

    def _resume_counters(self, num_updates: int, accum_step: int, rng: Any = None) -> None:
        """After a load: the saved update count and random state, and a fresh window (gradients are not saved)."""
        _rng.restore(rng, self.global_rank, self.world_size)
        self.num_updates = num_updates
        if accum_step:
            warnings.warn(
                f"The checkpoint was taken {accum_step} micro-batch(es) into a {self.grad_accum_steps}-step "
                "accumulation window; gradients are not checkpointed, so training resumes at the start "
                "of a new window.",
                stacklevel=3,
            )
        self._accum_step = 0
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, path, blocking: bool = True) -> Future | None:
        """Write :meth:`checkpoint` to ``path``, atomically: a crash leaves the previous file or the new one.

        A single file (``torch.save`` format) on unsharded learners; under a sharded strategy a
        folder of shards written by every rank (a collective). Any learner can :meth:`load` it.

        Args:
            path (str or os.PathLike): the file (or folder) to write.
            blocking (bool): ``False`` under a sharded strategy returns once every rank's shards are
                staged and writes them in the background (``LATEST`` switches only when every rank's
                write is complete); the next ``save``, ``load``, ``close()`` and exit wait for it.
                Unsharded learners save synchronously either way.

        Returns:
            ``None`` when ``blocking``; else a ``concurrent.futures.Future`` done once the checkpoint
            is complete and current (see :meth:`wait_for_save`).

        Raises:
            FileExistsError: ``path`` holds something this package did not write (nothing is written).

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> import os, tempfile
        >>> _ = learner.update(batch)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     learner.save(os.path.join(folder, "learner.ckpt"))
        ...     os.listdir(folder)
        ['learner.ckpt']
        """
        raise NotImplementedError

    def load(self, path) -> None:
        """Restore a checkpoint that :meth:`save` wrote, from any backend, strategy or world size.

        Everything is validated before anything changes, and loading never unpickles code (a
        file holding anything but tensors and plain containers is refused).

        Args:
            path (str or os.PathLike): a checkpoint file or sharded checkpoint folder.

        Raises:
            FileNotFoundError: nothing at ``path``.
            ValueError: the checkpoint does not fit this learner (the message names the mismatch).

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> import os, tempfile
        >>> _ = learner.update(batch)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     learner.save(os.path.join(folder, "learner.ckpt"))
        ...     saved = net.weight.detach().clone()
        ...     _ = learner.update(batch)
        ...     learner.load(os.path.join(folder, "learner.ckpt"))
        >>> torch.equal(net.weight, saved), learner.num_updates
        (True, 1)
        """
        raise NotImplementedError

    def wait_for_save(self, timeout: float | None = None) -> None:
        """Block until the last ``save(path, blocking=False)`` is complete and current on disk.

        Raises ``TimeoutError`` if it is still running after ``timeout`` seconds (it stays pending),
        or a ``RuntimeError`` if it failed: then the checkpoint at its path is still the previous
        one. ``save``, ``load`` and ``close`` call it first, and so does a distributed run's exit hook.
        """
        self._pending_save.wait(timeout)

    def _track_save(self, path, future: Future | None) -> Future:
        return self._pending_save.track(path, future)
