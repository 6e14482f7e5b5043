"""FSDP2 placement: a ``ShardedLoss`` set up by Fabric, its optimizer built after sharding.

How the loss is cut lives in ``fabric_learner.sharding``; how its state is named for torch's
state-dict API in ``sharded_state``; the folder format in ``checkpoint.dcp_folder``. This module
only wires them to ``FabricLearner``. Weights and state go through torch's distributed state-dict
API, so every method that reads or writes them is a collective.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fabric_learner.backends import sharded_state
from fabric_learner.backends.base import Counters, Resumed, Setup, setup_stage_optimizers
from fabric_learner.checkpoint import dcp_folder, learner_state
from fabric_learner.checkpoint.frozen import frozen_keys
from fabric_learner.optim import build_optimizer
from fabric_learner.sharding import ShardedLoss, check_sharded, precision_policy, shard_loss
from fabric_learner.step import rng as _rng
from fabric_learner.step.stages import StageOptimizers


def default_sharded_strategy(timeout=None):
    """What ``strategy="fsdp"`` means here: Fabric's FSDP2 strategy with ``shard_loss``."""
    from lightning.fabric.strategies import ModelParallelStrategy

    kwargs = {} if timeout is None else {"timeout": timeout}
    return ModelParallelStrategy(parallelize_fn=shard_loss, **kwargs)


def quiet_view_output_warning() -> None:
    """Hide FSDP2's "returned a view tensor" warning for the learner's own ``ShardedLoss`` only.

    FSDP2 warns when a sharded module returns a view that requires grad (DDPGLoss's
    ``pred_value`` is a squeezed view): an in-place op on that view *after* the forward would drop
    FSDP's pre-backward hook. The learner never writes into the loss output: it sums the loss
    entries out of place and reports detached copies. So the hazard cannot arise on this module,
    and DDPG's gradients under FSDP equal one process's (tests/test_fsdp.py, 2 ranks). Any other
    FSDP2 module (a user's own) still warns; the filter is installed once, deduplicated by
    ``warnings``.
    """
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPShardedLoss\) returned a view tensor",
                            category=UserWarning)


class ShardedBackend:
    """FSDP2: the loss's trained parameters owned by a ``ShardedLoss``, sharded by the strategy's plan.

    Examples:
        Building one needs Fabric launched with a ``ModelParallelStrategy`` (a process group); what it
        refuses is known before any rank starts:

        >>> import torch
        >>> from fabric_learner.backends import ShardedBackend
        >>> ShardedBackend.sharded
        True
        >>> ShardedBackend.refuse(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), compile=False)
        Traceback (most recent call last):
            ...
        ValueError: A sharded strategy builds the optimizer after sharding, so it needs a factory, not an ...

        ``FabricLearner(loss, optimizer_factory, strategy="fsdp", devices=2)`` builds it on both ranks,
        each holding half of every parameter; with one rank it holds them whole.
    """

    sharded = True

    @classmethod
    def refuse(cls, optimizer: Any, compile: bool) -> None:
        if compile:
            raise ValueError(
                "compile=True is not supported with sharded strategies (FSDP) yet; nothing was launched. Use "
                "compile=True on a single device or under DDP, or compile=False under FSDP."
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "A sharded strategy builds the optimizer after sharding, so it needs a factory, not an "
                "instance: pass e.g. optimizer=functools.partial(torch.optim.Adam, lr=3e-4), or None for Adam."
            )

    def __init__(self, setup: Setup) -> None:
        self.refuse(setup.optimizer, setup.compile)
        fabric, loss_module = setup.fabric, setup.loss_module
        loss_module.to(fabric.device)  # buffers (targets) stay in the loss, replicated
        # in the precision's dtype (bf16-true): Fabric converts only the module it sets up, which holds no buffer
        fabric.strategy.precision.convert_module(loss_module)
        self.fabric, self.loss_module = fabric, loss_module
        self.sharded_module = ShardedLoss(loss_module, fabric.device, setup.convert,
                                          serve=[setup.policy] if setup.policy is not None else [],
                                          mp_policy=precision_policy(getattr(fabric.strategy.precision, "precision", "")))
        quiet_view_output_warning()
        self.module = fabric.setup_module(self.sharded_module)
        check_sharded(self.sharded_module, fabric.world_size)
        if setup.stages:
            self.optimizer = setup_stage_optimizers(fabric, setup.stages, self.sharded_module.named_loss_parameters())
        else:
            # the loss's order, as a one-process learner lists them
            params = [p for _, p in self.sharded_module.named_loss_parameters()]
            self.optimizer = fabric.setup_optimizers(build_optimizer(setup.optimizer, params))
        self._stager: dcp_folder.Stager | None = None  # staging buffers kept between background saves

    def _raw_optimizers(self) -> list:
        """The torch optimizers behind Fabric's wrappers: one, or one per stage in stage order."""
        if isinstance(self.optimizer, StageOptimizers):
            return [getattr(o, "optimizer", o) for o in self.optimizer.by_stage.values()]
        return [getattr(self.optimizer, "optimizer", self.optimizer)]

    def _raw_optimizer(self):
        """What torch's state-dict API takes: the torch optimizer, or the list of the stages'."""
        raw = self._raw_optimizers()
        return raw if isinstance(self.optimizer, StageOptimizers) else raw[0]

    def named_parameters(self):
        return self.sharded_module.named_loss_parameters()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        return self.sharded_module.full_parameters()

    def weights_changed(self) -> None:
        self.sharded_module.weights_changed()

    def serve(self, module: nn.Module) -> bool:
        return self.sharded_module.serve(module)

    def served_parameters(self) -> set[int]:
        return self.sharded_module.served_parameters()

    # ---- weights and state (collectives) -----------------------------------------------------

    def get_weights(self, policy: nn.Module | None, cpu_offload: bool):
        return sharded_state.policy_weights(self.sharded_module, policy, cpu_offload)

    def model_state(self) -> dict[str, Any]:
        return sharded_state.model_state(self.sharded_module)

    def model_shapes(self) -> dict[str, tuple]:
        return sharded_state.model_shapes(self.sharded_module)

    def load_model_state(self, state) -> None:
        sharded_state.load_model_state(self.sharded_module, state)

    def optimizer_state(self, param_names) -> dict[str, Any]:
        """Full optimizer state indexed as ``param_names`` (per stage when it is a dict of them)."""
        owner = self.sharded_module
        if isinstance(param_names, dict):
            return {"stages": {stage: sharded_state.optimizer_state(owner, raw, param_names[stage])
                               for stage, raw in zip(self.optimizer.by_stage, self._raw_optimizers())}}
        return sharded_state.optimizer_state(owner, self._raw_optimizer(), param_names)

    def load_optimizer_state(self, state, param_names) -> None:
        owner = self.sharded_module
        if isinstance(param_names, dict):
            for stage, raw in zip(self.optimizer.by_stage, self._raw_optimizers()):
                sharded_state.load_optimizer_state(owner, raw, state["stages"][stage], param_names[stage])
            return
        sharded_state.load_optimizer_state(owner, self._raw_optimizer(), state, param_names)

    # ---- checkpoints on disk: a DCP folder ---------------------------------------------------

    def save(self, path: Path, counters: Counters, blocking: bool = True):
        """Write a version of the folder ``path`` (a collective); with ``blocking=False`` return the
        future of its background write and publish (see ``dcp_folder.save_version_async``)."""
        owner = self.sharded_module

        frozen = frozen_keys(self.loss_module)  # not written: see checkpoint.frozen

        def build():
            tensors, scalars, groups = sharded_state.sharded_tensors(owner, self._raw_optimizer(), frozen)
            tensors.update(dcp_folder.rng_tensors(counters.rng))
            meta = {
                "num_updates": counters.num_updates, "accum_step": counters.accum_step,
                "model_keys": [k for k in self.loss_module.state_dict(keep_vars=True) if k not in frozen],
                "param_names": counters.optimizer_param_names, "param_groups": groups, "optim_scalars": scalars,
                "shapes": sharded_state.shapes_meta(owner), "world_size": self.fabric.world_size,
            }
            if isinstance(counters.param_names, dict):  # each stage's parameters, so unsharded learners split them
                meta["stages"] = counters.param_names
            return tensors, meta

        if not blocking and self._stager is None:
            self._stager = dcp_folder.Stager()
        return dcp_folder.write_version(self.fabric, path, counters.num_updates, build,
                                        None if blocking else self._stager)

    def load_folder(self, path: Path) -> Resumed:
        """Each rank reads its own shards (a collective), resharding as needed; in place."""
        folder = dcp_folder.latest_version(path)
        meta = dcp_folder.read_meta(folder)  # checked against the stored tensors
        self._check_meta(meta, path)
        rng = dcp_folder.read_rng(folder)
        _rng.check(rng)
        tensors, optim = sharded_state.load_targets(self.sharded_module, self._raw_optimizer())
        stored = set(meta["model_keys"])  # frozen parameters may be absent (checked in _check_meta)
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model/") or k[len("model/"):] in stored}
        dcp_folder.load_into(tensors, folder, distributed=True)
        sharded_state.apply_loaded(self.sharded_module, self._raw_optimizer(), tensors, optim, meta)
        return Resumed(int(meta["num_updates"]), int(meta["accum_step"]), rng)

    def _check_meta(self, meta: dict[str, Any], path: Path) -> None:
        """Raise before anything is read if the checkpoint is not of this loss module and optimizer."""
        shapes = self.model_shapes()
        named = list(self.named_parameters())
        required = set(shapes) - frozen_keys(self.loss_module)  # frozen parameters may be left out
        if not required <= set(meta["model_keys"]) <= set(shapes) or \
                sorted(meta["param_names"]) != sorted(learner_state.optimizer_param_names(named, self.optimizer)):
            raise ValueError(
                f"The checkpoint at {path} was saved from a different loss module or optimizer; nothing was "
                "loaded. Load it into a learner built the same way as the one that saved it."
            )
        wrong = [f"{k}: {meta['shapes'][k]} vs {list(s)}" for k, s in shapes.items()
                 if k in meta["shapes"] and math.prod(meta["shapes"][k]) != math.prod(s)]
        if wrong:
            raise ValueError(f"The checkpoint at {path} has other shapes than this loss module ({wrong[:8]}); "
                             "nothing was loaded. Load it into a learner built the same way as the one that saved it.")
        staged = learner_state.saved_param_names(named, self.optimizer, isinstance(self.optimizer, StageOptimizers))
        staged = {k: sorted(v) for k, v in staged.items()} if isinstance(staged, dict) else None
        saved = {k: sorted(v) for k, v in meta["stages"].items()} if "stages" in meta else None
        # a folder without "stages" may be a staged one written before they were recorded: its groups decide
        if saved is not None and staged != saved:
            raise ValueError(f"The checkpoint at {path} holds optimizer state for stages {sorted(saved)}; this "
                             f"learner has {f'stages {sorted(staged)}' if staged else 'a single optimizer'}"
                             f"{' (training other parameters)' if staged and sorted(staged) == sorted(saved) else ''}. "
                             "Nothing was loaded: build the learner with the same stages.")
        ours, theirs = len(self.optimizer.param_groups), len(meta["param_groups"])
        if ours != theirs:
            raise ValueError(f"The checkpoint at {path} has {theirs} optimizer param group(s), this learner "
                             f"{ours}; nothing was loaded. Build the optimizer with the same param groups.")
        names = {id(p): n for n, p in named}
        ours_groups = {frozenset(names[id(p)] for p in g["params"]) for g in self.optimizer.param_groups}
        if ours_groups != {frozenset(g["params"]) for g in meta["param_groups"]}:
            raise ValueError(f"The checkpoint at {path} groups the optimizer's parameters otherwise than this "
                             "learner; nothing was loaded. Build the optimizer with the same param groups.")
