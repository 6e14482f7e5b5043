"""Real checkpoints (``tests/fixtures/checkpoints``), damaged the ways a received file can be.

Each tampering takes a fresh copy of a fixture and changes it in place; its name says how.
Shared by the one-process tests and the 2-rank workers, which load the same damaged copies.
A payload's unpickling would create the file named by ``$FL_MARKER``: a load that ran code
leaves it behind.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"


class Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FL_MARKER']}",))


def fresh_copy(name: str, where: Path) -> Path:
    target = where / name
    if (FIXTURES / name).is_dir():
        shutil.copytree(FIXTURES / name, target, symlinks=True)
    else:
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / name, target)
    return target


def version(ckpt: Path) -> Path:
    return ckpt / (ckpt / "LATEST").read_text().strip()


def _payload_file(path: Path) -> None:
    path.write_bytes(pickle.dumps(Payload()))


def _random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))  # not a pickle: its first byte is no opcode torch reads


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_meta(ckpt: Path, change) -> None:
    file = version(ckpt) / "meta.json"
    meta = json.loads(file.read_text())
    change(meta)
    file.write_text(json.dumps(meta))


def _bytes_entry(ckpt: Path) -> None:
    """One model entry of the DCP data re-saved as a pickled object (DCP stores it as bytes)."""
    folder = version(ckpt)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()  # the genuine metadata of the fixture: trusted here
    tensors = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    dcp.load(tensors, storage_reader=FileSystemReader(folder), no_dist=True)
    victim = next(k for k in tensors if k.startswith("model/"))
    tensors[victim] = Payload()
    for f in folder.iterdir():
        if f.name != "meta.json":
            f.unlink()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def _metadata_points_outside(ckpt: Path) -> None:
    """Only checkpoint-metadata classes, but a shard file outside the folder."""
    folder = version(ckpt)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    outside = ckpt.parent / "elsewhere.distcp"
    shutil.copy(next(folder.glob("__0_0.distcp")), outside)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _latest_symlink_out(ckpt: Path) -> None:
    folder = version(ckpt)
    outside = ckpt.parent / "outside"
    shutil.move(folder, outside)
    folder.symlink_to(outside, target_is_directory=True)


def _latest(ckpt: Path, text: str) -> None:
    outside = ckpt.parent / "elsewhere"
    if not outside.exists():
        shutil.copytree(version(ckpt), outside)
    (ckpt / "LATEST").write_text(text)


def _drop_model_key(meta):
    meta["model_keys"].pop(0)


def _wrong_shape(meta):
    key = next(iter(meta["param_names"]))
    meta["shapes"][key] = [s + 1 for s in meta["shapes"][key]]


def _negative_count(meta):
    meta["num_updates"] = -1


def _duplicate_group_param(meta):
    meta["param_groups"][0]["params"].append(meta["param_groups"][0]["params"][0])


SHARDED = {
    "payload .metadata": lambda c: _payload_file(version(c) / ".metadata"),
    "payload meta.json": lambda c: _payload_file(version(c) / "meta.json"),
    "payload shard 0": lambda c: _payload_file(version(c) / "__0_0.distcp"),
    "payload shard 1": lambda c: _payload_file(version(c) / "__1_0.distcp"),
    "payload LATEST": lambda c: _payload_file(c / "LATEST"),
    "entry re-saved as a pickled object": _bytes_entry,
    ".metadata names a shard file outside": _metadata_points_outside,
    "LATEST names ../elsewhere": lambda c: _latest(c, "../elsewhere"),
    "LATEST names an absolute path": lambda c: _latest(c, str(c.parent / "elsewhere")),
    "version folder is a symlink out": _latest_symlink_out,
    "meta.json lacks a model key": lambda c: _edit_meta(c, _drop_model_key),
    "meta.json shape disagrees": lambda c: _edit_meta(c, _wrong_shape),
    "meta.json count is negative": lambda c: _edit_meta(c, _negative_count),
    "meta.json lists a parameter twice": lambda c: _edit_meta(c, _duplicate_group_param),
    "truncated shard": lambda c: _truncate(version(c) / "__1_0.distcp"),
    "truncated .metadata": lambda c: _truncate(version(c) / ".metadata"),
    "truncated meta.json": lambda c: _truncate(version(c) / "meta.json"),
}


def _resave(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def _moment_shape(state):
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = torch.zeros(moments["exp_avg"].numel() + 1)


def _bad_rng(state):
    state["rng"][0]["torch"] = state["rng"][0]["torch"][:100]


def _text_count(state):
    state["num_updates"] = "2"


FILE = {
    "payload in the pickle": lambda p: torch.save({"format": "fabric_learner/1", "model": {}, "optimizer": {},
                                                   "rng": Payload()}, p),
    "plain pickle payload": _payload_file,
    "truncated": _truncate,
    "random bytes": _random_bytes,
    "moment of another shape": lambda p: _resave(p, _moment_shape),
    "malformed random state": lambda p: _resave(p, _bad_rng),
    "count is text": lambda p: _resave(p, _text_count),
    "another format": lambda p: _resave(p, lambda s: s.update(format="someone/else")),
}


def _bad_trainer_rng(path: Path) -> None:
    def change(state):
        state["rng"]["python"] = (3, (1, 2), None)
    _resave(path, change)


TRAINER = {
    "payload rank0.pt": lambda c: FILE["payload in the pickle"](c / "rank0.pt"),
    "payload learner.ckpt": lambda c: FILE["payload in the pickle"](c / "learner.ckpt"),
    "payload meta.json": lambda c: _payload_file(c / "meta.json"),
    "truncated rank0.pt": lambda c: _truncate(c / "rank0.pt"),
    "truncated learner.ckpt": lambda c: _truncate(c / "learner.ckpt"),
    "malformed python random state in rank0.pt": lambda c: _bad_trainer_rng(c / "rank0.pt"),
    "learner.ckpt of another shape": lambda c: _resave(c / "learner.ckpt", _moment_shape),
    "learner.ckpt is a symlink out": lambda c: (shutil.move(c / "learner.ckpt", c.parent / "other.ckpt"),
                                                (c / "learner.ckpt").symlink_to(c.parent / "other.ckpt")),
}


def prepare(cases: dict, fixture: str, root: Path) -> dict[str, Path]:
    """A damaged copy of ``fixture`` for each case, under ``root/<n>/``."""
    out = {}
    for i, (name, tamper) in enumerate(cases.items()):
        ckpt = fresh_copy(fixture, root / str(i))
        tamper(ckpt)
        out[name] = ckpt
    return out
