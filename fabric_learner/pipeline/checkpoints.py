"""Pipeline checkpoints in the layout every learner reads: the whole model's names, each stage writing its own part.

The stages of a ``PipelineLearner`` hold disjoint parts of one model under the whole model's parameter names
(``sharding.pipeline_split``), so the whole model's checkpoint is the union of the stages' parts, and nothing in
it says how the model was split:

- ``save(path)`` writes the sharded folder of ``checkpoint.dcp_folder`` (what FSDP writes): each stage writes
  its own parameters, buffers and optimizer moments as ``model/<name>`` and ``optim/<name>/<field>``; rank 0
  writes ``meta.json`` for the whole model (its keys and shapes, and one optimizer over all its trained
  parameters, as one process's learner has it). LocalLearner, DDP and FSDP learners load it as they load
  FSDP's. The folder's version switches atomically (``LATEST``): a save that fails or dies mid-write leaves
  the previous version current.
- ``load(path)`` reads such a folder (from any learner) or a single file (LocalLearner, DDP): each stage
  reads only its own part, checked against the whole model as it was before the split (``WholeModel``).
- ``checkpoint()`` / ``load_checkpoint()`` give and take the whole model's in-memory checkpoint, the dict
  ``LocalLearner.checkpoint()`` returns.

Every function here taking a learner is a collective: every rank calls it. A load reads and checks on every
stage, then the stages share their verdicts (one gather) before any of them changes anything, so a checkpoint
refused on one stage is refused on all, each naming what failed.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fabric_learner.backends.sharded_state import group_settings
from fabric_learner.checkpoint import dcp_folder
from fabric_learner.checkpoint.files import naming, read_learner_file
from fabric_learner.checkpoint.frozen import frozen_keys
from fabric_learner.checkpoint.validate import check_checkpoint, check_model_state, check_optimizer_state, clone_state
from fabric_learner.optim import optimizer_params
from fabric_learner.step import rng as _rng


@dataclass(frozen=True)
class WholeModel:
    """The unsplit loss's checkpoint layout, read before the split: what every stage's part belongs to.

    ``shapes``: every ``state_dict`` key of the whole loss and its shape; ``frozen``: the keys of frozen
    parameters (checkpoints leave them out, ``checkpoint.frozen``); ``param_names``: the trained parameters
    in the loss's order, which is the order one process's optimizer lists them in.
    """

    shapes: dict[str, tuple[int, ...]]
    frozen: frozenset[str]
    param_names: tuple[str, ...]

    @classmethod
    def of(cls, loss_module: nn.Module) -> WholeModel:
        shapes = {k: tuple(v.shape) for k, v in loss_module.state_dict(keep_vars=True).items()}
        names = tuple(n for n, p in loss_module.named_parameters() if p.requires_grad)
        return cls(shapes, frozen_keys(loss_module), names)

    @property
    def model_keys(self) -> list[str]:
        return [k for k in self.shapes if k not in self.frozen]


@dataclass
class _Loaded:
    """A checkpoint read for one stage: model tensors (the stage's, or the whole model's), moments and optimizer
    groups by parameter name, counters and random states."""

    model: Mapping[str, torch.Tensor]
    moments: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    num_updates: int
    accum_step: int
    rng: Any


# ---- this stage's part ----------------------------------------------------------------------------------


def _names(loss_module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The whole-model names of the optimizer's parameters, in its state-dict order."""
    by_id = {id(p): n for n, p in loss_module.named_parameters()}
    return [by_id[id(p)] for p in optimizer_params(optimizer)]


def _stage_part(learner) -> dict[str, Any]:
    """This stage's model tensors (live, frozen ones left out), moments and groups by parameter name."""
    loss_module, optimizer = learner.loss_module, learner._torch_optimizer
    frozen = frozen_keys(loss_module)
    names = _names(loss_module, optimizer)
    state = optimizer.state_dict()
    return {
        "model": {k: v.detach() for k, v in loss_module.state_dict().items() if k not in frozen},
        "moments": {names[int(i)]: dict(fields) for i, fields in state["state"].items()},
        "groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _merged_groups(per_stage: list[list[dict[str, Any]]], whole: WholeModel) -> list[dict[str, Any]]:
    """The stages' param groups as one optimizer's: group ``i`` of every stage together (same settings)."""
    counts = sorted({len(groups) for groups in per_stage})
    if len(counts) != 1:
        raise ValueError(f"The stages' optimizers have {counts} param groups; a checkpoint of the whole model needs "
                         "the same groups on every stage. Nothing was written; build the optimizer the same way on "
                         "every stage.")
    order = {n: i for i, n in enumerate(whole.param_names)}
    merged = []
    for i in range(counts[0]):
        settings = [group_settings(groups[i]) for groups in per_stage]  # compared as JSON keeps them
        differing = sorted({k for s in settings for k in s if any(t.get(k) != s.get(k) for t in settings)})
        if differing:
            raise ValueError(f"Param group {i} has other hyper-parameters on different stages ({differing}); a "
                             "checkpoint of the whole model holds one optimizer. Nothing was written; give every "
                             "stage the same optimizer settings.")
        names = sorted((n for groups in per_stage for n in groups[i]["params"]), key=order.__getitem__)
        merged.append({**{k: v for k, v in per_stage[0][i].items() if k != "params"}, "params": names})
    return merged


# ---- agreeing before anything changes ----------------------------------------------------------------------


_KINDS = {kind.__name__: kind for kind in (ValueError, TypeError, FileNotFoundError, FileExistsError,
                                           IsADirectoryError, NotADirectoryError, PermissionError, KeyError,
                                           pickle.UnpicklingError)}


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed ``what``: its own error on a rank that failed, else one naming it."""
    verdicts: list[Any] = [None] * dist.get_world_size()
    mine = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(verdicts, mine)
    if error is not None:
        raise error
    failed = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
    if failed:
        rank, (kind, text) = failed[0]
        raise _KINDS.get(kind, RuntimeError)(
            f"Rank {dist.get_rank()}: {what} was refused by stage {rank} (rank {rank}), so by every stage: {kind}: "
            f"{text} Nothing was changed on any stage; see rank {rank}'s error for the fix.")


# ---- save ------------------------------------------------------------------------------------------------


def save(learner, path) -> None:
    """Write the whole model's sharded folder at ``path``; each stage writes its own part (a collective)."""
    path = Path(path)
    part = _stage_part(learner)
    try:
        dcp_folder.check_target(path)
        error = None
    except Exception as err:  # noqa: BLE001 - shared with the other stages, raised by every one
        error = err
    _agree(error, f"save({path})")
    scalars = {name: {f: v for f, v in fields.items() if not isinstance(v, torch.Tensor)}
               for name, fields in part["moments"].items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"groups": part["groups"], "scalars": scalars, "rng": _rng.local_state()})
    whole = learner._whole
    groups = _merged_groups([g["groups"] for g in gathered], whole)  # raises alike on every stage
    tensors = {f"model/{k}": v for k, v in part["model"].items()}
    tensors.update({f"optim/{name}/{field}": v for name, fields in part["moments"].items()
                    for field, v in fields.items() if isinstance(v, torch.Tensor)})
    tensors.update(dcp_folder.rng_tensors([g["rng"] for g in gathered]))
    meta = {
        "num_updates": learner.num_updates, "accum_step": learner._accum_step, "world_size": dist.get_world_size(),
        "model_keys": whole.model_keys, "param_names": list(whole.param_names),
        "param_groups": [{**group_settings(g), "params": g["params"]} for g in groups],
        "optim_scalars": {n: f for g in gathered for n, f in g["scalars"].items() if f},
        "shapes": {k: list(s) for k, s in whole.shapes.items()},
    }
    try:
        dcp_folder.write_version(learner.fabric, path, learner.num_updates, lambda: (tensors, meta))
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException, raised on every rank
        raise RuntimeError(
            f"Rank {dist.get_rank()}: save({path}) failed while the stages wrote their parts ({_what_failed(err)}). "
            f"{path}/LATEST still names the previous complete version, which loads as before; the learner is "
            "unchanged. Fix the cause (disk space, permissions) and save again.") from err


def _what_failed(err: BaseException) -> str:
    """A failed write in a line: each failing rank's error (DCP gathers them, with tracebacks, into one)."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    if not failures:
        return f"{type(err).__name__}: {err}"
    return "; ".join(f"stage {rank} (rank {rank}): {type(failure[0]).__name__}: {failure[0]}"
                     for rank, failure in sorted(failures.items()))


# ---- load ------------------------------------------------------------------------------------------------


def load(learner, path) -> None:
    """Restore a checkpoint of the whole model (any learner's folder or file) into every stage (a collective)."""
    _restore(learner, lambda: _read(path, learner), f"load({path})", path)


def load_checkpoint(learner, state: Mapping[str, Any]) -> None:
    """Restore an in-memory checkpoint of the whole model (``checkpoint()``) into every stage (a collective)."""
    _restore(learner, lambda: _from_whole(clone_state(state), learner._whole), "load_checkpoint()", None)


def _restore(learner, read, what: str, path) -> None:
    try:
        with naming(path) if path is not None else contextlib.nullcontext():
            loaded = read()
            model, optimizer_state = _own_state(loaded, learner)
        error = None
    except Exception as err:  # noqa: BLE001 - shared with the other stages, raised by every one
        error = err
    _agree(error, what)
    learner.loss_module.load_state_dict(model, strict=True)
    learner._torch_optimizer.load_state_dict(optimizer_state)
    learner._resume_counters(loaded.num_updates, loaded.accum_step, loaded.rng)
    learner._weights_changed()


def _read(path, learner) -> _Loaded:
    path = Path(path)
    if dcp_folder.is_sharded_checkpoint(path):
        return _from_folder(path, learner)
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder but holds no fabric_learner checkpoint (no LATEST file); nothing "
                                "was loaded. Pass the path save() wrote.")
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}; nothing was loaded. Pass the path save() wrote.")
    return _from_whole(read_learner_file(path), learner._whole)


def _from_whole(state: Mapping[str, Any], whole: WholeModel) -> _Loaded:
    """A whole model's checkpoint dict (a file's or ``checkpoint()``'s), checked against the whole model."""
    check_checkpoint(state, whole.shapes, optional=whole.frozen)
    names = state.get("param_names")
    if isinstance(names, Mapping):
        raise ValueError("The checkpoint was written by a learner with several optimizers (stages=); the pipeline's "
                         "stages train the whole model with one optimizer's settings. Nothing was loaded: load a "
                         "checkpoint of a learner built without stages=.")
    names = list(whole.param_names) if names is None else list(names)
    _check_names(names, whole)
    _rng.check(state.get("rng"))
    optimizer = state["optimizer"]
    return _Loaded(
        model=state["model"],
        moments={names[int(i)]: dict(fields) for i, fields in optimizer["state"].items()},
        groups=[{**g, "params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]],
        num_updates=int(state.get("num_updates", 0)), accum_step=int(state.get("accum_step", 0)),
        rng=state.get("rng"))


def _check_names(names: list[str], whole: WholeModel) -> None:
    if sorted(names) != sorted(whole.param_names):
        raise ValueError(
            "The checkpoint's optimizer trains other parameters than this learner's; nothing was loaded. Only in the "
            f"checkpoint: {sorted(set(names) - set(whole.param_names))[:8]}; only here: "
            f"{sorted(set(whole.param_names) - set(names))[:8]}. Load a checkpoint of the same loss and policy.")


def _from_folder(path: Path, learner) -> _Loaded:
    """This stage's part of a sharded folder: only its own tensors are read."""
    folder = dcp_folder.latest_version(path)
    meta = dcp_folder.read_meta(folder)  # checked against the stored tensors
    whole = learner._whole
    _check_meta(meta, whole, path)
    stored = dcp_folder.read_metadata(folder).state_dict_metadata
    stored_keys = set(meta["model_keys"])
    own_keys = [k for k in learner.loss_module.state_dict(keep_vars=True) if k in stored_keys]
    own_names = set(_names(learner.loss_module, learner._torch_optimizer))
    wanted = [f"model/{k}" for k in own_keys]
    wanted += [k for k in stored if k.startswith("optim/") and k[len("optim/"):].rpartition("/")[0] in own_names]
    wanted += [k for k in stored if k.startswith("rng/")]
    tensors = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in wanted}
    dcp_folder.load_into(tensors, folder, distributed=False)  # fresh buffers: a failed read changes nothing
    moments: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, field = key[len("optim/"):].rpartition("/")
            moments.setdefault(name, {})[field] = dcp_folder.as_param_shape(value, list(whole.shapes[name]))
    for name, fields in meta.get("optim_scalars", {}).items():
        if name in own_names:
            moments.setdefault(name, {}).update(fields)
    return _Loaded(
        model={k: tensors[f"model/{k}"].reshape(whole.shapes[k]) for k in own_keys},
        moments=moments, groups=meta["param_groups"], num_updates=meta["num_updates"],
        accum_step=meta["accum_step"], rng=dcp_folder.read_rng(folder, tensors))


def _check_meta(meta: Mapping[str, Any], whole: WholeModel, path: Path) -> None:
    """Raise before any tensor is read if the folder is not a checkpoint of this whole model."""
    stored, ours = set(meta["model_keys"]), set(whole.shapes)
    missing = sorted(set(whole.model_keys) - stored)
    unexpected = sorted(stored - ours)
    if missing or unexpected:
        raise ValueError(f"The checkpoint at {path} holds another model than this learner's (not in the checkpoint: "
                         f"{missing[:6]}; not in this model: {unexpected[:6]}); nothing was loaded. Load it into a "
                         "learner built over the same loss and policy as the one that saved it.")
    wrong = [f"{k}: {meta['shapes'][k]} vs {list(s)}" for k, s in whole.shapes.items()
             if k in meta["shapes"] and torch.Size(meta["shapes"][k]).numel() != torch.Size(s).numel()]
    if wrong:
        raise ValueError(f"The checkpoint at {path} has other shapes than this model ({wrong[:6]}); nothing was "
                         "loaded. Load it into a learner built over the same loss and policy as the one that saved it.")
    if "stages" in meta:
        raise ValueError(f"The checkpoint at {path} was written by a learner with several optimizers (stages=); the "
                         "pipeline's stages train the whole model with one optimizer's settings. Nothing was loaded: "
                         "load a checkpoint of a learner built without stages=.")
    _check_names(list(meta["param_names"]), whole)


def _own_state(loaded: _Loaded, learner) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This stage's model state dict and optimizer state from ``loaded``, checked against its module and optimizer."""
    loss_module, optimizer = learner.loss_module, learner._torch_optimizer
    live = loss_module.state_dict(keep_vars=True)
    frozen = frozen_keys(loss_module)
    model = {k: loaded.model[k] if k in loaded.model else v.detach() for k, v in live.items()
             if k in loaded.model or k in frozen}  # frozen parameters a checkpoint leaves out keep their values
    check_model_state(model, {k: tuple(v.shape) for k, v in live.items()})
    names = _names(loss_module, optimizer)
    index = {n: i for i, n in enumerate(names)}
    groups = []
    for group in optimizer.param_groups:
        members = [names[index_of] for index_of in _indices(group, optimizer)]
        saved = [g for g in loaded.groups if set(members) <= set(g["params"])]
        if not saved:
            raise ValueError("The checkpoint's optimizer groups the parameters otherwise than this stage's optimizer "
                             f"(no saved group holds all of {members[:3]}...); nothing was loaded. Build the optimizer "
                             "with the same param groups.")
        settings = {k: tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
                    for k, v in saved[0].items() if k != "params"}  # JSON has no tuples (Adam's betas)
        groups.append({**settings, "params": [index[n] for n in members]})
    state = {index[n]: clone_state(dict(loaded.moments[n])) for n in names if n in loaded.moments}
    optimizer_state = {"state": state, "param_groups": groups}
    check_optimizer_state(optimizer_state, optimizer)
    return model, optimizer_state


def _indices(group: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> list[int]:
    """The state-dict indices of ``group``'s parameters (torch numbers them group after group)."""
    start = 0
    for g in optimizer.param_groups:
        if g is group:
            return list(range(start, start + len(g["params"])))
        start += len(g["params"])
    raise KeyError("param group not in the optimizer")


# ---- in memory -------------------------------------------------------------------------------------------


def checkpoint(learner) -> dict[str, Any]:
    """The whole model's checkpoint on every rank, as ``LocalLearner.checkpoint()`` gives it (a collective).

    The stages' tensors travel pickled (``all_gather_object``), as ``get_weights`` sends them: fine for small
    models, slow for large ones (``save(path)`` moves nothing between the stages).
    """
    part = _stage_part(learner)
    mine = {"model": clone_state({k: v.cpu() for k, v in part["model"].items()}),
            "moments": clone_state(part["moments"]), "groups": part["groups"], "rng": _rng.local_state()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    whole = learner._whole
    model: dict[str, torch.Tensor] = {}
    for key in whole.model_keys:  # buffers every stage holds (a loss's constants) are equal: the first is kept
        held = [g["model"][key] for g in gathered if key in g["model"]]
        if not held:
            raise RuntimeError(f"No stage holds {key!r} of the whole model: the split removed it from every stage. "
                               "Nothing was gathered; check split_fn.")
        model[key] = held[0]
    moments = {n: f for g in gathered for n, f in g["moments"].items()}
    index = {n: i for i, n in enumerate(whole.param_names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]}
              for g in _merged_groups([g["groups"] for g in gathered], whole)]
    return {"model": model,
            "optimizer": {"state": {index[n]: moments[n] for n in whole.param_names if n in moments},
                          "param_groups": groups},
            "param_names": list(whole.param_names), "accum_step": learner._accum_step,
            "num_updates": learner.num_updates, "rng": [g["rng"] for g in gathered]}
