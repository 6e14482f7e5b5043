"""Every use of a private Lightning, torch or torchrl API, in one place.

Checked against torch 2.13.0, lightning 2.6.6 and torchrl 0.14.1. Each function says why the
public API does not serve; ``tests/test_compat.py`` fails loudly, naming the attribute, when an
upgrade removes one of them, so a version bump breaks here and not deep inside a run.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch import nn


def wrapped_forward(module: Any):
    """The strategy's module inside Fabric's ``_FabricModule`` (DDP, FSDP2 or the plain module).

    Calling it skips ``_FabricModule.forward``'s input and output conversion, which the carrier
    does itself, and its ~0.1-0.3 ms of checks per call.
    """
    return module._forward_module


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The process-group timeout a Fabric DDP/FSDP2 strategy was given (no public getter)."""
    return getattr(strategy, "_timeout", None)


def default_store():
    """The default process group's rendezvous store (a c10d ``Store``; torch has no public getter)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def set_strategy_timeout(strategy: Any, timeout: timedelta) -> None:
    """Set the timeout a strategy Fabric resolved from a name starts its group with (no public setter)."""
    strategy._timeout = timeout


def set_group_timeout(timeout: timedelta, group: Any) -> None:
    """Change an existing process group's collective timeout (torch has no public call for it)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def strategy_mesh(strategy: Any):
    """The device mesh Fabric's ``ModelParallelStrategy`` built (``device_mesh`` raises before setup)."""
    return getattr(strategy, "_device_mesh", None)


def flatten_mesh(mesh: Any, name: str):
    """A 1-D mesh over all dimensions of ``mesh`` (torch's ``DeviceMesh._flatten``; no public equivalent)."""
    return mesh[tuple(mesh.mesh_dim_names)]._flatten(name)


def root_mesh(mesh: Any):
    """The mesh ``mesh`` was sliced from (itself when it is no slice); torch has no public call for it."""
    root = getattr(mesh, "_get_root_mesh", None)
    return mesh if root is None else root()


def scaler_unscaled_this_step(scaler: Any) -> bool:
    """Whether a ``GradScaler`` holds per-optimizer state for a step not taken yet (it must be updated)."""
    return bool(getattr(scaler, "_per_optimizer_states", None))


def fabric_callbacks(fabric: Any) -> list:
    """The callbacks Fabric calls around optimizer steps (``Fabric(callbacks=...)``; no public getter)."""
    return list(getattr(fabric, "_callbacks", []))


def allow_unused_parameters(strategy: Any) -> None:
    """Make a Fabric ``DDPStrategy`` wrap with ``find_unused_parameters=True`` (set before setup).

    Needed when a backward reaches only part of the module (one stage of several optimizers);
    Fabric keeps the DDP keyword arguments in ``_ddp_kwargs`` with no public setter.
    """
    strategy._ddp_kwargs["find_unused_parameters"] = True


def ddp_option(strategy: Any, name: str) -> Any:
    """A keyword argument a Fabric ``DDPStrategy`` will pass to ``DistributedDataParallel`` (no public getter)."""
    return getattr(strategy, "_ddp_kwargs", {}).get(name)


def release_ddp_group(ddp: Any) -> None:
    """Drop a ``DistributedDataParallel``'s internal references to its process group.

    Its ``reducer``, ``logger`` and ``process_group`` attributes keep the group alive; the last
    reference dropping at the wrong moment ends the group in a way that can hang (see
    ``launch.teardown``). DDP has no public call for releasing them.
    """
    for attr in ("reducer", "logger", "process_group"):
        if hasattr(ddp, attr):
            try:
                setattr(ddp, attr, None)
            except (AttributeError, TypeError):
                pass


def stored_priorities(sampler: Any, index: Any):
    """The priorities a torchrl ``PrioritizedSampler`` holds for ``index`` (``None`` for other samplers).

    They live in its sum tree, already raised to ``alpha``; torchrl has no getter for them.
    """
    tree = getattr(sampler, "_sum_tree", None)
    return None if tree is None else torch.as_tensor(tree[index]).clone()


def restore_priorities(sampler: Any, index: Any, stored: Any) -> None:
    """Give ``index`` the stored priorities read by ``stored_priorities``, through the public setter.

    ``update_priority`` applies ``(p + eps) ** alpha``, so the raw priority is recovered first.
    """
    raw = stored.double().clamp_min(0) ** (1.0 / sampler._alpha) - sampler._eps
    sampler.update_priority(index, raw.clamp_min(0).to(stored.dtype))


def erase_loss_cache(loss: nn.Module) -> None:
    """Drop a torchrl loss's cached views of its parameters (``LossModule._erase_cache``).

    torchrl caches target/parameter views; they must not outlive a swap of the parameters.
    """
    erase = getattr(loss, "_erase_cache", None)
    if erase is not None:
        erase()


def tensor_slots(module: nn.Module, attr: str) -> dict:
    """The dict of ``module`` that holds its tensor ``attr`` (``_parameters``, ``_buffers`` or ``__dict__``).

    A layer's weights are swapped for one call by writing that dict, as ``TensorDict.to_module``
    does: ``setattr`` refuses a plain tensor where a parameter was, and torch's public swap
    (``torch.func.functional_call``) replaces the whole call.
    """
    for store in (module._parameters, module._buffers):
        if attr in store:
            return store
    return module.__dict__


def batched_parts(t: Any) -> tuple[torch.Tensor, int, int] | None:
    """``(unwrapped tensor, vmap level, batch dim)`` of a tensor batched by ``vmap``, else None.

    A module called inside torchrl's ``vmap`` over stacked weights sees functorch's batched
    wrappers in its slots; torch has no public way to see through one to the stacked tensor.
    """
    from torch._C import _functorch

    if not isinstance(t, torch.Tensor) or not _functorch.is_batchedtensor(t):
        return None
    return _functorch.get_unwrapped(t), _functorch.maybe_get_level(t), _functorch.maybe_get_bdim(t)


def batch_at(t: torch.Tensor, level: int, dim: int = 0) -> torch.Tensor:
    """``t`` batched along ``dim`` at vmap ``level``, as ``vmap`` batches its own inputs."""
    from torch._C import _functorch

    return _functorch._add_batch_dim(t, dim, level)


def vmap_levels() -> list[tuple[int, str | None]]:
    """``(level, randomness)`` of each functorch transform active now, innermost last (randomness
    only for ``vmap``)."""
    from torch._functorch import pyfunctorch

    out = []
    for interpreter in pyfunctorch.retrieve_all_functorch_interpreters():
        randomness = interpreter.randomness() if hasattr(interpreter, "randomness") else None
        out.append((interpreter.level(), randomness))
    return out


def outside_functorch():
    """A context in which the innermost functorch transform is suspended: code inside runs on
    plain tensors, as outside ``vmap`` (what torch does itself to run a custom autograd
    function's forward under ``vmap``)."""
    from torch._functorch import pyfunctorch

    return pyfunctorch.temporarily_pop_interpreter_stack()


def watch_target_updaters(loss: nn.Module, built) -> None:
    """Call ``built()`` when a torchrl target-network updater is constructed on ``loss``, before it copies
    the online weights into the targets (its constructor first marks every entry of the loss's private
    ``_has_update_associated``)."""
    marks = vars(loss).get("_has_update_associated")
    if not isinstance(marks, dict) or isinstance(marks, _UpdaterMarks):
        return

    vars(loss)["_has_update_associated"] = _UpdaterMarks(marks, built)


class _UpdaterMarks(dict):
    def __init__(self, marks: dict, built) -> None:
        super().__init__(marks)
        self._built = built

    def __setitem__(self, key, value) -> None:
        if value:
            self._built()
        super().__setitem__(key, value)


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """``output`` = every rank's ``tensor``, concatenated. torch 2.13 deprecates ``all_gather_into_tensor``
    (a ``FutureWarning`` per call site) for ``all_gather_single``, which older torch lacks."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def all_gather_stacked(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` of the default group, stacked (``world_size, ...``), as ``Fabric.all_gather`` gives
    it without its route through ``torch.distributed.nn.functional.all_gather`` (a ``FutureWarning`` in torch 2.13)."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def take_over_child_observers(look) -> None:
    """Replace what Lightning's child-process observer threads do at each look with ``look(children)``.

    Lightning's ``_SubprocessScriptLauncher`` (plain ``python``: rank 0 starts the other ranks) runs
    a ``_ChildProcessObserver`` thread whose ``_run`` polls the children every 5 s and, on a non-zero
    exit, SIGKILLs every process, rank 0 included; no public setting changes that. ``look`` gets the
    children's ``Popen`` objects and returns True to end the observer.
    """
    import threading

    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # a Lightning without it: its own behaviour stays
        return
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and not getattr(thread, "_fabric_learner", False):
            thread._fabric_learner = True
            thread._run = lambda children=thread._child_processes: look(children)


def release_semaphores() -> None:
    """Unlink this process's named multiprocessing semaphores (a queue's locks) now, for a process ending with ``os._exit``.

    multiprocessing unlinks each at interpreter exit, by a finalizer (``SemLock._cleanup``) that
    ``os._exit`` skips; Python's resource tracker then unlinks them itself and warns "There appear to be
    N leaked semaphore objects". Only the names go: handles another process holds stay valid.
    """
    from multiprocessing import synchronize, util

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            finalizer()


def run_collector_node(rank: int, world: int, host: str, port: int) -> None:
    """Run one node of torchrl's ``DistributedCollector`` built with ``launcher="submitit_delayed"``.

    torchrl's only entry for a node that its main process does not launch itself is this function, which its
    public ``submitit_delayed_launcher`` calls on SLURM; ``python -m fabric_learner.collect`` calls it anywhere.
    """
    from torchrl.collectors.distributed import generic

    generic._distributed_init_delayed(rank, "gloo", host, port, world, verbose=False)


def required() -> list[tuple[str, Any, str]]:
    from multiprocessing import synchronize, util

    import torch.distributed.distributed_c10d as c10d
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.fabric.wrappers import _FabricModule
    from tensordict import TensorDict
    from torch._C import _functorch
    from torch._functorch import pyfunctorch
    from torch.amp import GradScaler
    from torch.distributed.device_mesh import DeviceMesh
    from torchrl.collectors.distributed import generic as distributed_generic
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler
    from torchrl.objectives import DQNLoss, LossModule

    from fabric_learner.replay import TorchPrioritizedSampler

    plain = TensorDict({"a": torch.zeros(1)}, [])
    return [
        # the learner's per-update fast paths for plain TensorDicts (fabric_learner.step.output, step.carrier)
        ("tensordict TensorDict", TensorDict, "_new_unsafe"),
        ("tensordict TensorDict", TensorDict, "_set_str"),
        ("tensordict TensorDict", plain, "_tensordict"),
        ("tensordict TensorDict", plain, "_td_dim_names"),
        *[("torch._C._functorch", _functorch, name) for name in (
            "is_batchedtensor", "get_unwrapped", "maybe_get_level", "maybe_get_bdim", "_add_batch_dim")],
        ("torch._functorch.pyfunctorch", pyfunctorch, "retrieve_all_functorch_interpreters"),
        ("torch._functorch.pyfunctorch", pyfunctorch, "temporarily_pop_interpreter_stack"),
        ("torch._functorch.pyfunctorch VmapInterpreter", pyfunctorch.VmapInterpreter, "randomness"),
        ("lightning _FabricModule", _FabricModule(nn.Linear(1, 1), strategy=DDPStrategy()), "_forward_module"),
        ("lightning DDPStrategy", DDPStrategy(), "_timeout"),
        ("lightning DDPStrategy", DDPStrategy(), "_ddp_kwargs"),
        ("lightning ModelParallelStrategy", ModelParallelStrategy(parallelize_fn=lambda m, mesh: m), "_timeout"),
        ("lightning ModelParallelStrategy", ModelParallelStrategy(parallelize_fn=lambda m, mesh: m), "_device_mesh"),
        ("lightning Fabric", Fabric(accelerator="cpu", devices=1), "_callbacks"),
        ("lightning _ChildProcessObserver", _ChildProcessObserver(main_pid=0, child_processes=[]), "_run"),
        ("lightning _ChildProcessObserver", _ChildProcessObserver(main_pid=0, child_processes=[]), "_child_processes"),
        ("torch.distributed.distributed_c10d", c10d, "_set_pg_timeout"),
        ("multiprocessing.util", util, "_finalizer_registry"),
        ("multiprocessing.synchronize SemLock", synchronize.SemLock, "_cleanup"),
        ("torch DeviceMesh", DeviceMesh, "_flatten"),
        ("torch GradScaler", GradScaler("cpu"), "_per_optimizer_states"),
        ("torchrl LossModule", LossModule, "_erase_cache"),
        ("torchrl.collectors.distributed.generic", distributed_generic, "_distributed_init_delayed"),
        ("torchrl LossModule", DQNLoss(nn.Linear(2, 2), action_space="categorical"), "_has_update_associated"),
        ("torch nn.Module", nn.Linear(1, 1), "_parameters"),
        ("torch nn.Module", nn.Linear(1, 1), "_buffers"),
        ("torchrl PrioritizedSampler", PrioritizedSampler, "update_priority"),
        ("fabric_learner TorchPrioritizedSampler", TorchPrioritizedSampler(8, alpha=0.5, beta=0.5), "_sum_tree"),
        ("fabric_learner TorchPrioritizedSampler", TorchPrioritizedSampler(8, alpha=0.5, beta=0.5), "_alpha"),
        ("fabric_learner TorchPrioritizedSampler", TorchPrioritizedSampler(8, alpha=0.5, beta=0.5), "_eps"),
    ]
