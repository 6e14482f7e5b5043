"""Sharded checkpoints on disk: a ``torch.distributed.checkpoint`` folder, swapped in atomically.

Layout of ``path`` (a directory)::

    path/LATEST              name of the complete version below (replaced atomically)
    path/<version>/          a torch.distributed.checkpoint folder: .metadata, __<rank>_0.distcp
    path/<version>/meta.json counters, optimizer hyper-parameters, parameter names and shapes

Tensors are stored under flat keys: ``model/<loss state key>`` and
``optim/<loss parameter name>/<state field>``, each rank writing its own shards, so a load can
reshard to any world size or read everything into one process. A crash mid-save leaves
``LATEST`` naming the previous version; a version folder without ``LATEST`` pointing at it is
never read. Loading reads ``.metadata`` with an unpickler that only accepts the checkpoint
metadata classes, and tensors with ``weights_only``, so no code is ever unpickled.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from fabric_learner._checkpoint import fsync_dir

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


def save_version(path: Path, version: str, tensors: dict[str, Any], meta: dict[str, Any], rank: int) -> None:
    """Collective: every rank writes its shards of ``tensors`` into ``path/version``."""
    folder = path / version
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder))
    if rank == 0:
        _write_atomic(folder / META, json.dumps({"format": SHARDED_FORMAT, **meta}).encode())


def publish(path: Path, version: str) -> None:
    """Rank 0, after every rank finished writing: point ``LATEST`` at ``version``, drop the rest."""
    _write_atomic(path / LATEST, version.encode())
    for child in path.iterdir():
        if child.is_dir() and child.name != version and child.name.startswith("v"):
            shutil.rmtree(child, ignore_errors=True)


def latest_version(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"No sharded checkpoint at {path} (no {LATEST} file).")
    folder = path / (path / LATEST).read_text().strip()
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{path}/{LATEST} names {folder.name}, which is incomplete or missing.")
    return folder


def read_meta(folder: Path) -> dict[str, Any]:
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != SHARDED_FORMAT:
        raise ValueError(f"{folder} is not a {SHARDED_FORMAT} checkpoint (format {meta.get('format')!r}).")
    return meta


def read_metadata(folder: Path) -> Metadata:
    return SafeReader(folder).read_metadata()


def load_into(tensors: dict[str, Any], folder: Path, distributed: bool) -> None:
    """Fill ``tensors`` (plain tensors or DTensors, any sharding) in place from ``folder``."""
    dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=not distributed)


def full_targets(metadata: Metadata, prefix: str = "") -> dict[str, torch.Tensor]:
    """Empty full-size tensors for every stored tensor under ``prefix``: a one-process target."""
    return {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read accepts only checkpoint-metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold checkpoint metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(
            f"Refusing to load {module}.{name} from checkpoint metadata: only checkpoint metadata "
            "classes are allowed (loading never runs code from a checkpoint)."
        )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_full(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint read whole into one process, as a ``Learner.checkpoint()`` dict."""
    folder = latest_version(path)
    meta = read_meta(folder)
    tensors = full_targets(read_metadata(folder))
    load_into(tensors, folder, distributed=False)
    shapes = meta["shapes"]
    model = {key: tensors[f"model/{key}"].reshape(shapes.get(key, tensors[f"model/{key}"].shape))
             for key in meta["model_keys"]}
    names = meta["param_names"]
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        fields = {f: t for k, t in tensors.items() if k.startswith(f"optim/{name}/") for f in [k[len(f"optim/{name}/"):]]}
        fields.update(meta.get("optim_scalars", {}).get(name, {}))
        if fields:
            state[i] = {f: _as_param_shape(v, shapes[name]) for f, v in fields.items()}
    index = {name: i for i, name in enumerate(names)}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in meta["param_groups"]]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "param_names": names,
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


def _as_param_shape(value: Any, shape: list[int]) -> Any:
    """Scalar parameters are stored sharded with shape (1,); give their moments shape () back."""
    if isinstance(value, torch.Tensor) and list(shape) == [] and tuple(value.shape) == (1,):
        return value.reshape(())
    return value
