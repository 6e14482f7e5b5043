"""The receiving side: named tensors copied into a generation engine's model, checked bucket by bucket."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from fabric_learner.llm.lora import is_lora_part, lora_layers, saved_adapter_name

__all__ = ["load_weights"]


def load_weights(model: nn.Module, weights: Any, *, strict: bool = True) -> int:
    """Copy named tensors into ``model``'s parameters and buffers, in place; returns how many were copied.

    ``weights`` is a mapping ``{name: tensor}``, a TensorDict (``learner.get_weights()``: its keys
    joined with dots), an iterable of ``(name, tensor)`` pairs, or an iterable of buckets of pairs
    (:func:`weight_buckets`). Names are ``model``'s state-dict keys, or those of its ``.model`` for
    torchrl's wrappers (``TransformersWrapper``); for a peft ``model``, peft's saved adapter names
    (``...lora_A.weight``) are accepted too. Tensors are cast to the receiving tensor's dtype and device.

    Checks every name and shape of a mapping before copying anything; a stream is checked bucket by
    bucket, each before it is copied. With ``strict`` every parameter of ``model`` must have been
    received (checked at the end: a stream that lacks some has copied the rest).

    Args:
        model (nn.Module): the receiving model (the generation engine's copy).
        weights: see above.

    Keyword Args:
        strict (bool): require every parameter of ``model`` (default ``True``; ``False`` for adapters alone).

    Returns:
        The number of tensors copied.

    Raises:
        KeyError: a name ``model`` does not have (with the nearest fix).
        ValueError: a shape that differs, an empty TensorDict or (with ``strict``) no tensors at all (as
            ``get_weights()`` gives ranks other than 0 under FSDP), or with ``strict`` parameters that received nothing.

    Examples:
        >>> import copy, torch
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm import load_weights
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example()
        >>> generator = TransformersWrapper(copy.deepcopy(policy.model), tokenizer=policy.tokenizer,
        ...                                 input_mode="history", generate=True)
        >>> learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1), policy=policy)
        >>> _ = learner.update(batch)
        >>> load_weights(generator, learner.get_weights())
        29
        >>> torch.equal(generator.model.lm_head.weight, policy.model.lm_head.weight)
        True
    """
    if isinstance(weights, TensorDictBase):
        if weights.is_empty():
            raise ValueError(_NOTHING_SENT)
        weights = weights.flatten_keys(".").to_dict()
    buckets = [list(weights.items())] if isinstance(weights, Mapping) else _as_buckets(weights)
    receiver: _Receiver | None = None
    copied = 0
    for bucket in buckets:
        if not bucket:
            continue
        if receiver is None:
            receiver = _Receiver(model, bucket[0][0])
        targets = receiver.check(bucket)
        with torch.no_grad():
            for target, (_, tensor) in zip(targets, bucket):
                target.copy_(tensor)
        receiver.received.update(id(t) for t in targets)
        copied += len(bucket)
        del bucket, targets
    if strict:
        if receiver is None:
            raise ValueError(_NOTHING_SENT)
        missing = receiver.missing()
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) of the model received no weights, e.g. {missing[:4]}. "
                             "Send all of them (a peft model sent lora='adapters' receives only its adapters: "
                             "pass strict=False), or check that sender and receiver are the same architecture.")
    return copied


_NOTHING_SENT = (
    "load_weights received no tensors (an empty TensorDict, mapping or stream): nothing was sent, nothing was copied. "
    "Under FSDP, learner.get_weights() (cpu_offload=True, the default) gathers the weights to rank 0 only and gives "
    "the other ranks an empty TensorDict; where every rank loads them, call learner.get_weights(cpu_offload=False) "
    "or iterate weight_buckets(learner) on every rank."
)


def _as_buckets(weights: Iterable) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets from an iterable of pairs or of buckets (lists or mappings of pairs)."""
    pending: list[tuple[str, torch.Tensor]] = []
    for item in weights:
        if isinstance(item, Mapping):
            item = list(item.items())
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            pending.append(item)
            if len(pending) >= 64:
                yield pending
                pending = []
            continue
        if pending:
            yield pending
            pending = []
        if not isinstance(item, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in item):
            raise TypeError(f"weights must be a mapping, (name, tensor) pairs or buckets of them; got an item of "
                            f"type {type(item).__name__}.")
        yield item
    if pending:
        yield pending


class _Receiver:
    """Resolves names to the receiving model's tensors: its own keys, its ``.model``'s, peft's saved names."""

    def __init__(self, model: nn.Module, first_name: str) -> None:
        inner = getattr(model, "model", None)
        own = _named_tensors(model)
        if first_name not in own and isinstance(inner, nn.Module) and first_name not in _aliases(own, model):
            model = inner
            own = _named_tensors(model)
        self.model, self.tensors = model, {**_aliases(own, model), **own}
        self.received: set[int] = set()

    def check(self, bucket: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        targets = []
        for name, tensor in bucket:
            target = self.tensors.get(name)
            if target is None:
                prefix = self._loss_prefix(name)
                if prefix is not None:
                    raise KeyError(
                        f"{type(self.model).__name__} has no tensor {name!r}, but has it without {prefix!r}: these "
                        "weights are laid out as the loss module, as learner.get_weights() gives them when the "
                        "learner was built without policy=; nothing of this bucket was copied. Build the learner "
                        "with policy=<the TransformersWrapper the loss trains>: get_weights() then has the model's "
                        "names (or send weight_buckets(learner, model=<the transformers model>)).")
                near = sorted(k for k in self.tensors if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:3]
                raise KeyError(f"{type(self.model).__name__} has no tensor {name!r} (similar: {near}); nothing of "
                               "this bucket was copied. Send names as the receiving model's state dict keys: a plain "
                               "model receives lora='merged' weights, a peft model lora='adapters' ones.")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(target.shape):
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name!r} has shape {shape}, the receiving tensor {tuple(target.shape)}; nothing "
                                 "of this bucket was copied. Sender and receiver must be the same architecture.")
            targets.append(target)
        return targets

    def _loss_prefix(self, name: str) -> str | None:
        """The leading part of ``name`` without which it is one of the model's names (``'actor_network.model.'``)."""
        parts = name.split(".")
        for cut in range(1, len(parts)):
            if ".".join(parts[cut:]) in self.tensors:
                return ".".join(parts[:cut]) + "."
        return None

    def missing(self) -> list[str]:
        return [k for k, p in self.model.named_parameters() if id(p) not in self.received]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under each of its names (``get_weights`` has them all)."""
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}


def _aliases(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """For a peft model: peft's saved adapter names (adapter name dropped) of its LoRA tensors."""
    try:
        layers = lora_layers(model)
    except ValueError:
        return {}
    return {saved_adapter_name(k, layers): v for k, v in state.items() if is_lora_part(k, layers)}
