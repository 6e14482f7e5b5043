"""FabricLearner: the Learner step with placement, wrapping, precision and sync left to Fabric."""

from __future__ import annotations

import contextlib
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_learner import _dcp, _lifecycle, _rng
from fabric_learner._batch import Carrier, LossForwarder
from fabric_learner._checkpoint import FORMAT, AtomicCheckpointIO, naming, overwrite_error, read_learner_file
from fabric_learner._compile import fused_adam
from fabric_learner._launch import DEFAULT_TIMEOUT, apply_collective_timeout, as_timeout, build_fabric, launch
from fabric_learner._optim import OptimizerLike, build_optimizer
from fabric_learner._samples import SampleTrace
from fabric_learner._sharded import ShardedLoss, check_sharded, flat_name, is_sharded_strategy
from fabric_learner.learner import Capabilities, Learner


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

    ``timeout`` (a ``timedelta``, seconds, or ``None`` for torch's default) bounds every
    collective of the process group Fabric builds from a strategy name (default 5 minutes), so a
    rank that stops answering fails its peers instead of hanging them; a strategy object or a
    ``fabric`` passed in keeps its own.
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
        on_nonfinite: str = "raise",
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        compile: bool = False,
    ) -> None:
        super().__init__(loss_module, policy=policy, clip_grad_norm=clip_grad_norm, grad_accum_steps=grad_accum_steps,
                         on_nonfinite=on_nonfinite, compile=compile)
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
        sharded = is_sharded_strategy(fabric.strategy)
        if sharded and compile:
            raise ValueError(
                "compile=True is not supported with sharded strategies (FSDP) yet; nothing was launched. Use "
                "compile=True on a single device or under DDP, or compile=False under FSDP."
            )
        if sharded and isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "A sharded strategy builds the optimizer after sharding, so it needs a factory, not an "
                "instance: pass e.g. optimizer=functools.partial(torch.optim.Adam, lr=3e-4), or None for Adam."
            )
        if not sharded and type(fabric.strategy.checkpoint_io) is TorchCheckpointIO:  # a custom one is the user's
            fabric.strategy.checkpoint_io = AtomicCheckpointIO()
        launch(fabric)
        if owns_timeout and not group_existed:
            apply_collective_timeout(fabric, timeout)
        object.__setattr__(self, "_timeout", timeout if owns_timeout else None)
        object.__setattr__(self, "fabric", fabric)
        self._closed = False
        plugin = fabric.strategy.precision
        convert = plugin.convert_input if type(plugin).convert_input is not Precision.convert_input else None
        object.__setattr__(self, "_precision", plugin)
        if sharded:
            loss_module.to(fabric.device)  # buffers (targets) stay in the loss, replicated
            wrapper = ShardedLoss(loss_module, fabric.device, convert)
            module = fabric.setup_module(wrapper)
            check_sharded(wrapper, fabric.world_size)
            opt = fabric.setup_optimizers(build_optimizer(optimizer, module.parameters()))
        elif isinstance(optimizer, torch.optim.Optimizer):
            wrapper = LossForwarder(loss_module, fabric.device, convert, call=self._compiled_call())
            module, opt = fabric.setup(wrapper, optimizer)
        else:
            wrapper = LossForwarder(loss_module, fabric.device, convert, call=self._compiled_call())
            module = fabric.setup_module(wrapper)
            default = fused_adam if compile and optimizer is None else optimizer
            opt = fabric.setup_optimizers(build_optimizer(default, module.parameters()))
        object.__setattr__(self, "_wrapper", wrapper if sharded else None)
        object.__setattr__(self, "_module", module)
        self.optimizer = opt
        self.capabilities = Capabilities(sharded=sharded, distributed=fabric.world_size > 1)
        self._samples = SampleTrace()
        if fabric.world_size > 1:
            _lifecycle.register(self, group_existed)

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Release the learner's distributed state; idempotent.

        Closing the last learner of a process group this package started ends the group in a
        safe order (see ``_lifecycle``), so every rank must close it, as every rank built it.
        A script that just returns gets the same teardown from an exit hook.
        """
        if self._closed:
            return
        self._closed = True
        if self.capabilities.distributed:
            _lifecycle.close(self)

    def __enter__(self) -> "FabricLearner":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:  # on an error, the exit hook ends this rank without waiting for peers
            self.close()

    # ---- the step, through Fabric ---------------------------------------------------------

    def _compiled_call(self):
        """The ``CompiledLoss`` for the forwarder with ``compile=True``, else ``None`` (call the loss)."""
        return None if self._loss_call is self.loss_module else self._loss_call

    def _forward(self, batch):
        # The strategy's module (DDP, FSDP2, or the forwarder) under the precision's forward
        # context: what `_FabricModule.forward` adds beyond that (input/output conversion,
        # backward-hook checks) is done by the carrier or not needed, and costs ~0.1-0.3 ms.
        with self._precision.forward_context():
            carried, _ = self._module._forward_module(Carrier(batch))
        return carried.value

    def _backward(self, loss: torch.Tensor, seed: torch.Tensor) -> None:
        loss = self._precision.convert_output(loss)
        self.fabric.backward(loss, seed.to(loss.dtype), model=self._module)

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        # Only ever enter the no-sync context with enabled=True: Fabric's FSDP2 variant leaves
        # sync in the state of `enabled` on exit, so enabled=False would switch sync off for good.
        if sync or isinstance(self.fabric.strategy, SingleDeviceStrategy):
            return contextlib.nullcontext()
        return self.fabric.no_backward_sync(self._module, enabled=True)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        norm = self.fabric.clip_gradients(self._module, self.optimizer, max_norm=max_norm, error_if_nonfinite=False)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _refuse_step(self, grad_norm: torch.Tensor) -> bool:
        # A grad scaler owns inf gradients (it skips such steps itself), so then only a non-finite
        # loss refuses the step, and whether any rank saw one takes a collective.
        scaler = self._scaler_handles_overflow()
        flag = self._window_loss_nonfinite() if scaler else super()._refuse_step(grad_norm)
        if self.world_size == 1:
            return flag
        self._samples.add(self._window_samples)
        if not scaler and not self._samples.due(self.num_updates):
            return flag  # no collective: see Learner._refuse_step
        packet = self._samples.packet(flag, self.fabric.device)
        torch.distributed.all_reduce(packet, op=torch.distributed.ReduceOp.MAX)
        return self._samples.read(packet, self.num_updates)

    def _scaler_handles_overflow(self) -> bool:
        return getattr(self._precision, "scaler", None) is not None

    def _abandon_window(self) -> None:
        super()._abandon_window()
        scaler = getattr(self._precision, "scaler", None)
        if scaler is not None and getattr(scaler, "_per_optimizer_states", None):
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
            raise RuntimeError(
                f"Rank {self.global_rank}: update() call {self.num_updates * self.grad_accum_steps + self._accum_step + 1} "
                f"could not complete a collective with the other ranks ({lost}). Another rank called update() fewer "
                "times, ended or died, or is busy elsewhere for longer than the process-group timeout "
                f"({getattr(self.fabric.strategy, '_timeout', None) if self._timeout is None else self._timeout}). "
                "Every rank must call update() the same number of times; see that rank's output for its own error."
            ) from err
        plugin = self._precision
        if type(plugin).convert_output is not Precision.convert_output:
            result = result.apply(plugin.convert_output)  # reported values in the default dtype
        return result

    def _named_parameters(self):
        if self._wrapper is not None:
            return self._wrapper.named_loss_parameters()
        return super()._named_parameters()

    # ---- attributes -----------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """See ``Learner.full_parameters``: under FSDP, every rank must enter it together."""
        if self._wrapper is None:
            return super().full_parameters()
        return self._wrapper.full_parameters_in_loss()

    @property
    def sharded_module(self) -> ShardedLoss | None:
        """The ``ShardedLoss`` under sharded strategies (``full_parameters_in_loss()`` lives there)."""
        return self._wrapper

    # ---- weights and state under sharding (collectives) -------------------------------------

    def get_weights(self, *, cpu_offload: bool = True) -> TensorDictBase:
        """Plain tensors; under sharded strategies a collective that every rank must call.

        Sharded, ``cpu_offload=True``: full weights on rank 0, an empty TensorDict elsewhere;
        ``cpu_offload=False``: full weights on every rank.
        """
        if self._wrapper is None:
            return super().get_weights(cpu_offload=cpu_offload)
        full = self._full_parameters(cpu_offload)
        if not full:
            return TensorDict()
        wrapper = self._wrapper
        by_id = {id(wrapper._originals[name]): name for name in wrapper.names}
        if self.policy is None:
            return TensorDict({n: full[n] for n in wrapper.names}, batch_size=[]).unflatten_keys(".")
        layout = TensorDict.from_module(self.policy)
        device = torch.device("cpu") if cpu_offload else None

        def fill(t):
            name = by_id.get(id(t))
            if name is not None:
                return full[name]
            t = t.detach()
            return t.to(device) if device is not None and t.device != device else t.clone()

        return layout.apply(fill, batch_size=[])

    def _full_parameters(self, cpu_offload: bool) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        wrapper = self._wrapper
        state = get_model_state_dict(wrapper, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
        if not state:
            return {}
        return {n: state[flat_name(n)].detach().reshape(wrapper.shapes[n]).clone() for n in wrapper.names}

    def _rng_states(self) -> list[dict[str, torch.Tensor]]:
        if self.world_size == 1:
            return super()._rng_states()
        gathered = self.fabric.all_gather(_rng.local_state())
        return [{k: v[r].cpu().clone() for k, v in gathered.items()} for r in range(self.world_size)]

    def _loss_buffers(self) -> dict[str, torch.Tensor]:
        names = set(self._wrapper.names)
        return {k: v for k, v in self.loss_module.state_dict(keep_vars=True).items() if k not in names}

    def _model_state(self) -> dict[str, Any]:
        if self._wrapper is None:
            return super()._model_state()
        full = self._full_parameters(cpu_offload=False)
        state = self.loss_module.state_dict()
        return {k: full[k] if k in full else v for k, v in state.items()}

    def _model_shapes(self) -> dict[str, tuple]:
        if self._wrapper is None:
            return super()._model_shapes()
        shapes = {k: tuple(v.shape) for k, v in self._loss_buffers().items()}
        shapes.update({n: tuple(s) for n, s in self._wrapper.shapes.items()})
        return {k: shapes[k] for k in self.loss_module.state_dict(keep_vars=True)}

    def _load_model_state(self, state) -> None:
        if self._wrapper is None:
            return super()._load_model_state(state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        wrapper = self._wrapper
        params = {flat_name(n): state[n].reshape(getattr(wrapper, flat_name(n)).shape) for n in wrapper.names}
        set_model_state_dict(wrapper, params, options=StateDictOptions(full_state_dict=True, strict=False))
        with torch.no_grad():
            for k, buffer in self._loss_buffers().items():
                buffer.copy_(state[k])

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _optimizer_state(self) -> dict[str, Any]:
        if self._wrapper is None:
            return super()._optimizer_state()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        wrapper = self._wrapper
        by_flat = {flat_name(n): n for n in wrapper.names}
        full = get_optimizer_state_dict(wrapper, self._raw_optimizer(), options=StateDictOptions(full_state_dict=True))
        names = self._optimizer_param_names()
        index = {n: i for i, n in enumerate(names)}
        state = {}
        for fqn, fields in full["state"].items():
            name = by_flat[fqn]
            state[index[name]] = {f: _loss_shaped(v, wrapper.shapes[name]) for f, v in fields.items()}
        groups = [dict(g, params=[index[by_flat[p]] for p in g["params"]]) for g in full["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _load_optimizer_state(self, state) -> None:
        if self._wrapper is None:
            return super()._load_optimizer_state(state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        wrapper = self._wrapper
        names = self._optimizer_param_names()
        moments = {}
        for i, fields in state["state"].items():
            param = getattr(wrapper, flat_name(names[int(i)]))
            moments[flat_name(names[int(i)])] = {
                f: v.reshape(param.shape) if isinstance(v, torch.Tensor) and v.shape != param.shape
                and v.numel() == param.numel() else v
                for f, v in fields.items()
            }
        groups = [dict(g, params=[flat_name(names[i]) for i in g["params"]]) for g in state["param_groups"]]
        set_optimizer_state_dict(wrapper, self._raw_optimizer(), {"state": moments, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))

    # ---- checkpoints on disk --------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the learner's state; every rank must call it.

        Unsharded: one file through ``fabric.save``, written on rank 0 to a temporary file beside
        ``path``, flushed to disk and renamed onto it (``AtomicCheckpointIO``). Sharded: a folder where each rank writes its own shards (see ``_dcp``), made
        current by an atomic rename of its ``LATEST`` file.
        """
        if self._wrapper is not None:
            return self._save_sharded(Path(path))
        if Path(path).is_dir():
            raise IsADirectoryError(f"{path} is a folder; a single-file checkpoint would replace it. Pass a file path.")
        error = overwrite_error(path) if self.global_rank == 0 else None
        if self.world_size > 1:  # rank 0 writes, so its answer holds for every rank
            error = self.fabric.broadcast(error, src=0)
        if error is not None:
            raise FileExistsError(error)
        # Fabric turns the module and optimizer into state dicts itself; the rest is _live_state's
        self.fabric.save(path, {"format": FORMAT, "model": self.loss_module, "optimizer": self.optimizer,
                                "param_names": self._optimizer_param_names(), "accum_step": self._accum_step,
                                "num_updates": self.num_updates, "rng": self._rng_states()})

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by any learner, any strategy or world size.

        Never runs code from the file: files load ``weights_only``, sharded folders through
        ``_dcp.SafeReader``. Everything is validated before anything changes.
        """
        with naming(path):
            if _dcp.is_sharded_checkpoint(path):
                if self._wrapper is not None:
                    return self._load_sharded(Path(path))
                return self.load_checkpoint(_dcp.read_full(path))
            if Path(path).is_dir():
                raise FileNotFoundError(f"{path} is a folder but holds no fabric_learner checkpoint (no LATEST file).")
            # every rank reads the file itself, as fabric.load does, but through the checked reader
            self.load_checkpoint(read_learner_file(path))

    def _save_sharded(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        wrapper, rank = self._wrapper, self.global_rank
        if rank == 0:
            _dcp.check_target(path)
        self.fabric.barrier()
        version = self.fabric.broadcast(_dcp.new_version_name(self.num_updates) if rank == 0 else None, src=0)
        model = get_model_state_dict(wrapper)
        tensors = {f"model/{n}": model[flat_name(n)] for n in wrapper.names}
        tensors.update({f"model/{k}": v.detach() for k, v in self._loss_buffers().items()})
        optim = get_optimizer_state_dict(wrapper, self._raw_optimizer())
        by_flat = {flat_name(n): n for n in wrapper.names}
        scalars: dict[str, dict[str, Any]] = {}
        for fqn, fields in optim["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{by_flat[fqn]}/{field}"] = value
                else:
                    scalars.setdefault(by_flat[fqn], {})[field] = value
        groups = [{**_jsonable(g), "params": [by_flat[p] for p in g["params"]]} for g in optim["param_groups"]]
        tensors.update(_dcp.rng_tensors(self._rng_states()))
        meta = {
            "num_updates": self.num_updates, "accum_step": self._accum_step,
            "model_keys": list(self.loss_module.state_dict(keep_vars=True)),
            "param_names": self._optimizer_param_names(), "param_groups": groups, "optim_scalars": scalars,
            "shapes": {**{k: list(v.shape) for k, v in self._loss_buffers().items()},
                       **{n: list(s) for n, s in wrapper.shapes.items()}},
            "world_size": self.world_size,
        }
        path.mkdir(parents=True, exist_ok=True) if rank == 0 else None
        self.fabric.barrier()
        _dcp.save_version(path, version, tensors, meta, rank)
        self.fabric.barrier()
        if rank == 0:
            _dcp.publish(path, version)
        self.fabric.barrier()

    def _load_sharded(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        folder = _dcp.latest_version(path)
        meta = _dcp.read_meta(folder)  # checked against the stored tensors
        wrapper = self._wrapper
        self._check_sharded_meta(meta, path)
        rng = _dcp.read_rng(folder)
        _rng.check(rng)
        # Fresh targets of the same sharding: a read that fails mid-way leaves live state untouched.
        model = get_model_state_dict(wrapper)
        tensors = {f"model/{n}": torch.empty_like(model[flat_name(n)]) for n in wrapper.names}
        buffers = {k: torch.empty_like(v) for k, v in self._loss_buffers().items()}
        tensors.update({f"model/{k}": v for k, v in buffers.items()})
        optim = get_optimizer_state_dict(wrapper, self._raw_optimizer())
        by_flat = {flat_name(n): n for n in wrapper.names}
        for fqn, fields in optim["state"].items():
            for field, value in fields.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{by_flat[fqn]}/{field}"] = torch.empty_like(value)
        _dcp.load_into(tensors, folder, distributed=True)
        set_model_state_dict(wrapper, {flat_name(n): tensors[f"model/{n}"] for n in wrapper.names},
                             options=StateDictOptions(strict=False))
        with torch.no_grad():
            for k, buffer in self._loss_buffers().items():
                buffer.copy_(buffers[k])
        for fqn, fields in optim["state"].items():
            for field in list(fields):
                key = f"optim/{by_flat[fqn]}/{field}"
                if key in tensors:
                    fields[field] = tensors[key]
                else:
                    fields[field] = meta["optim_scalars"].get(by_flat[fqn], {}).get(field, fields[field])
        saved_groups = meta["param_groups"]
        for group, saved in zip(optim["param_groups"], saved_groups):
            # JSON has no tuples: give hyper-parameters such as Adam's betas their type back
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v
                          for k, v in saved.items() if k != "params"})
        set_optimizer_state_dict(wrapper, self._raw_optimizer(), optim)
        self._resume_counters(int(meta["num_updates"]), int(meta["accum_step"]), rng)

    def _check_sharded_meta(self, meta: dict[str, Any], path: Path) -> None:
        """Raise before anything is read if the checkpoint is not of this loss module and optimizer."""
        shapes = self._model_shapes()
        if sorted(meta["model_keys"]) != sorted(shapes) or \
                sorted(meta["param_names"]) != sorted(self._optimizer_param_names()):
            raise ValueError(
                f"The checkpoint at {path} was saved from a different loss module or optimizer; nothing was "
                "loaded. Load it into a learner built the same way as the one that saved it."
            )
        wrong = [f"{k}: {meta['shapes'][k]} vs {list(s)}" for k, s in shapes.items()
                 if math.prod(meta["shapes"][k]) != math.prod(s)]
        if wrong:
            raise ValueError(f"The checkpoint at {path} has other shapes than this loss module ({wrong[:8]}); "
                             "nothing was loaded. Load it into a learner built the same way as the one that saved it.")
        ours, theirs = len(self.optimizer.param_groups), len(meta["param_groups"])
        if ours != theirs:
            raise ValueError(f"The checkpoint at {path} has {theirs} optimizer param group(s), this learner "
                             f"{ours}; nothing was loaded. Build the optimizer with the same param groups.")


def _lost_peer(err: RuntimeError) -> str | None:
    """What a collective's error says about the other ranks, when it is about them."""
    text = str(err)
    if "timed out" in text.lower():
        return "it timed out waiting for them"
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")):
        return "a peer closed its connection"
    return None


def _loss_shaped(value: Any, shape) -> Any:
    if isinstance(value, torch.Tensor) and tuple(shape) == () and tuple(value.shape) == (1,):
        return value.reshape(())
    return value


def _jsonable(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else v.tolist()
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
