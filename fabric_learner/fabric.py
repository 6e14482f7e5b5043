"""FabricLearner: the Learner step with placement, wrapping, precision and sync left to Fabric."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from tensordict import TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner.backends import Counters, Resumed, Setup, backend_for
from fabric_learner.checkpoint import dcp_folder
from fabric_learner.checkpoint.files import naming, read_learner_file
from fabric_learner.collectives import all_reduce, distributed_world_size
from fabric_learner.launch import call_order as _call_order
from fabric_learner.launch import teardown as _teardown
from fabric_learner.launch.build import DEFAULT_TIMEOUT, apply_collective_timeout, as_timeout, build_fabric, launch
from fabric_learner.learner import Capabilities, Learner, clipped_norm
from fabric_learner.optim import OptimizerLike, optimizer_params
from fabric_learner.sharding import ShardedLoss
from fabric_learner.step import rng as _rng
from fabric_learner.step.carrier import Carrier, run_loss
from fabric_learner.step.sample_counts import SampleTrace
from fabric_learner.step.stages import Stage
from fabric_learner.utils.compat import (
    all_gather_stacked,
    allow_unused_parameters,
    ddp_option,
    fabric_callbacks,
    scaler_unscaled_this_step,
    strategy_timeout,
    wrapped_forward,
)


class FabricLearner(Learner):
    """The Learner contract on any Fabric strategy, precision and device.

    Building it launches the other ranks when needed (as ``fabric.launch()`` does) and returns
    on every rank with the learner ready; under ``fabric run`` or ``torchrun`` it picks the
    settings up from the launcher. Every rank feeds ``update`` its own local batch.

    ``strategy="fsdp"`` shards the loss's trainable parameters with FSDP2 (Fabric's
    ``ModelParallelStrategy``), on CPU and GPU; a user-built ``ModelParallelStrategy`` receives
    a ``ShardedLoss`` holding those parameters. Sharded strategies need an optimizer factory,
    and ``get_weights``, ``checkpoint``, ``save`` and ``load`` are collectives there.

    ``compile=True`` (see ``Learner``) works on a single device and under DDP; sharded strategies
    refuse it with a ``ValueError``.

    ``strategy=PipelineStrategy(...)`` (``fabric_learner.pipeline``) splits the policy's language model
    into pipeline stages, one per rank, and builds a ``PipelineLearner`` instead (docs/pipeline.md).

    ``timeout`` (a ``timedelta``, seconds, or ``None`` for torch's default) bounds every
    collective of the process group Fabric builds from a strategy name (default 5 minutes), so a
    rank that stops answering fails its peers instead of hanging them; a strategy object or a
    ``fabric`` passed in keeps its own.

    Args:
        loss_module (nn.Module): a torchrl loss, or any module returning a TensorDict whose
            ``"loss*"`` entries are summed and backpropagated.
        optimizer: an optimizer instance, a factory ``f(params)`` or ``None`` (Adam over the
            loss's parameters).

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
        accelerator, strategy, devices, num_nodes, precision: as ``lightning.fabric.Fabric``;
            ``strategy="fsdp"`` is FSDP2.
        fabric (Fabric, optional): a Fabric to use instead of building one from the above.
        timeout (timedelta or float, optional): the collective timeout (see above).

    Raises:
        TypeError, ValueError: a bad argument or an unsupported combination (e.g. ``compile=True``
            with FSDP), named with its fix, before any rank is launched.

    Examples:
        >>> import torch
        >>> from fabric_learner import FabricLearner
        >>> from fabric_learner.testing import dqn_example
        >>> loss, net, batch = dqn_example()  # DQNLoss(nn.Linear(4, 2), ...) and 8 transitions
        >>> with FabricLearner(loss, lambda params: torch.optim.Adam(params, lr=1e-3), policy=net,
        ...                    accelerator="cpu", devices=1) as learner:
        ...     out = learner.update(batch)
        >>> sorted(out.keys()), learner.world_size, learner.capabilities.sharded
        (['grad_norm', 'loss'], 1, False)

        Under ``torchrun`` or ``fabric run`` the same script runs on every rank; from a plain
        ``python`` call, ``FabricLearner(loss, factory, strategy="ddp", devices=2)`` launches the
        second rank itself.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # strategy=PipelineStrategy(...): the ranks are pipeline stages, a learner of its own (pipeline/learner.py)
        if cls is FabricLearner and type(kwargs.get("strategy")).__name__ == "PipelineStrategy":
            from fabric_learner.pipeline import PipelineLearner, PipelineStrategy

            if isinstance(kwargs["strategy"], PipelineStrategy):
                return PipelineLearner(*args, **kwargs)
        return super().__new__(cls)

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
        on_nonfinite: str = "raise",
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        compile: bool = False,
        stages: Sequence[Stage] | None = None,
    ) -> None:
        super().__init__(loss_module, policy=policy, clip_grad_norm=clip_grad_norm, grad_accum_steps=grad_accum_steps,
                         on_nonfinite=on_nonfinite, compile=compile, stages=stages)
        if stages is not None and optimizer is not None:
            raise ValueError("With stages=, each Stage builds its own optimizer; pass optimizer=None.")
        timeout = as_timeout(timeout)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
            raise TypeError(
                f"optimizer must be None, a torch.optim.Optimizer or a callable params -> Optimizer, "
                f"got {type(optimizer).__name__}."
            )
        group_existed = torch.distributed.is_available() and torch.distributed.is_initialized()
        owns_timeout = False
        if fabric is None:
            fabric, owns_timeout = build_fabric(
                accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision,
                timeout=timeout,
            )
        backend_type = backend_for(fabric.strategy)
        if ddp_option(fabric.strategy, "static_graph"):
            raise ValueError(
                "DDP with static_graph=True is not supported: DDP then synchronises gradients through hooks on the "
                "tensors its module returns, which the learner's loss output does not pass through, so the ranks "
                "would silently train apart. Nothing was launched. Build the DDPStrategy without static_graph."
            )
        backend_type.refuse(optimizer, compile)
        launch(fabric)
        if owns_timeout and not group_existed:
            apply_collective_timeout(fabric, timeout)
        object.__setattr__(self, "_timeout", timeout if owns_timeout else None)
        object.__setattr__(self, "fabric", fabric)
        self._closed = False
        plugin = fabric.strategy.precision
        convert = plugin.convert_input if type(plugin).convert_input is not Precision.convert_input else None
        object.__setattr__(self, "_precision", plugin)
        object.__setattr__(self, "_scaler", getattr(plugin, "scaler", None))  # fp16's GradScaler, set once by Fabric
        if stages and isinstance(fabric.strategy, DDPStrategy):
            # a stage's backward reaches only its part of the loss: DDP must not wait for the rest
            allow_unused_parameters(fabric.strategy)
        backend = backend_type(Setup(fabric, loss_module, optimizer, convert, self._compiled_call(), compile, policy,
                                     self.stages))
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_module", backend.module)
        self.optimizer = backend.optimizer
        if not self.stages:
            # zero_grad and the gradient check on the torch optimizer behind Fabric's wrapper: the same
            # param groups, without the wrapper's __getattr__ hop on every attribute (~10 us an update)
            object.__setattr__(self, "_torch_optimizer", self.optimizer.optimizer)
        # One device or DDP at 32-true: Fabric's backward, clip and optimizer wrappers only call
        # torch's own (measured 1-3% of a small update), so the step calls torch directly, as
        # LocalLearner; on one device the forward skips the module wrapper too (DDP needs its own).
        object.__setattr__(self, "_direct", _wrappers_do_nothing(fabric, plugin))
        object.__setattr__(self, "_direct_forward", self._direct and type(fabric.strategy) is SingleDeviceStrategy)
        object.__setattr__(self, "_device", fabric.device)  # fixed once launched; read on every forward
        self.capabilities = Capabilities(sharded=backend.sharded, distributed=fabric.world_size > 1)
        self._poison_gradients = fabric.world_size > 1
        self._samples = SampleTrace()
        if fabric.world_size > 1:
            _teardown.register(self, group_existed)

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Release the learner's distributed state; idempotent.

        Closing the last learner of a process group this package started ends the group in a
        safe order (see ``launch.teardown``), so every rank must close it, as every rank built it.
        A script that just returns gets the same teardown from an exit hook.
        """
        if self._closed:
            return
        self.wait_for_save()
        self._closed = True
        if self.capabilities.distributed:
            _teardown.close(self)

    # ---- the step, through Fabric ---------------------------------------------------------

    def _compiled_call(self):
        """The ``CompiledLoss`` for the forwarder with ``compile=True``, else ``None`` (call the loss)."""
        return None if self._loss_call is self.loss_module else self._loss_call

    def _forward(self, batch, method=None):
        if self._direct_forward:
            call = self._loss_call if method is None else getattr(self.loss_module, method)
            return run_loss(call, batch, self._device, None)
        # The strategy's module (DDP, FSDP2, or the forwarder) under the precision's forward
        # context: what `_FabricModule.forward` adds beyond that (input/output conversion,
        # backward-hook checks) is done by the carrier or not needed, and costs ~0.1-0.3 ms.
        with self._precision.forward_context():
            carried, _ = wrapped_forward(self._module)(Carrier(batch, method))
        return carried.value

    def _backward(self, loss: torch.Tensor, seed: torch.Tensor | None) -> None:
        if self._direct:
            loss.backward(seed)
            return
        loss = self._precision.convert_output(loss)
        self.fabric.backward(loss, *(() if seed is None else (seed.to(loss.dtype),)), model=self._module)

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        # Only ever enter the no-sync context with enabled=True: Fabric's FSDP2 variant leaves
        # sync in the state of `enabled` on exit, so enabled=False would switch sync off for good.
        if sync or isinstance(self.fabric.strategy, SingleDeviceStrategy):
            return contextlib.nullcontext()
        return self.fabric.no_backward_sync(self._module, enabled=True)

    def _clip_gradients(self, max_norm: float, optimizer=None) -> torch.Tensor:
        if self._direct:
            direct = self._torch_optimizer if optimizer is None else getattr(optimizer, "optimizer", optimizer)
            return clipped_norm(optimizer_params(direct), max_norm)
        optimizer = optimizer or self.optimizer
        norm = self.fabric.clip_gradients(self._module, optimizer, max_norm=max_norm, error_if_nonfinite=False)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _optimizer_step(self, optimizer=None) -> None:
        if self._direct:
            (self._torch_optimizer if optimizer is None else getattr(optimizer, "optimizer", optimizer)).step()
        else:
            (optimizer or self.optimizer).step()

    def _refuse_step(self, grad_norm: torch.Tensor) -> bool:
        # A grad scaler owns inf gradients (it skips such steps itself), so then only a non-finite
        # loss refuses the step, and whether any rank saw one takes a collective.
        scaler = self._scaler is not None  # _scaler_handles_overflow, inlined on the step's path
        flag = self._window_loss_nonfinite() if scaler else super()._refuse_step(grad_norm)
        if not self.capabilities.distributed:
            return flag
        self._samples.add(self._window_samples)
        if not scaler and not self._samples.due(self.num_updates):
            return flag  # no collective: see Learner._refuse_step
        packet = self._samples.packet(flag, self.fabric.device)
        torch.distributed.all_reduce(packet, op=torch.distributed.ReduceOp.MAX)
        return self._samples.read(packet, self.num_updates)

    def _scaler_handles_overflow(self) -> bool:
        return self._scaler is not None

    def _sum_over_ranks(self, value: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.world_size == 1:
            return value, 1
        return all_reduce(value, "sum"), distributed_world_size()  # over "dp": the ranks that feed batches

    def _abandon_window(self) -> None:
        super()._abandon_window()
        scaler = self._scaler
        if scaler is not None and scaler_unscaled_this_step(scaler):
            with contextlib.suppress(AssertionError):  # gradients were unscaled for a step not taken
                scaler.update()

    def update(self, batch):
        if self._closed:
            raise RuntimeError("This FabricLearner is closed; build a new one to keep training.")
        try:
            result = super().update(batch)
        except RuntimeError as err:
            lost = _lost_peer(err) if self.world_size > 1 else None
            if lost is None:
                raise
            call = self.num_updates * self.grad_accum_steps + self._accum_step + 1
            # off the hot path: the store is read only once a collective of update() has failed
            _call_order.note_failure(f"failed (in update() call {call})")
            peers = _call_order.peer_announcements()
            raise RuntimeError(
                f"Rank {self.global_rank}: update() call {call} could not complete a collective with the other ranks "
                f"({lost}). {peers[:1].upper() + peers[1:] + '. ' if peers else ''}Another rank called update() "
                "fewer times, called another collective method (get_weights, save, ...) instead, ended or died, or is "
                f"busy elsewhere for longer than the process-group timeout ({self._group_timeout()}). Every rank "
                "must call update() the same number of times, and the learner's other collective methods at the "
                "same points; see that rank's output for its own error."
            ) from err
        plugin = self._precision
        if type(plugin).convert_output is not Precision.convert_output:
            result = result.apply(plugin.convert_output)  # reported values in the default dtype
        return result

    def _group_timeout(self) -> timedelta | None:
        return strategy_timeout(self.fabric.strategy) if self._timeout is None else self._timeout

    def _collective(self, name: str, when: bool = True) -> contextlib.AbstractContextManager:
        """Checks, before the call's first collective, that every rank is making this same call."""
        if not when or self.world_size == 1:
            return contextlib.nullcontext()
        return _call_order.collective_call(name, self.global_rank, self.world_size, self._group_timeout())

    def _named_parameters(self):
        return self._backend.named_parameters()

    def _weights_changed(self) -> None:
        self._backend.weights_changed()

    # ---- attributes -----------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """See ``Learner.full_parameters``: under FSDP, every rank must enter it together."""
        with self._collective("full_parameters", self.capabilities.sharded):
            pass  # checked at the call, the gather runs on entering the block
        return self._backend.full_parameters()

    @property
    def sharded_module(self) -> ShardedLoss | None:
        """The ``ShardedLoss`` under sharded strategies, else ``None``."""
        return self._backend.sharded_module

    def serve(self, module: nn.Module) -> bool:
        """Keep ``module`` (a network the loss trains, run outside ``update``) full and current.

        Under FSDP its parameters then hold the full weights on every rank, refreshed after each
        optimizer step and load (a collective: every rank must call this, and it gathers at
        once); elsewhere it already uses the trained parameters. The ``policy=`` module and the
        policy a ``Trainer``'s collector runs are served without asking. Returns whether
        ``module`` holds parameters the loss trains.
        """
        with self._collective("serve", self.capabilities.sharded):
            return self._backend.serve(module)

    # ---- weights and state (collectives under sharded strategies) -----------------------------

    def get_weights(self, *, cpu_offload: bool = True) -> TensorDictBase:
        """Plain tensors; under sharded strategies a collective that every rank must call.

        Sharded, ``cpu_offload=True``: full weights on rank 0, an empty TensorDict elsewhere;
        ``cpu_offload=False``: full weights on every rank.
        """
        with self._collective("get_weights", self.capabilities.sharded):
            return self._backend.get_weights(self.policy, cpu_offload)

    def checkpoint(self) -> dict[str, Any]:
        """See ``Learner.checkpoint``: with several ranks a collective (every rank's random state)."""
        with self._collective("checkpoint"):
            return super().checkpoint()

    def load_checkpoint(self, checkpoint) -> None:
        """See ``Learner.load_checkpoint``: a collective on sharded learners."""
        with self._collective("load_checkpoint", self.capabilities.sharded):
            super().load_checkpoint(checkpoint)

    def _rng_states(self) -> list[dict[str, torch.Tensor]]:
        if self.world_size == 1:
            return super()._rng_states()
        # torch.distributed.all_gather itself: Fabric's all_gather goes through torch.distributed.nn's, deprecated
        gathered = {k: all_gather_stacked(v.to(self.fabric.device)) for k, v in _rng.local_state().items()}
        return [{k: v[r].cpu().clone() for k, v in gathered.items()} for r in range(self.world_size)]

    def _model_state(self) -> dict[str, Any]:
        return self._backend.model_state()

    def _model_shapes(self) -> dict[str, tuple]:
        return self._backend.model_shapes()

    def _load_model_state(self, state) -> None:
        self._backend.load_model_state(state)

    def _frozen_state(self, keys: frozenset[str]) -> dict[str, torch.Tensor]:
        if not self.capabilities.sharded:
            return super()._frozen_state(keys)
        state = self._backend.model_state()  # the loss holds placeholders: gather (a collective)
        return {k: state[k] for k in keys}

    def _optimizer_state(self) -> dict[str, Any]:
        return self._backend.optimizer_state(self._saved_param_names())

    def _load_optimizer_state(self, state) -> None:
        self._backend.load_optimizer_state(state, self._saved_param_names())

    # ---- checkpoints on disk --------------------------------------------------------------

    def save(self, path: str | os.PathLike, blocking: bool = True) -> Future | None:
        """Write the learner's state; every rank must call it.

        Unsharded: one file through ``fabric.save``, written on rank 0 to a temporary file beside
        ``path``, flushed to disk and renamed onto it (``AtomicCheckpointIO``). Sharded: a folder
        where each rank writes its own shards (see ``checkpoint.dcp_folder``), made current by an atomic rename of
        its ``LATEST`` file.

        ``blocking=False``, sharded: returns as soon as the state is copied (staged), with a
        future; the shards are written in the background while training goes on, and ``LATEST``
        switches only once every rank's write completed, so a crash meanwhile leaves the previous
        version current. The next ``save``, ``load``, ``close()`` and the exit hook wait for it;
        ``wait_for_save()`` waits explicitly and raises if it failed. Unsharded, ``blocking=False``
        saves synchronously (rank 0 writes one file from the live state; a background copy would
        cost the same memory as the file) and returns a finished future.
        """
        with self._collective("save"):
            return self._save(path, blocking)

    def _save(self, path, blocking: bool) -> Future | None:
        self.wait_for_save()
        counters = Counters(self.num_updates, self._accum_step, self._saved_param_names(),
                            self._optimizer_param_names(), self._rng_states())
        future = self._backend.save(Path(path), counters, blocking)
        return None if blocking else self._track_save(path, future)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by any learner, any strategy or world size.

        Never runs code from the file: files load ``weights_only``, sharded folders through
        ``dcp_folder.SafeReader``. Everything is validated before anything changes.
        """
        with self._collective("load"):
            self._load(path)

    def _load(self, path) -> None:
        self.wait_for_save()
        with naming(path):
            if dcp_folder.is_sharded_checkpoint(path):
                restored = self._backend.load_folder(Path(path))
                if isinstance(restored, Resumed):  # loaded in place
                    self._resume_counters(restored.num_updates, restored.accum_step, restored.rng)
                    self._weights_changed()
                else:
                    self.load_checkpoint(restored)
                return None
            if Path(path).is_dir():
                raise FileNotFoundError(f"{path} is a folder but holds no fabric_learner checkpoint (no LATEST file).")
            # every rank reads the file itself, as fabric.load does, but through the checked reader
            self.load_checkpoint(read_learner_file(path))


def _wrappers_do_nothing(fabric: Fabric, precision: Precision) -> bool:
    """Whether Fabric's backward, clip and optimizer step only call torch's own here."""
    hooked = any(hasattr(c, "on_after_optimizer_step") for c in fabric_callbacks(fabric))
    return type(fabric.strategy) in (SingleDeviceStrategy, DDPStrategy) and type(precision) is Precision and not hooked


def _lost_peer(err: RuntimeError) -> str | None:
    """What a collective's error says about the other ranks, when it is about them."""
    text = str(err)
    if "timed out" in text.lower():
        return "it timed out waiting for them"
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")):
        return "a peer closed its connection"
    return None
