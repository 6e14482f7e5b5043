"""Full tensors of the trained model by state key: its live tensors, or gathered from a sharded learner's shards."""

from __future__ import annotations

import math

import torch
from torch import nn


class Source:
    """Full tensors of a model by state key: ``read`` (a collective when sharded), ``nbytes``, and
    whether ``read`` returns the live tensor itself (``aliases``: then senders copy it)."""

    aliases = True

    def __init__(self, model: nn.Module) -> None:
        self.live = model.state_dict(keep_vars=True)

    def read(self, key: str) -> torch.Tensor:
        return self.live[key].detach()

    def nbytes(self, key: str) -> int:
        t = self.live[key]
        return t.numel() * t.element_size()


class ShardedSource(Source):
    """Reads each parameter from the learner's shards (``DTensor.full_tensor``: an all-gather).

    The model's parameter objects stay in the loss as placeholders (``ShardedLoss``); each is paired
    with its shard by identity, so the pairing holds wherever the model sits in the loss.
    """

    aliases = False

    def __init__(self, model: nn.Module, owner) -> None:
        super().__init__(model)
        by_id = {id(owner._originals[n]): n for n in owner.names}
        self.owner = owner
        self.names = {k: by_id[id(v)] for k, v in self.live.items() if id(v) in by_id}
        stray = [k for k, v in self.live.items() if isinstance(v, nn.Parameter) and k not in self.names]
        if stray:
            raise ValueError(f"{type(model).__name__}'s parameters {stray[:4]} are not among those the sharded "
                             "learner holds; pass the model the loss trains (e.g. the TransformersWrapper's .model).")

    def read(self, key: str) -> torch.Tensor:
        name = self.names.get(key)
        if name is None:  # a buffer: replicated on every rank
            return self.live[key].detach().clone()
        param = self.owner.param(name)
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach().clone()
        return full.detach().reshape(self.owner.shapes[name])

    def nbytes(self, key: str) -> int:
        name = self.names.get(key)
        if name is None:
            return super().nbytes(key)
        return math.prod(self.owner.shapes[name]) * self.owner.param(name).element_size()


def learner_source(learner, model: nn.Module) -> Source:
    """Where ``model``'s full tensors come from: its live tensors, or the learner's shards when sharded."""
    if not learner.capabilities.sharded:
        return Source(model)
    return ShardedSource(model, learner.sharded_module)
