"""Sharded checkpoints on disk: a ``torch.distributed.checkpoint`` folder, swapped in atomically.

Layout of ``path`` (a directory)::

    path/LATEST              name of the complete version below (replaced atomically)
    path/<version>/          a torch.distributed.checkpoint folder: .metadata, __<rank>_0.distcp
    path/<version>/meta.json counters, optimizer hyper-parameters, parameter names and shapes,
                         and with stages each stage's parameter names

Tensors are stored under flat keys: ``model/<loss state key>`` and
``optim/<loss parameter name>/<state field>``, each rank writing its own shards, so a load can
reshard to any world size or read everything into one process. (DCP's ``get_state_dict`` keys
by the FSDP wrapper's names, flattened with scalars as ``(1,)``; the backends translate them to the
loss's own names and shapes, so the same keys load under DDP and in one process.) A crash mid-save leaves
``LATEST`` naming the previous version; a version folder without ``LATEST`` pointing at it is
never read. Loading reads ``.metadata`` with an unpickler that only accepts the checkpoint
metadata classes, and tensors with ``weights_only``, so no code is ever unpickled.

``write_version`` writes one version from every rank; with a stager it writes in the background
(``FabricLearner.save(path, blocking=False)``):
``LATEST`` still switches only after every rank's shards are on disk.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
import stat
import uuid
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from fabric_learner.checkpoint.files import atomic_write
from fabric_learner.utils import compat as _compat

SHARDED_FORMAT = "fabric_learner/sharded-1"
LATEST = "LATEST"
META = "meta.json"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / LATEST).is_file()


def check_target(path: Path) -> None:
    """Refuse to write over anything that is not a sharded checkpoint this package wrote."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(
            f"{path} is a file; a sharded checkpoint is a folder and would replace it. Pass a new path."
        )
    if path.is_dir() and any(path.iterdir()) and not is_sharded_checkpoint(path):
        raise FileExistsError(
            f"{path} is a non-empty folder that is not a fabric_learner sharded checkpoint; refusing to "
            "write into it. Pass a new or empty path."
        )


def new_version_name(num_updates: int) -> str:
    return f"v{num_updates:09d}-{uuid.uuid4().hex[:8]}"


def write_version(fabric: Any, path: Path, num_updates: int, build: Callable[[], tuple[dict, dict]],
                  stager: Stager | None = None) -> Future | None:
    """Collective: write ``build()``'s ``(tensors, meta)`` as a new version of ``path``, then publish it.

    Rank 0 checks the target first; the version name is rank 0's, so every rank writes into the same
    folder. With a ``stager`` the write and publish run in the background (``save_version_async``)
    and its future is returned; without one this returns once ``LATEST`` names the new version.
    """
    rank = fabric.global_rank
    if rank == 0:
        check_target(path)
    fabric.barrier()
    version = fabric.broadcast(new_version_name(num_updates) if rank == 0 else None, src=0)
    tensors, meta = build()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    fabric.barrier()
    if stager is not None:
        group = async_group(_compat.strategy_timeout(fabric.strategy))
        return save_version_async(path, version, tensors, meta, rank, group, stager)
    save_version(path, version, tensors, meta, rank)
    fabric.barrier()
    if rank == 0:
        publish(path, version)
    fabric.barrier()
    return None


def save_version(path: Path, version: str, tensors: dict[str, Any], meta: dict[str, Any], rank: int) -> None:
    """Collective: every rank writes its shards of ``tensors`` into ``path/version``."""
    folder = path / version
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder))
    if rank == 0:
        _write_meta(folder, meta)


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    atomic_write(folder / META, lambda f: f.write(json.dumps({"format": SHARDED_FORMAT, **meta}).encode()))


def async_group(timeout: timedelta | None) -> dist.ProcessGroup | None:
    """The gloo group background writes talk over, built once per default group (a collective).

    Its own group, so that DCP's gathers in the writer thread never interleave with the training
    group's collectives in the main thread. ``None`` without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _ASYNC_GROUP.get("world") is not world:
        kwargs = {} if timeout is None else {"timeout": timeout}
        _ASYNC_GROUP.update(world=world, group=dist.new_group(backend="gloo", **kwargs))
    return _ASYNC_GROUP["group"]


_ASYNC_GROUP: dict[str, Any] = {}


class Stager:
    """Copies of the tensors to save, in buffers kept from one save to the next (DCP's ``AsyncStager``).

    Allocating the copy costs more than filling it (measured on the 21M-parameter learner, 2 CPU
    ranks: 0.4-1.2 s to allocate, 0.06-0.13 s to copy into kept buffers), and the copy is the part
    of an asynchronous save that training waits for. The price is one more copy of each rank's
    shards held between saves. Only one save may use the buffers at a time: the learner waits for
    a pending save before staging the next.
    """

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        staged = {}
        for key, value in state_dict.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = self._buffers[key] = torch.empty_like(local, device="cpu")
            buffer.copy_(local.detach())
            staged[key] = DTensor.from_local(buffer, value.device_mesh, value.placements, shape=value.shape,
                                             stride=value.stride(), run_check=False) \
                if isinstance(value, DTensor) else buffer
        for key in set(self._buffers) - set(state_dict):
            del self._buffers[key]
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage`` copies before it returns."""

    def close(self) -> None:
        self._buffers.clear()


def save_version_async(path: Path, version: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any], rank: int,
                       group: dist.ProcessGroup | None, stager: Stager) -> Future:
    """``save_version`` then ``publish`` in the background; returns once ``tensors`` are staged.

    Every rank calls it. ``dcp.async_save`` copies the tensors through ``stager`` (the copy is what
    gets written, so training may change the live ones at once) and writes them from a thread. DCP's last step
    gathers every rank's write result on rank 0, so rank 0's write finishing means every rank's
    shards are on disk (fsynced); only then does rank 0 write ``meta.json`` and switch ``LATEST``,
    and it sends the outcome to the other ranks over ``group``. The returned future completes on
    every rank once ``LATEST`` names the new version, or fails (on every rank still alive) with
    ``LATEST`` unchanged.
    """
    folder = path / version
    done: Future = Future()
    written = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(folder), process_group=group,
                             async_stager=stager)

    def finish(write: Future) -> None:  # in DCP's writer thread (or here, if the write already ended)
        try:
            write.result()
            outcome = [None]
            if rank == 0:
                try:
                    _write_meta(folder, meta)
                    publish(path, version)
                except Exception as err:  # noqa: BLE001 - sent to every rank, raised by each
                    outcome = [f"{type(err).__name__}: {err}"]
            if group is not None:
                dist.broadcast_object_list(outcome, src=0, group=group)
            if outcome[0] is not None:
                raise RuntimeError(f"Rank 0 could not publish the checkpoint version {version} at {path}: "
                                   f"{outcome[0]}. {LATEST} still names the previous version.")
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the save
            done.set_exception(err)
        else:
            done.set_result(version)

    written.add_done_callback(finish)
    return done


def publish(path: Path, version: str) -> None:
    """Rank 0, after every rank finished writing: point ``LATEST`` at ``version``, drop the rest."""
    atomic_write(path / LATEST, lambda f: f.write(version.encode()))
    for child in path.iterdir():
        if child.is_dir() and child.name != version and child.name.startswith("v"):
            shutil.rmtree(child, ignore_errors=True)


_VERSION_NAME = re.compile(r"v\d{9}-[0-9a-f]{8}")
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
_MAX_SMALL_FILE = 16 << 20  # LATEST, meta.json and .metadata are small; a larger one is not ours


def latest_version(path: str | os.PathLike) -> Path:
    """The complete version folder that ``path/LATEST`` names, refusing names that lead elsewhere."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"No sharded checkpoint at {path} (no {LATEST} file).")
    name = read_small_file(path / LATEST).decode("ascii", errors="replace").strip()
    if not _VERSION_NAME.fullmatch(name):
        raise ValueError(
            f"{path / LATEST} names {name[:80]!r}, expected a version folder name such as 'v000000042-1a2b3c4d' "
            "inside the checkpoint; nothing was loaded. The file was not written by fabric_learner."
        )
    folder = path / name
    if folder.is_symlink() or not folder.is_dir() or folder.resolve().parent != path.resolve():
        raise ValueError(
            f"{path / LATEST} names {name}, which is not a folder inside {path} (a symlink or something else); "
            "nothing was loaded. The checkpoint was not written by fabric_learner."
        )
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{path}/{LATEST} names {folder.name}, which is incomplete or missing.")
    return folder


def read_small_file(path: Path) -> bytes:
    """The bytes of a regular file of a checkpoint (never a symlink, never huge)."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a symlink or something else); nothing was loaded. "
                         "Checkpoint folders written by fabric_learner hold only regular files.")
    if info.st_size > _MAX_SMALL_FILE:
        raise ValueError(f"{path} is {info.st_size} bytes, expected at most {_MAX_SMALL_FILE}; nothing was loaded.")
    return path.read_bytes()


def read_json(file: Path, expected_format: str) -> dict[str, Any]:
    """A checkpoint's JSON file: a dict whose ``format`` is ``expected_format``, or a clear error."""
    try:
        meta = json.loads(read_small_file(file))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err}); nothing was loaded. It may be truncated.") from None
    if not isinstance(meta, dict) or meta.get("format") != expected_format:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{file} has format {found!r}, expected {expected_format!r}; nothing was loaded.")
    return meta


def read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json``, checked against the tensors ``.metadata`` says the folder stores."""
    meta = read_json(folder / META, SHARDED_FORMAT)
    check_meta(meta, read_metadata(folder), folder / META)
    return meta


def read_metadata(folder: Path) -> Metadata:
    return SafeReader(folder).read_metadata()


def load_into(tensors: dict[str, Any], folder: Path, distributed: bool) -> None:
    """Fill ``tensors`` (plain tensors or DTensors, any sharding) in place from ``folder``.

    Pass fresh tensors, never live state: a file that fails to read mid-way leaves them partly
    written.
    """
    if distributed:
        dcp.load(tensors, storage_reader=SafeReader(folder))
        return
    with warnings.catch_warnings():  # one process reading shards on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=True)


def full_targets(metadata: Metadata, prefix: str = "") -> dict[str, torch.Tensor]:
    """Empty full-size tensors for every stored tensor under ``prefix``: a one-process target."""
    return {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that reads tensors only, from files of the folder itself.

    torch's reader unpickles ``.metadata`` with plain pickle, and its planner reads any entry
    that the metadata declares as bytes with ``torch.load(weights_only=False)``: either runs
    code from the file. Here the metadata goes through an allow-list unpickler and is checked
    (every entry a tensor, every shard a slice of a ``__<rank>_<n>.distcp`` file of this folder,
    chunks tiling each tensor) before anything is read, and a bytes read is refused again at
    read time. Tensor data is read with ``weights_only``, as torch does.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        data = read_small_file(path)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as err:
            raise pickle.UnpicklingError(f"{path}: {err} Nothing was loaded.") from None
        except Exception as err:  # noqa: BLE001 - truncated or garbled: pickle raises many kinds of error
            raise ValueError(f"{path} is not readable checkpoint metadata ({type(err).__name__}: {err}); "
                             "nothing was loaded. It may be truncated.") from None
        check_metadata(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise pickle.UnpicklingError(
                    f"{self.path}: entry {item.dest_index.fqn!r} is stored as pickled bytes, expected a tensor; "
                    "refusing to unpickle it (loading never runs code from a checkpoint)."
                )
        return super().read_data(plan, planner)


def check_metadata(metadata: Any, path: Path) -> None:
    """Raise unless ``metadata`` describes only tensors stored in shard files beside it."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"{path}: {what}; nothing was loaded. The checkpoint was not written by fabric_learner.")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise pickle.UnpicklingError(f"{path} does not hold checkpoint metadata.")
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise pickle.UnpicklingError(
                f"{path}: entry {key!r} is stored as pickled bytes (BytesStorageMetadata), expected a tensor; "
                "refusing to load it (loading never runs code from a checkpoint)."
            )
        if not isinstance(key, str) or not isinstance(md, TensorStorageMetadata) \
                or not isinstance(md.properties.dtype, torch.dtype) or not _is_size(md.size):
            raise refuse(f"entry {key!r} is {type(md).__name__}, expected a tensor's storage metadata")
        _check_chunks(key, md, refuse)
    folder = path.parent
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in metadata.state_dict_metadata:
            raise refuse(f"storage entry {index!r} belongs to no stored tensor")
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_FILE.fullmatch(name):
            raise refuse(f"entry {index.fqn!r} is stored in {name!r}, expected a shard file '__<rank>_<n>.distcp' "
                         "of the same folder")
        if getattr(info, "transform_descriptors", None):
            raise refuse(f"entry {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}, "
                         "expected none")
        if name not in sizes:
            try:
                file_info = os.lstat(folder / name)
            except FileNotFoundError:
                raise refuse(f"entry {index.fqn!r} is stored in {name}, which is missing") from None
            if not stat.S_ISREG(file_info.st_mode):
                raise refuse(f"{name} is not a regular file (a symlink or something else)")
            sizes[name] = file_info.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length > 0
                and offset + length <= sizes[name]):
            raise refuse(f"entry {index.fqn!r} lies at bytes [{offset}, +{length}) of {name}, which has "
                         f"{sizes[name]} bytes (the file is truncated or the metadata is not its own)")


def _check_chunks(key: str, md: TensorStorageMetadata, refuse) -> None:
    """The chunks of one tensor lie inside it, do not overlap, and cover it whole."""
    size, boxes = tuple(md.size), []
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (_is_size(chunk.offsets) and _is_size(chunk.sizes)) \
                or len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size) \
                or any(o < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
            raise refuse(f"entry {key!r} has a chunk outside its shape {list(size)}")
        boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
    covered = sum(math.prod(n) for _, n in boxes)
    overlap = any(all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]))
                  and math.prod(a[1]) and math.prod(b[1]) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if overlap or covered != math.prod(size):
        raise refuse(f"entry {key!r}: its chunks cover {covered} of {math.prod(size)} elements "
                     f"{'with overlaps' if overlap else ''}, expected the whole tensor once")


def check_meta(meta: dict[str, Any], metadata: Metadata, file: Path) -> None:
    """Raise unless ``meta.json`` agrees with itself and with the tensors stored beside it."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"{file}: {what}; nothing was loaded. The checkpoint was not written by fabric_learner, "
                          "or was changed after.")

    for key in ("num_updates", "accum_step", "world_size"):
        if not _is_int(meta.get(key)) or meta[key] < (1 if key == "world_size" else 0):
            raise refuse(f"{key!r} is {meta.get(key)!r}, expected a non-negative integer")
    names = {}
    for key in ("model_keys", "param_names"):
        value = meta.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value):
            raise refuse(f"{key!r} is not a list of distinct names")
        names[key] = value
    shapes = meta.get("shapes")
    if not isinstance(shapes, dict) or not all(
            isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v) for v in shapes.values()):
        raise refuse("'shapes' is not a mapping of names to lists of sizes")
    stored = metadata.state_dict_metadata
    for key in names["model_keys"]:
        md = stored.get(f"model/{key}")
        if md is None:
            raise refuse(f"model entry {key!r} has no tensor 'model/{key}' in .metadata")
        if key not in shapes or math.prod(shapes[key]) != math.prod(md.size):
            raise refuse(f"model entry {key!r} has shape {shapes.get(key)}, but the stored tensor has "
                         f"{list(md.size)}")
    params = set(names["param_names"])
    if not params <= set(names["model_keys"]):
        raise refuse(f"optimizer parameters {sorted(params - set(names['model_keys']))[:8]} are not model entries")
    for key, md in stored.items():
        kind, _, rest = key.partition("/")
        if kind == "model" and rest not in shapes:
            raise refuse(f"stored tensor {key!r} is not among 'model_keys'")
        elif kind == "optim":
            name, _, field = rest.rpartition("/")
            if name not in params or not field:
                raise refuse(f"stored tensor {key!r} belongs to no optimizer parameter in 'param_names'")
            if math.prod(md.size) not in (1, math.prod(shapes[name])):
                raise refuse(f"optimizer state {key!r} has shape {list(md.size)}, expected {shapes[name]} or a scalar")
        elif kind == "rng":
            rank, _, generator = rest.partition("/")
            if not rank.isdigit() or int(rank) >= meta["world_size"] or generator not in ("torch", "cuda") \
                    or md.properties.dtype != torch.uint8 or len(md.size) != 1:
                raise refuse(f"stored tensor {key!r} is not a random state (uint8, 1-d) of a rank below "
                             f"world_size {meta['world_size']}")
        elif kind not in ("model", "optim", "rng"):
            raise refuse(f"stored tensor {key!r} is none of model/, optim/ or rng/")
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise refuse("'param_groups' is not a list of groups with 'params'")
    grouped = [n for g in groups for n in g["params"]]
    if sorted(map(str, grouped)) != sorted(params) or len(grouped) != len(params):
        raise refuse("'param_groups' do not hold each name of 'param_names' exactly once")
    for g in groups:
        for k, v in g.items():
            if k != "params" and not _is_hyper_parameter(v):
                raise refuse(f"hyper-parameter {k!r} is {v!r}, expected a number, a flag, a string or a list of numbers")
    stages = meta.get("stages")
    if stages is not None:
        if not isinstance(stages, dict) or not all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                                                   for v in stages.values()):
            raise refuse("'stages' is not a mapping of stage names to lists of parameter names")
        owner = {n: stage for stage, names_ in stages.items() for n in names_}
        if sorted(owner) != sorted(params) or len(owner) != sum(map(len, stages.values())):
            raise refuse("'stages' do not hold each name of 'param_names' exactly once")
        if any(len({owner.get(n) for n in g["params"]}) > 1 for g in groups):
            raise refuse("a param group holds parameters of several stages")
    scalars = meta.get("optim_scalars", {})
    if not isinstance(scalars, dict) or not all(
            n in params and isinstance(f, dict) and all(isinstance(v, (int, float)) for v in f.values())
            for n, f in scalars.items()):
        raise refuse("'optim_scalars' is not a mapping of optimizer parameters to numbers")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value: Any) -> bool:
    return isinstance(value, (tuple, torch.Size)) and all(_is_int(d) and d >= 0 for d in value)


def _is_hyper_parameter(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, (int, float)) for v in value)
    return value is None or isinstance(value, (int, float, str))


_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", name): True for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): True,
    ("torch", "Size"): True, ("torch.serialization", "_get_layout"): True, ("collections", "OrderedDict"): True,
    ("pathlib", "PosixPath"): True, ("pathlib", "PurePosixPath"): True, ("pathlib", "Path"): True,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes DCP metadata is made of (plain dataclasses, sizes, dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"Refusing to load {module}.{name} from checkpoint metadata: only checkpoint metadata "
            "classes are allowed (loading never runs code from a checkpoint)."
        )


def read_full(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint read whole into one process, as a ``Learner.checkpoint()`` dict."""
    folder = latest_version(path)
    meta = read_meta(folder)
    tensors = full_targets(read_metadata(folder))
    load_into(tensors, folder, distributed=False)
    shapes = meta["shapes"]
    model = {key: tensors[f"model/{key}"].reshape(shapes.get(key, tensors[f"model/{key}"].shape))
             for key in meta["model_keys"]}

    def optimizer(names: list[str]) -> dict[str, Any]:
        """The state dict of the optimizer over ``names`` (in its order), with its own groups."""
        state: dict[int, dict[str, Any]] = {}
        for i, name in enumerate(names):
            fields = {f: t for k, t in tensors.items() if k.startswith(f"optim/{name}/")
                      for f in [k[len(f"optim/{name}/"):]]}
            fields.update(meta.get("optim_scalars", {}).get(name, {}))
            if fields:
                state[i] = {f: as_param_shape(v, shapes[name]) for f, v in fields.items()}
        index = {name: i for i, name in enumerate(names)}
        groups = [dict(g, params=[index[n] for n in g["params"]]) for g in meta["param_groups"]
                  if g["params"] and g["params"][0] in index]
        return {"state": state, "param_groups": groups}

    stages = meta.get("stages")  # a learner with several optimizers: one state dict per stage, as files hold
    if stages is None:
        optim, names = optimizer(meta["param_names"]), meta["param_names"]
    else:
        optim, names = {"stages": {stage: optimizer(n) for stage, n in stages.items()}}, stages
    return {"model": model, "optimizer": optim, "param_names": names,
            "num_updates": meta["num_updates"], "accum_step": meta["accum_step"], "rng": read_rng(folder, tensors)}


def rng_tensors(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every rank's random state under ``rng/<rank>/<generator>`` (the same on every rank)."""
    return {f"rng/{r}/{name}": t for r, state in enumerate(states) for name, t in state.items()}


def read_rng(folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]] | None:
    """The per-rank random states stored in ``folder`` (``None`` if it has none)."""
    if tensors is None:
        tensors = full_targets(read_metadata(folder), prefix="rng/")
        if not tensors:
            return None
        load_into(tensors, folder, distributed=False)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("rng/"):
            _, rank, name = key.split("/", 2)
            states.setdefault(int(rank), {})[name] = t
    return [states[r] for r in sorted(states)] or None


def as_param_shape(value: Any, shape: list[int]) -> Any:
    """Scalar parameters are stored sharded with shape (1,); give their moments shape () back."""
    if isinstance(value, torch.Tensor) and list(shape) == [] and tuple(value.shape) == (1,):
        return value.reshape(())
    return value
