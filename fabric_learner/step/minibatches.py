"""Many updates in one call: ``Learner.update_minibatches`` (PPO's epochs over minibatches, or K off-policy steps).

The loop every on-policy trainer writes, run by the learner itself: each epoch, a partition of the
batch into minibatches of ``minibatch_size`` (without replacement, :func:`onpolicy.partition_indices`;
or in order with ``shuffle=False``), optionally the advantage standardised per minibatch over every
rank's minibatch (:func:`onpolicy.normalize_advantage`), one optimizer step each (``grad_accum_steps``
equal micro-batches of it). On several ranks every rank takes the same number of minibatches (the
smallest over ranks: a rank that stepped once more would hang the others), each rank drawing from its
own generator (``seed + rank``).

What the loss writes into a minibatch (DQN's ``td_error``) lands in the caller's batch at that
minibatch's rows, the last write winning, as one ``update`` per minibatch on views of the batch would
leave it. A ``RemoteLearner`` sends each rank its share and runs this same loop there, in one call.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase

from fabric_learner.collectives import all_reduce, distributed_world_size


def check_arguments(minibatch_size: Any, epochs: Any, shuffle: Any, seed: Any, normalize_advantage: Any) -> None:
    """Refuse bad arguments before anything runs, naming each."""
    for name, value in (("minibatch_size", minibatch_size), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True or False, got {shuffle!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an integer or None (torch's global generator), got {seed!r}.")
    if not isinstance(normalize_advantage, (bool, str, tuple)):
        raise TypeError(f"normalize_advantage must be False, True ('advantage') or the entry's key, got "
                        f"{normalize_advantage!r}.")


def advantage_key(normalize_advantage: bool | NestedKey) -> NestedKey | None:
    if normalize_advantage is True:
        return "advantage"
    return normalize_advantage or None


def run(learner, batch: TensorDictBase, minibatch_size: int, *, epochs: int = 1, shuffle: bool = True,
        seed: int | None = None, normalize_advantage: bool | NestedKey = False) -> TensorDictBase:
    """``learner.update`` once per minibatch, for ``epochs`` epochs; every step's output stacked (see the module)."""
    check_arguments(minibatch_size, epochs, shuffle, seed, normalize_advantage)
    if not isinstance(batch, TensorDictBase):
        raise TypeError(f"update_minibatches() takes a TensorDict batch, got {type(batch).__name__}.")
    if batch.batch_dims != 1:
        raise ValueError(f"update_minibatches() partitions a batch of one dimension, got batch_size "
                         f"{list(batch.batch_size)}: pass batch.reshape(-1).")
    micro = learner.grad_accum_steps
    if minibatch_size % micro:
        raise ValueError(f"Each minibatch is one optimizer step of grad_accum_steps={micro} equal micro-batches: "
                         f"minibatch_size={minibatch_size} must divide by it. Nothing ran.")
    if learner._accum_step:
        raise ValueError("update_minibatches() starts at an accumulation window's start; this learner is "
                         f"{learner._accum_step} micro-batch(es) into one: finish it with update(). Nothing ran.")
    n = batch.batch_size[0]
    count = n // minibatch_size
    if count == 0:
        raise ValueError(f"The batch holds {n} samples, fewer than one minibatch of {minibatch_size}. Nothing ran.")
    key = advantage_key(normalize_advantage)
    if key is not None and key not in batch.keys(include_nested=True):
        raise KeyError(f"normalize_advantage names {key!r}, which the batch lacks. Nothing ran.")
    if distributed_world_size() > 1:  # every rank steps equally often
        device = next((p.device for p in learner.loss_module.parameters()), torch.device("cpu"))
        common = int(all_reduce(torch.tensor(count, device=device), "min"))
        if common < count:
            warnings.warn(f"This rank has {count} minibatches of {minibatch_size} but another has {common}; every rank "
                          f"takes {common} per epoch so that all step the same number of times.", stacklevel=3)
        count = common
    generator = None
    if shuffle and seed is not None:
        generator = torch.Generator().manual_seed(seed + learner.global_rank)
    from fabric_learner.onpolicy import normalize_advantage as standardise
    from fabric_learner.onpolicy import partition_indices

    outputs, writes = [], {}
    for _ in range(epochs):
        if shuffle:
            parts = partition_indices(n, minibatch_size, generator=generator, num_minibatches=count)
        else:
            parts = list(torch.arange(count * minibatch_size).split(minibatch_size))
        for index in parts:
            minibatch = batch[index]
            if key is not None:
                standardise(minibatch, key)
            steps = []
            for rows, chunk in zip(index.chunk(micro), minibatch.split(minibatch_size // micro)):
                before = _leaves(chunk)
                steps.append(learner.update(chunk))
                for name, value in _written(before, chunk, key):
                    writes.setdefault(name, []).append((rows, value))
            outputs.append(steps[0] if micro == 1 else _one_step(steps))
    for name, parts in writes.items():
        _write(batch, name, parts)
    return torch.stack(outputs)


def _one_step(outputs: list[TensorDictBase]) -> TensorDictBase:
    """A window's micro-batch outputs as its step's: the loss entries averaged (equal micro-batches), the rest
    (``grad_norm``) the last call's."""
    from fabric_learner.step.output import loss_keys

    out = outputs[-1].clone()
    for name in loss_keys(out):
        out.set(name, torch.stack([o.get(name) for o in outputs]).mean(0))
    return out


def _leaves(td: TensorDictBase) -> dict:
    return {k: (v, v._version) for k, v in td.items(include_nested=True, leaves_only=True)
            if isinstance(v, torch.Tensor)}


def _written(before: dict, td: TensorDictBase, skip: NestedKey | None):
    """The entries the loss added to ``td``, replaced or wrote into in place, with their values."""
    for name, value in td.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor) or name == skip:
            continue
        old = before.get(name)
        if old is None or old[0] is not value or old[1] != value._version:
            yield name, value


def _write(batch: TensorDictBase, name: NestedKey, parts: list) -> None:
    """``name`` in ``batch``: its rows from each minibatch that wrote it, in order (the batch's old values, or
    zeros for a new entry, where no minibatch ran)."""
    first = parts[0][1]
    old = batch.get(name, None)
    if isinstance(old, torch.Tensor) and old.shape[1:] == first.shape[1:]:
        whole = old.detach().clone().to(first.dtype)
    else:
        whole = torch.zeros((batch.batch_size[0], *first.shape[1:]), dtype=first.dtype, device=first.device)
    for index, value in parts:
        whole[index] = value.detach()
    batch.set(name, whole)
