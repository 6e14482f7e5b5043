"""Checkpoint files: atomic writes and weights-only reads."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import pickle
import pickletools
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

FORMAT = "fabric_learner/1"


def file_state(learner_state: dict[str, Any]) -> dict[str, Any]:
    """What a single-file checkpoint holds: the learner state plus a format tag."""
    return {"format": FORMAT, **learner_state}


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through :func:`atomic_write`."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then an atomic rename onto it.

    A crash at any point leaves either the previous file or the new one at ``path``, never a
    partial file.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a directory; a single-file checkpoint would replace it. Pass a file path."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):  # left by saves that were killed
        with contextlib.suppress(OSError):
            stale.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Fabric's file checkpoint IO, written the way ``atomic_torch_save`` writes.

    Fabric's own writes through an fsspec transaction: a temporary file in the system temp
    folder, moved onto the path. Across filesystems that move is a copy, so a crash mid-copy
    leaves a partial file where the previous checkpoint was, and a crash before it leaves the
    temporary file behind in the temp folder.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options are not supported when saving a fabric_learner checkpoint.")
        atomic_torch_save(checkpoint, path)


def overwrite_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` must not be replaced by a checkpoint, or ``None`` when it may be.

    Only a missing path or a single-file checkpoint this package wrote (a torch zip whose
    ``"format"`` is ``FORMAT``) may be replaced; the check reads the pickle, not the tensors.
    """
    path = Path(path)
    if not path.exists() or path.is_dir():  # folders are refused by the writers themselves
        return None
    if _is_checkpoint_file(path):
        return None
    return (f"{path} exists and is not a fabric_learner checkpoint; refusing to replace it. Pass another path, "
            "or remove the file first if it is no longer needed.")


def _is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` is a torch zip whose pickled dict starts with ``"format": FORMAT``.

    Every writer here puts that entry first, so reading the opening opcodes of ``data.pkl`` is
    enough: nothing is unpickled and no tensor is touched, whatever the checkpoint's size.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(names) != 1:
                return False
            with archive.open(names[0]) as stream:
                head = stream.read(4096)
    except (OSError, zipfile.BadZipFile):
        return False
    strings = []
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name == "STOP" or len(strings) == 2:
                break
            if isinstance(arg, str) and "UNICODE" in opcode.name:
                strings.append(arg)
            elif opcode.name not in ("PROTO", "EMPTY_DICT", "MARK", "BINPUT", "LONG_BINPUT", "MEMOIZE", "FRAME"):
                break  # the dict's first item is not a string key and value
    except (ValueError, EOFError):  # truncated or not a pickle
        pass
    return strings == ["format", FORMAT]


def _reads_as_pickle(path: Path) -> bool:
    """Whether ``path`` (in a torch zip: its ``data.pkl``) starts with one well-formed pickle; nothing is unpickled."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n.endswith("data.pkl")]
                if len(names) != 1:
                    return False
                with archive.open(names[0]) as stream:
                    for _ in pickletools.genops(stream):
                        pass
        else:
            with open(path, "rb") as stream:
                for _ in pickletools.genops(stream):  # up to the first STOP: a legacy torch file's opening pickle
                    pass
    except Exception:  # noqa: BLE001 - an unknown opcode, a truncated stream, a damaged archive
        return False
    return True


def weights_only_load(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` of a file: no code from it runs, and errors name it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint file at {path}.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not _reads_as_pickle(path):  # random bytes or another format, not an object torch refused
            raise ValueError(f"{path} is not a readable checkpoint (damaged, or a file of another format): its bytes "
                             "are not a pickle; nothing was loaded. Load a checkpoint written by fabric_learner.") from None
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines else "")
        raise pickle.UnpicklingError(
            f"{path}: refusing to load it: it holds an object other than tensors and plain containers, whose "
            f"unpickling could run code; nothing was loaded (torch: {reason or repr(err)}). Load only "
            "checkpoints written by fabric_learner."
        ) from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: zip, pickle and storage errors of many kinds
        raise ValueError(f"{path} is not a readable torch file ({type(err).__name__}: {err}); nothing was loaded. "
                         "It may be truncated or not be a checkpoint.") from None


def read_learner_file(path: str | os.PathLike) -> dict[str, Any]:
    """A single-file learner checkpoint, read without running code and checked for its format."""
    state = weights_only_load(path)
    check_format(state, path)
    return state


def check_format(state: Any, path: str | os.PathLike) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not a fabric_learner checkpoint (format {found!r}, expected {FORMAT!r}); "
                         "nothing was loaded.")


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """Validation errors raised inside name the checkpoint file they are about."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if str(path) in str(err):
            raise
        raise type(err)(f"{path}: {err}") from err


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
