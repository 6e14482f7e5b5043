"""The Learner contract: one optimization step on a TensorDict batch with a torchrl loss.

The step itself (``update``) lives here, once. Backends only say how to forward, backward,
skip gradient sync, clip and save; they never re-implement accumulation, the loss sum or
the optimizer-coverage check, so every backend learns the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torch import nn

from fabric_learner.checkpoint.learner import LearnerCheckpoints
from fabric_learner.checkpoint.pending import PendingSave
from fabric_learner.llm import loss_count
from fabric_learner.optim import coverage_error, optimizer_params, uncovered_with_grad
from fabric_learner.step.batch_errors import input_error as _input_error
from fabric_learner.step.compile import CompiledLoss
from fabric_learner.step.output import as_tensordict, detached, loss_keys, set_entry, total_loss
from fabric_learner.step.parts import backward_seed, check_batch, reported_norm
from fabric_learner.step.staged import update_staged
from fabric_learner.step.stages import Stage, check_stages


@dataclass(frozen=True)
class Capabilities:
    """What a backend does, for code that must branch on it (e.g. collective weight gathers).

    ``sharded``: each rank holds only a shard of the trained parameters, so reading them whole
    is a collective; ``distributed``: more than one rank takes part in every update.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, _ = dqn_example()
        >>> LocalLearner(loss, policy=net).capabilities
        Capabilities(sharded=False, distributed=False)

        A ``FabricLearner`` with ``strategy="fsdp", devices=2`` reports
        ``Capabilities(sharded=True, distributed=True)`` on both ranks; with ``"ddp"``, ``sharded=False``.
    """

    sharded: bool
    distributed: bool


class Learner(LearnerCheckpoints, nn.Module):
    """One optimization step on a TensorDict batch: forward, sum losses, backward, clip, step.

    ``update(batch)`` returns the loss output, detached, plus ``"grad_norm"`` (the pre-clip
    norm over the optimizer's parameters) on calls that step the optimizer. With
    ``grad_accum_steps=k`` the optimizer steps on every k-th call, each micro-batch loss
    scaled by 1/k, and gradients are synchronised across ranks on the last one only.

    A Learner is an ``nn.Module`` whose only submodule is ``loss_module``, so
    ``state_dict()`` keeps its plain meaning (weights only); ``checkpoint()`` and
    ``save()`` carry the optimizer and counters as well.

    A non-finite summed loss (on any micro-batch of the window) or grad norm never reaches the
    optimizer: ``on_nonfinite="raise"`` raises ``FloatingPointError`` on the step call,
    ``"skip"`` skips the step and counts it in ``skipped_updates``. Either way the gradients
    are zeroed, a new window starts and ``num_updates`` is unchanged; under DDP/FSDP every
    rank takes the same decision.

    ``compile=True`` runs the loss forward (and so its backward) through ``torch.compile``, with
    results equal to eager's up to float rounding; a loss that does not compile runs eagerly after
    one warning naming it (see ``step.compile``). With ``optimizer=None`` the Adam is then fused.

    Examples:
        ``LocalLearner`` and ``FabricLearner`` are the Learners to build; here two micro-batches make
        one optimizer step:

        >>> from fabric_learner import Learner, LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, policy=net, grad_accum_steps=2)
        >>> isinstance(learner, Learner), [name for name, _ in learner.named_children()]
        (True, ['loss_module'])
        >>> sorted(learner.update(batch).keys()), learner.num_updates  # first micro-batch: no step yet
        (['loss'], 0)
        >>> sorted(learner.update(batch).keys()), learner.num_updates
        (['grad_norm', 'loss'], 1)
    """

    capabilities = Capabilities(sharded=False, distributed=False)

    def __init__(
        self,
        loss_module: nn.Module,
        *,
        policy: nn.Module | None = None,
        clip_grad_norm: float | None = None,
        grad_accum_steps: int = 1,
        on_nonfinite: str = "raise",
        compile: bool = False,
        stages: Sequence[Stage] | None = None,
    ) -> None:
        if not isinstance(loss_module, nn.Module):
            raise TypeError(f"loss_module must be a torchrl LossModule (an nn.Module), got {type(loss_module).__name__}.")
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}.")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            raise ValueError(
                f"clip_grad_norm must be a positive number or None (no clipping), got {clip_grad_norm!r}."
            )
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}: 'raise' raises "
                "FloatingPointError on a non-finite loss or grad norm, 'skip' skips that optimizer step."
            )
        check_policy(loss_module, policy)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}.")
        if stages is not None:
            if clip_grad_norm is not None:
                raise ValueError("With stages=, give each Stage its own clip_grad_norm; the learner's "
                                 "clip_grad_norm applies to a single optimizer only.")
            check_stages(stages, loss_module.named_parameters(), loss_module)
        counts = loss_count(loss_module)  # torchrl's LLM losses: their micro-batch sums, normalised per window
        if counts is not None and stages is not None:
            raise ValueError(f"{type(loss_module).__name__} is normalised by its token or sample count over the "
                             "window, which the staged step does not do; train it with one optimizer (stages=None).")
        _materialize_lazy_state(loss_module)
        super().__init__()
        self.loss_module = loss_module
        # Not registered as a submodule: its parameters are the loss's, and a second copy in
        # state_dict() would be wrong. The same holds for every wrapper a backend keeps.
        object.__setattr__(self, "policy", policy)
        # what backends call for the loss forward: the loss, or it through torch.compile (step.compile)
        object.__setattr__(self, "_loss_call", CompiledLoss(loss_module) if compile else loss_module)
        object.__setattr__(self, "_counts", counts)
        self._window_count: torch.Tensor | None = None  # the window's summed token/sample count (llm.py)
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.grad_accum_steps = grad_accum_steps
        self.on_nonfinite = on_nonfinite
        self.num_updates = 0
        self.skipped_updates = 0
        self._accum_step = 0
        self._window_results: list[TensorDictBase] = []  # this window's outputs, for error messages
        self._window_mark: torch.Tensor | None = None  # finite iff every loss of the window was (_window_loss_nonfinite)
        # several ranks: backward from a NaN seed on a non-finite loss, so every rank sees it (_refuse_step)
        self._poison_gradients = False
        self._window_samples = 0  # samples this rank fed in this window
        self._coverage_checked = stages is not None  # stages cover every trained parameter by construction
        self.stages: tuple[Stage, ...] = tuple(stages or ())
        self._window_batches: list[TensorDictBase] = []  # staged learners: the window's micro-batches
        self._pending_save = PendingSave()  # a save(blocking=False) still being written
        self.optimizer: torch.optim.Optimizer

    def __setattr__(self, name: str, value: Any) -> None:
        # The step's own counters and window state are plain values written several times per
        # update; nn.Module.__setattr__'s parameter/buffer/module checks cost ~1.5 us each.
        if name in _STEP_STATE:
            object.__setattr__(self, name, value)
            return
        if name == "optimizer":  # what the step zeroes and checks for gradients (FabricLearner unwraps it)
            object.__setattr__(self, "_torch_optimizer", value)
        super().__setattr__(name, value)

    # ---- the step -----------------------------------------------------------------------

    def update(self, batch: TensorDictBase) -> TensorDictBase:
        """Take one micro-step on ``batch``; step the optimizer at the end of each window.

        Runs the loss on ``batch``, backpropagates the sum of its ``"loss*"`` entries (divided by
        ``grad_accum_steps``) and, on every ``grad_accum_steps``-th call, clips and steps the
        optimizer. Under DDP/FSDP every rank calls it with its own batch and the step equals one
        process's on the union of the ranks' batches (gradients are averaged over ranks).

        Args:
            batch (TensorDictBase): the loss's input, with a non-empty batch size.

        Returns:
            The loss output, detached; on calls that step the optimizer also ``"grad_norm"``
            (the norm before clipping over the optimizer's parameters).

        Raises:
            FloatingPointError: a non-finite loss or grad norm with ``on_nonfinite="raise"``
                (the step is not taken, gradients are zeroed, ``num_updates`` is unchanged).
            KeyError: the batch lacks an entry the loss reads (the message names it).
            ValueError: the optimizer misses a parameter that received a gradient.

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> out = learner.update(batch)
        >>> sorted(out.keys()), learner.num_updates
        (['grad_norm', 'loss'], 1)
        >>> out["loss"].requires_grad
        False
        """
        if self.stages:
            return update_staged(self, batch)
        samples = check_batch(batch)
        if self._accum_step + 1 == self.grad_accum_steps:  # gradients are synchronised on this one
            return self._step(self._micro_step(batch, samples))
        with self._sync_context(False):
            result = self._micro_step(batch, samples)
        return result

    def update_minibatches(self, batch: TensorDictBase, minibatch_size: int, *, epochs: int = 1, shuffle: bool = True,
                           seed: int | None = None, normalize_advantage: bool | NestedKey = False) -> TensorDictBase:
        """Many updates in one call: ``epochs`` passes over ``batch`` in minibatches of ``minibatch_size``, one
        :meth:`update` each (PPO's epochs; ``shuffle=False, epochs=1``: K off-policy steps on K sampled batches).

        Each epoch partitions the batch anew without replacement (``onpolicy.partition_indices``, from a
        generator seeded ``seed + global_rank``, or torch's global one), the last ``n % minibatch_size``
        samples of the permutation left out; ``shuffle=False`` takes the rows in order. On several ranks
        every rank passes its own batch and takes the same number of minibatches (the smallest), and
        ``normalize_advantage`` standardises each minibatch's advantage over every rank's minibatch. What
        the loss writes into a minibatch (``td_error``) lands in ``batch`` at its rows. Each minibatch is one
        optimizer step, in ``grad_accum_steps`` equal micro-batches (its loss entries their mean). A
        ``RemoteLearner`` runs the whole loop on its ranks in one call.

        Args:
            batch (TensorDictBase): one-dimensional (``batch.reshape(-1)`` for ``[envs, time]``).
            minibatch_size (int): samples per update.

        Keyword Args:
            epochs (int): passes over the batch (default 1).
            shuffle (bool): a fresh partition each epoch (default) or the rows in order.
            seed (int, optional): the partitions' generator seed (per rank: ``seed + global_rank``).
            normalize_advantage (bool or NestedKey): standardise this entry (``True``: ``"advantage"``) per
                minibatch, over all ranks; build the loss with ``normalize_advantage=False``.

        Returns:
            Every update's output stacked, ``[epochs * minibatches]``.

        Raises:
            ValueError, TypeError, KeyError: a bad argument, before any update.

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()  # 8 transitions
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> out = learner.update_minibatches(batch, 4, epochs=3, seed=0)
        >>> out["loss"].shape, learner.num_updates, batch["td_error"].shape
        (torch.Size([6]), 6, torch.Size([8, 1]))
        """
        from fabric_learner.step import minibatches as _minibatches

        return _minibatches.run(self, batch, minibatch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                                normalize_advantage=normalize_advantage)

    def _micro_step(self, batch: TensorDictBase, samples: int) -> TensorDictBase:
        """Forward and backward of one micro-batch; returns its output, detached."""
        # the step's own state, written past Module.__setattr__ (one Python call each, see _STEP_STATE)
        state = self.__dict__
        counts = self._counts
        if counts is not None:
            counts.reset()
        try:
            output = self._forward(batch)
        except (KeyError, AttributeError, TypeError, RuntimeError) as err:
            named = _input_error(err, batch, self.loss_module)
            if named is err:
                raise
            raise named from err
        if type(output) is not TensorDict:
            output = as_tensordict(output)  # torchrl's LLM losses return TensorClasses
        loss = total_loss(output)
        mark = loss.detach()
        if counts is not None:
            # the micro-batch's sum; the window's total count divides the gradients in _step (llm.py).
            # Ranks hold different counts by design: their sample counts are not compared.
            count = counts.take(batch).to(mark.device)
            state["_window_count"] = count if self._accum_step == 0 else self._window_count + count
            samples = 0
        if self._accum_step == 0:
            if _has_gradients(self._torch_optimizer):  # not left by a step: someone else's backward
                self._torch_optimizer.zero_grad(set_to_none=True)
            state["_window_results"], state["_window_samples"] = [], samples
            state["_window_mark"] = mark
        else:
            state["_window_samples"] += samples
            # 0 * mark is 0, or NaN when mark is not finite: the first loss stays, or turns NaN
            state["_window_mark"] = self._window_mark + mark * 0
        seed = backward_seed(mark) if self._poison_gradients else None
        if counts is not None:
            loss = loss * count
        elif self.grad_accum_steps > 1:
            loss = loss / self.grad_accum_steps
        self._backward(loss, seed)  # even when non-finite: ranks must run the same collectives
        state["_accum_step"] += 1
        result = detached(output)
        self._window_results.append(result)
        return result

    def _step(self, result: TensorDictBase) -> TensorDictBase:
        """The window's end: check coverage, clip, refuse a non-finite step or take it."""
        state = self.__dict__
        state["_accum_step"] = 0
        if not self._coverage_checked:
            missing = uncovered_with_grad(self._named_parameters(), self.optimizer)
            if missing:
                self._abandon_window()
                raise coverage_error(missing)
            self._coverage_checked = True
        if self._counts is not None:
            self._normalize_gradients()
        grad_norm = self._clip_gradients(math.inf if self.clip_grad_norm is None else self.clip_grad_norm)
        set_entry(result, "grad_norm", reported_norm(grad_norm, result.device))
        if self._refuse_step(grad_norm):  # the step's host sync
            if not self._poison_gradients and self._window_loss_nonfinite():
                # NaN, as on several ranks, where the NaN seed reaches every gradient
                grad_norm = torch.full_like(grad_norm, math.nan)
                set_entry(result, "grad_norm", reported_norm(grad_norm, result.device))
            self._abandon_window()
            if self.on_nonfinite == "raise":
                raise self._nonfinite_error(grad_norm)
            self.skipped_updates += 1
            self._window_results = []
            return result
        state["_window_results"] = []
        self._optimizer_step()
        # as a hand-written loop does: gradients freed before the next forward allocates
        self._torch_optimizer.zero_grad(set_to_none=True)
        state["num_updates"] += 1
        self._weights_changed()
        return result

    def _normalize_gradients(self) -> None:
        """Divide the window's summed gradients by its token/sample count over all ranks (see ``llm``).

        Each rank's gradients arrive averaged over the ranks (DDP, FSDP), so the factor is the rank
        count over the total count: the step of one process on the whole batch.
        """
        total, ranks = self._sum_over_ranks(self._window_count)
        factor = ranks / max(total.item(), 1.0)  # a float: the gradients may be DTensors
        for param in optimizer_params(self._torch_optimizer):
            if param.grad is not None:
                param.grad.mul_(factor)

    def _refuse_step(self, grad_norm: torch.Tensor) -> bool:
        """Whether the window's step must not be taken: a non-finite grad norm, or here (one rank) loss.

        Across ranks no collective of the learner's own is needed: a non-finite loss's backward
        seed is NaN (``backward_seed``), which makes the gradients it reaches NaN; the gradient
        sync carries them to every rank, and the norm, taken after the sync, is the same on all of
        them. (A loss whose gradient reaches the parameters only through masked elements, such as
        dead ReLUs, leaves them finite: then every rank takes the step alike.)
        """
        refuse = not math.isfinite(grad_norm.item())  # .item(): one dispatch, where torch.isfinite is several
        return refuse or (not self._poison_gradients and self._window_loss_nonfinite())

    def _window_loss_nonfinite(self) -> bool:
        """This rank's own verdict on its window's losses (a host sync)."""
        return not math.isfinite(self._window_mark.item())

    def _nonfinite_error(self, grad_norm: torch.Tensor) -> FloatingPointError:
        bad = sorted({str(k) for td in self._window_results for k in loss_keys(td)
                      if not torch.isfinite(td.get(k)).all()})
        if bad:
            what = f"the loss entries {bad} are non-finite"
        elif not torch.isfinite(grad_norm).all() and not self._scaler_handles_overflow():
            what = f"grad_norm is non-finite ({grad_norm.item()})"
            if self.world_size > 1:
                what += " on every rank (the gradients are synchronised; a non-finite loss on any rank makes them NaN)"
        else:
            what = "another rank saw a non-finite loss or grad norm"
        rank = f" (rank {self.global_rank})" if self.world_size > 1 else ""
        self._window_results = []
        return FloatingPointError(
            f"Optimizer step {self.num_updates + 1} refused{rank}: {what}. No parameter or optimizer state "
            "changed; gradients were zeroed and a new accumulation window starts. Check the batch for "
            "nan/inf, lower the learning rate or set clip_grad_norm, or build the learner with "
            "on_nonfinite='skip' to skip such steps."
        )

    def _abandon_window(self) -> None:
        """Drop this window's gradients so the next call starts a fresh one."""
        self._accum_step = 0
        self._window_batches = []
        self.optimizer.zero_grad(set_to_none=True)

    # ---- what backends provide ------------------------------------------------------------

    def _forward(self, batch: TensorDictBase, method: str | None = None) -> TensorDictBase:
        """The loss on ``batch`` (its ``method`` when given), through the backend."""
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor, seed: torch.Tensor | None) -> None:
        """``loss.backward(seed)``, through the backend (``seed``: see ``backward_seed``; ``None``: 1)."""
        raise NotImplementedError

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch; gradients are synchronised only when ``sync``."""
        return contextlib.nullcontext()

    def _clip_gradients(self, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip ``optimizer``'s gradients (default: the learner's) and return their pre-clip norm."""
        raise NotImplementedError

    def _optimizer_step(self, optimizer=None) -> None:
        (optimizer or self.optimizer).step()

    def _weights_changed(self) -> None:
        """After an optimizer step or a load: bring copies used outside ``update`` up to date."""

    def _sum_over_ranks(self, value: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``value`` summed over the data-parallel ranks, and their number (here: itself, 1)."""
        return value, 1

    def _scaler_handles_overflow(self) -> bool:
        """True when a grad scaler steps the optimizer (it skips inf-gradient steps itself)."""
        return False

    def _named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained module's parameters, named as in ``loss_module``."""
        return self.loss_module.named_parameters()

    def _model_state(self) -> dict[str, Any]:
        return self.loss_module.state_dict()

    def _model_shapes(self) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.loss_module.state_dict(keep_vars=True).items()}

    def _load_model_state(self, state: Mapping[str, Any]) -> None:
        self.loss_module.load_state_dict(state, strict=True)

    def _frozen_state(self, keys: frozenset[str]) -> dict[str, torch.Tensor]:
        """The live values of the frozen parameters ``keys`` (a load that lacks them keeps them)."""
        state = self.loss_module.state_dict()
        return {k: state[k] for k in keys}

    # ---- attributes -----------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """Inside this context the loss's own modules (actor, critics) hold the full weights.

        For code that runs the networks outside ``update``: rollouts, value estimators, target
        updaters. A no-op where parameters are not sharded; a collective where they are.
        """
        return contextlib.nullcontext(self.loss_module)

    def serve(self, module: nn.Module) -> bool:
        """Keep ``module`` (a network the loss trains, run outside ``update``) full and current.

        Here it already runs on the trained parameters, so nothing changes; a sharded learner
        keeps its parameters gathered (see ``FabricLearner.serve``). Returns whether ``module``
        holds parameters the loss trains.
        """
        return holds_trained(self.loss_module, module)

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release what the learner holds beyond Python objects (nothing, for one process)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:  # on an error, the exit hook ends a distributed rank without waiting for peers
            self.close()

    # ---- weights ----------------------------------------------------------------------------

    def get_weights(self, *, cpu_offload: bool = True) -> TensorDictBase:
        """Plain, detached tensors independent of the live parameters.

        Laid out as ``TensorDict.from_module(policy)`` when a policy was given, else as the loss
        module's trainable parameters. Needs no communication on unsharded backends; on sharded
        ones it is a collective (every rank calls it) and, with ``cpu_offload=True``, only rank 0
        receives the full tensors.

        Keyword Args:
            cpu_offload (bool): return CPU tensors (default ``True``); ``False`` keeps them on the
                learner's device (and gives every rank the full tensors under FSDP).

        Returns:
            A TensorDict of weights that later updates do not change.

        Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()
        >>> learner = LocalLearner(loss, lambda params: torch.optim.SGD(params, lr=0.1), policy=net)
        >>> weights = learner.get_weights()
        >>> sorted(weights.keys())
        ['bias', 'weight']
        >>> _ = learner.update(batch)
        >>> torch.equal(weights["weight"], net.weight)
        False
        """
        return plain_weights(self.loss_module, self.policy, cpu_offload)


NONFINITE_MODES = ("raise", "skip")

# Learner attributes set on every update (never parameters, buffers or modules): see Learner.__setattr__
_STEP_STATE = frozenset({
    "num_updates", "skipped_updates", "_accum_step", "_window_results", "_window_mark", "_window_samples",
    "_window_batches", "_group_seeds", "_poison_gradients", "_window_count",
})


def clipped_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)``, the same norm and gradients.

    With ``max_norm=inf`` (no clipping asked) only the norm is taken: the scaling by 1 that
    ``clip_grad_norm_`` would add costs as much again (~35 us on the PPO recipe's networks).
    """
    if math.isinf(max_norm):
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], error_if_nonfinite=False)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` holds a gradient."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return True
    return False


def check_policy(loss_module: nn.Module, policy: nn.Module | None) -> None:
    """Refuse a ``policy=`` that is not a module of the loss: every parameter it holds must be one the loss holds.

    ``get_weights()`` returns the policy's tensors; a module built apart from the loss (or a copy of it) is
    never trained, so its weights would go out unchanged, without a word.
    """
    if policy is None:
        return
    if not isinstance(policy, nn.Module):
        raise TypeError(f"policy must be an nn.Module or None, got {type(policy).__name__}.")
    ours = {id(p) for p in loss_module.parameters()}
    held = list(policy.named_parameters())
    foreign = [name for name, p in held if id(p) not in ours]
    if held and not foreign:
        return
    what = ("holds no parameters" if not held else
            f"holds {len(foreign)} parameter(s) the loss does not ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''})")
    raise ValueError(
        f"policy= must be a module of the loss: the module the loss was built with (e.g. loss.actor_network), or a "
        f"module wrapping it, such as an exploration wrapper, with no parameters of its own. get_weights() returns the "
        f"policy's weights and only the loss's are trained, but this {type(policy).__name__} {what}: a copy, or a "
        "module built apart from the loss, whose weights would never change. Pass the module given to the loss, or "
        "policy=None (get_weights() then has the loss's layout). Nothing was built."
    )


def holds_trained(loss_module: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` holds any of the parameters ``loss_module`` trains."""
    ours = {id(p) for p in loss_module.parameters()}
    return any(id(p) in ours for p in module.parameters())


def plain_weights(loss_module: nn.Module, policy: nn.Module | None, cpu_offload: bool) -> TensorDictBase:
    """Detached copies of ``policy``'s tensors (or the loss's parameters), on the CPU if asked."""
    if policy is not None:
        source = TensorDict.from_module(policy)
    else:
        source = TensorDict(dict(loss_module.named_parameters()), batch_size=[]).unflatten_keys(".")
    device = torch.device("cpu") if cpu_offload else None
    return source.apply(lambda t: _plain_copy(t, device), batch_size=[])


def _plain_copy(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, nn.Parameter):
        t = t.data
    if device is not None and t.device != device:
        return t.to(device)
    return t.clone()


def _materialize_lazy_state(loss_module: nn.Module) -> None:
    """Create the state torchrl losses add lazily on their first forward.

    Without this, a fresh loss's ``state_dict`` lacks ``_value_estimator.*`` (and REDQ's
    ``target_entropy_buffer``), so a checkpoint of a trained learner would not load into it.
    """
    if getattr(loss_module, "_value_estimator", False) is None:
        with contextlib.suppress(Exception):
            loss_module.value_estimator  # noqa: B018 - property with a side effect
    if "target_entropy_buffer" in getattr(loss_module, "__dict__", {}) and loss_module.__dict__["target_entropy_buffer"] is None:
        with contextlib.suppress(Exception):
            loss_module.target_entropy  # noqa: B018
