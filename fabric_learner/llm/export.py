"""A folder that transformers' ``from_pretrained`` loads: from a live learner, or offline from its checkpoint.

The folder holds ``config.json`` (and ``generation_config.json`` when the model has one), the
weights in safetensors files (``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` past ``max_shard_bytes``), and the tokenizer's files when one
is given. With a peft LoRA model it holds the merged weights by default (a plain model, for engines
without LoRA support), or with ``lora="adapters"`` peft's adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads
over the base model.

Written atomically: everything goes into a temporary sibling of the folder, renamed onto it at the
end, so a crash mid-export leaves the previous folder (or none), never half of one. From a sharded
learner the export is a collective: the weights are gathered bucket by bucket
(``fabric_learner.llm.weight_buckets``) and rank 0 writes them one shard file at a time, so no rank holds
the whole model at once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fabric_learner.checkpoint.files import fsync_dir, read_learner_file
from fabric_learner.llm.sources import Source, learner_source
from fabric_learner.llm.weights import fill_buckets, trained_model, weight_plan

__all__ = ["export_checkpoint", "export_pretrained"]

DEFAULT_SHARD_BYTES = 5 * 2**30


def export_pretrained(learner, folder: str | os.PathLike, *, model: nn.Module | None = None, tokenizer=None,
                      lora: str = "merged", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      bucket_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Write the learner's transformers model to ``folder`` for ``from_pretrained``; every rank calls it.

    Rank 0 writes; under a sharded learner every rank takes part in the gathers, one bucket of at
    most ``bucket_bytes`` at a time. Every rank returns once the folder is complete, or raises the
    same error.

    Args:
        learner (Learner): the learner whose policy (or ``model``) is the transformers or peft model.
        folder (str or os.PathLike): the folder to create.

    Keyword Args:
        model (nn.Module, optional): the model the loss trains (default: the policy's, see
            ``fabric_learner.llm.trained_model``).
        tokenizer (optional): saved beside the weights (``tokenizer.save_pretrained``).
        lora (str): for a peft model, ``"merged"`` (default) or ``"adapters"`` (peft's adapter folder).
        max_shard_bytes (int): the most bytes of one safetensors file (default 5 GiB).
        bucket_bytes (int, optional): the most bytes gathered at once (default ``max_shard_bytes``).
        overwrite (bool): replace an existing ``folder`` (default: refuse).

    Returns:
        The folder's path.

    Raises:
        FileExistsError: ``folder`` exists and ``overwrite`` is false (nothing is written).
        ValueError: a bad ``lora``, sizes, or a model the learner does not train.

    Examples:
        >>> import os, tempfile, torch
        >>> from transformers import AutoModelForCausalLM
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm import export_pretrained
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example()
        >>> learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1), policy=policy)
        >>> _ = learner.update(batch)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     folder = export_pretrained(learner, os.path.join(tmp, "model"), tokenizer=policy.tokenizer)
        ...     print(sorted(os.listdir(folder))[:3])
        ...     loaded = AutoModelForCausalLM.from_pretrained(folder)
        ['chat_template.jinja', 'config.json', 'generation_config.json']
        >>> torch.equal(loaded.lm_head.weight, policy.model.lm_head.weight)
        True
    """
    model = trained_model(learner, model)
    shard_bytes, bucket_bytes = _check_sizes(max_shard_bytes, bucket_bytes)
    plan = weight_plan(model, lora, learner_source(learner, model))  # checks lora before anything is written
    folder = Path(folder)
    rank = learner.global_rank
    error = _target_error(folder, overwrite) if rank == 0 else None
    _raise_agreed(learner, error, FileExistsError)
    writer, failure = None, None
    if rank == 0:
        try:
            writer = _Writer(folder, shard_bytes, lora)
        except Exception as err:  # noqa: BLE001 - reported to every rank below, after the gathers
            failure = err
    # sharded: every rank iterates, the gathers are collectives; unsharded: rank 0 alone reads its tensors
    reads = learner.capabilities.sharded or (rank == 0 and failure is None)
    stream = fill_buckets(plan, bucket_bytes, torch.device("cpu")) if reads else ()
    for bucket in stream:
        if writer is not None and failure is None:
            try:
                writer.add(bucket)
            except Exception as err:  # noqa: BLE001 - rank 0 keeps gathering with the others, then reports it
                failure = err
        del bucket
    if writer is not None and failure is None:
        try:
            writer.finish(model, tokenizer, lora, overwrite)
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            failure = err
    if writer is not None and failure is not None:
        writer.abandon()
    if learner.world_size > 1:
        message = learner.fabric.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}", src=0)
        if message is not None and failure is None:
            raise RuntimeError(f"Rank 0 could not export to {folder}: {message}. Nothing was written.")
    if failure is not None:
        raise failure
    return folder


def export_checkpoint(path: str | os.PathLike, model: nn.Module, folder: str | os.PathLike, *, tokenizer=None,
                      lora: str = "merged", prefix: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      overwrite: bool = False) -> Path:
    """Write a saved learner checkpoint's model to ``folder`` for ``from_pretrained``, in one process.

    ``path`` is what ``learner.save`` wrote: a file or a sharded folder (read whole here). ``model``
    is the transformers (or peft) model built as the learner's was, with its base weights (a LoRA
    checkpoint holds the adapters only); the checkpoint's entries for it are loaded into it, in place,
    then written as :func:`export_pretrained` writes.

    Args:
        path (str or os.PathLike): the learner checkpoint (file or sharded folder).
        model (nn.Module): the model to fill and export (as the loss held it: a peft model for LoRA).
        folder (str or os.PathLike): the folder to create.

    Keyword Args:
        tokenizer (optional): saved beside the weights.
        lora (str): for a peft model, ``"merged"`` (default) or ``"adapters"``.
        prefix (str, optional): where ``model`` sits in the loss's state (e.g. ``"actor_network.model."``);
            found by itself when only one place fits.
        max_shard_bytes (int): the most bytes of one safetensors file (default 5 GiB).
        overwrite (bool): replace an existing ``folder``.

    Returns:
        The folder's path.

    Raises:
        FileNotFoundError: nothing at ``path``.
        FileExistsError: ``folder`` exists and ``overwrite`` is false.
        ValueError: the checkpoint does not hold this model's trained weights (named), before ``model`` changes.

    Examples:
        >>> import os, tempfile, torch
        >>> from transformers import AutoModelForCausalLM
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm import export_checkpoint
        >>> from fabric_learner.testing import grpo_example, tiny_causal_lm
        >>> loss, policy, batch = grpo_example()
        >>> learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1), policy=policy)
        >>> _ = learner.update(batch)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     learner.save(os.path.join(tmp, "learner.ckpt"))
        ...     folder = export_checkpoint(os.path.join(tmp, "learner.ckpt"), tiny_causal_lm(), os.path.join(tmp, "hf"))
        ...     loaded = AutoModelForCausalLM.from_pretrained(folder)
        >>> torch.equal(loaded.lm_head.weight, policy.model.lm_head.weight)
        True
    """
    from fabric_learner.checkpoint.dcp_folder import is_sharded_checkpoint, read_full

    if not Path(path).exists():
        raise FileNotFoundError(f"No learner checkpoint at {path}.")
    shard_bytes, _ = _check_sizes(max_shard_bytes, None)
    folder = Path(folder)
    error = _target_error(folder, overwrite)
    if error is not None:
        raise FileExistsError(error)
    plan = weight_plan(model, lora, Source(model))  # checks lora before the model changes
    checkpoint = read_full(path) if is_sharded_checkpoint(path) else read_learner_file(path)
    _load_into(model, checkpoint["model"], prefix, path)
    writer = _Writer(folder, shard_bytes, lora)
    try:
        for bucket in fill_buckets(plan, shard_bytes, torch.device("cpu")):
            writer.add(bucket)
        writer.finish(model, tokenizer, lora, overwrite)
    except BaseException:
        writer.abandon()
        raise
    return folder


# ---- checks ----------------------------------------------------------------------------------------

def _check_sizes(max_shard_bytes: Any, bucket_bytes: Any) -> tuple[int, int]:
    for name, value in (("max_shard_bytes", max_shard_bytes), ("bucket_bytes", bucket_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r}.")
    return max_shard_bytes, max_shard_bytes if bucket_bytes is None else bucket_bytes


def _target_error(folder: Path, overwrite: bool) -> str | None:
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file; an export is a folder. Pass another path."
    if folder.exists() and not overwrite:
        return f"{folder} exists; nothing was written. Pass a new path, or overwrite=True to replace it."
    return None


def _raise_agreed(learner, error: str | None, kind: type[Exception]) -> None:
    """Raise ``error`` (rank 0's) on every rank."""
    if learner.world_size > 1:
        error = learner.fabric.broadcast(error, src=0)
    if error is not None:
        raise kind(error)


def _load_into(model: nn.Module, state: dict[str, torch.Tensor], prefix: str | None, path) -> None:
    """Load ``state``'s entries under ``prefix`` into ``model``; every trained entry must be there."""
    ours = model.state_dict(keep_vars=True)
    trained = [k for k, v in ours.items() if not (isinstance(v, nn.Parameter) and not v.requires_grad)]
    if prefix is None:
        anchor = trained[0] if trained else next(iter(ours))
        found = sorted({k[: len(k) - len(anchor)] for k in state if k.endswith(anchor)
                        and (len(k) == len(anchor) or k[len(k) - len(anchor) - 1] == ".")})
        fits = [p for p in found if all(p + k in state for k in trained)]
        if len(fits) != 1:
            raise ValueError(f"{path}: cannot tell where the {type(model).__name__} sits in the checkpoint "
                             f"(places that fit: {fits or 'none'}; entries ending like {anchor!r}: {found[:4]}); "
                             "nothing was loaded. Pass prefix=, e.g. 'actor_network.model.', and a model built as "
                             "the learner's was (a peft model for a LoRA learner).")
        prefix = fits[0]
    missing = [k for k in trained if prefix + k not in state]
    wrong = [k for k in ours if prefix + k in state and tuple(state[prefix + k].shape) != tuple(ours[k].shape)]
    if missing or wrong:
        raise ValueError(f"{path}: the checkpoint lacks {missing[:4]} under {prefix!r} or their shapes differ "
                         f"({wrong[:4]}); nothing was loaded. Build the model as the learner's was.")
    with torch.no_grad():
        for key, value in ours.items():
            if prefix + key in state:
                value.copy_(state[prefix + key])


# ---- writing ---------------------------------------------------------------------------------------

class _Writer:
    """Rank 0's side: safetensors shards into a temporary sibling, renamed onto ``folder`` at the end."""

    def __init__(self, folder: Path, shard_bytes: int, lora: str) -> None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.folder, self.shard_bytes = folder, shard_bytes
        self.tmp = folder.parent / f".{folder.name}.export-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.stem = "adapter_model" if lora == "adapters" else "model"
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # names in each written shard, in order

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
                self._flush()
            self.pending[name] = tensor.contiguous()
            self.pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self.files)
        save_file(self.pending, str(self.tmp / f"shard-{index}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self, model: nn.Module, tokenizer, lora: str, overwrite: bool) -> None:
        if self.pending or not self.files:
            self._flush()
        self._name_shards()
        if lora == "adapters" and hasattr(model, "peft_config"):
            adapter = getattr(model, "active_adapter", "default")
            config = copy.deepcopy(model.peft_config[adapter])
            config.inference_mode = True
            config.save_pretrained(str(self.tmp))
        else:
            base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
            base.config.save_pretrained(str(self.tmp))
            generation = getattr(base, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(str(self.tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(self.tmp))
        self._publish(overwrite)

    def _name_shards(self) -> None:
        count = len(self.files)
        if count == 1:
            os.replace(self.tmp / "shard-0.safetensors", self.tmp / f"{self.stem}.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            name = f"{self.stem}-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.tmp / f"shard-{i}.safetensors", self.tmp / name)
            weight_map.update(dict.fromkeys(names, name))
        total = sum((self.tmp / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.tmp / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def _publish(self, overwrite: bool) -> None:
        for file in self.tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(self.tmp)
        old = None
        if self.folder.exists() and overwrite:
            old = self.folder.parent / f".{self.folder.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.folder, old)
        os.replace(self.tmp, self.folder)
        fsync_dir(self.folder.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.folder.parent.glob(f".{self.folder.name}.export-*"):  # left by exports that were killed
            shutil.rmtree(stale, ignore_errors=True)

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.tmp)

