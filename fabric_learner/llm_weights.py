"""A language model's weights from the learner to a generation engine, by parameter name, in bounded buckets.

Inference engines (vLLM, SGLang, a second ``TransformersWrapper(generate=True)``) hold their own copy
of the model and take weights as ``(name, tensor)`` pairs named as the transformers model names its
own state (``model.layers.0.self_attn.q_proj.weight``). :func:`weight_buckets` yields them from a
learner in lists of at most ``bucket_bytes``: under a sharded (FSDP) learner each tensor is gathered
only when its bucket is filled and nothing is kept once the bucket is handed over, so a rank holds
its shards plus one bucket, never a second full model. :func:`load_weights` copies pairs (or a
``get_weights()`` TensorDict) into a model by name.

With a ``peft`` LoRA model, ``lora="merged"`` gives the base weights with the adapters folded in
(``W + scaling * B @ A``, named as the base model, what an engine without LoRA support loads) and
``lora="adapters"`` the adapter tensors alone, named as peft saves them (the adapter name dropped:
``...q_proj.lora_A.weight``), what ``PeftModel.from_pretrained`` and engines with LoRA support read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["LORA_MODES", "load_weights", "trained_model", "weight_buckets"]

LORA_MODES = ("merged", "adapters")
DEFAULT_BUCKET_BYTES = 512 * 2**20


def trained_model(learner, model: nn.Module | None = None) -> nn.Module:
    """The transformers (or peft) model the learner trains: ``model`` checked, or found from ``policy=``.

    Without ``model`` it is the ``.model`` of the learner's policy (torchrl's ``TransformersWrapper``
    holds the transformers model there) or the policy itself when it is a transformers model.

    Args:
        learner (Learner): a learner whose loss holds the model.
        model (nn.Module, optional): the model, when the learner has no such policy.

    Raises:
        ValueError: no model given and none found, or ``model`` is not a module of the learner's loss.

    Examples:
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm_weights import trained_model
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, _ = grpo_example()
        >>> trained_model(LocalLearner(loss, policy=policy)) is policy.model
        True
    """
    if model is None:
        policy = learner.policy
        inner = getattr(policy, "model", None)
        if isinstance(inner, nn.Module):
            model = inner
        elif policy is not None and hasattr(policy, "config"):
            model = policy
        else:
            raise ValueError(
                "Cannot tell which model the learner trains: its policy= is "
                f"{type(policy).__name__ if policy is not None else 'None'}, not torchrl's TransformersWrapper "
                "(whose .model is the transformers model) or a transformers model. Build the learner with "
                "policy=<the TransformersWrapper the loss trains>, or pass model=<the transformers model>."
            )
    _prefix_in(learner.loss_module, model)
    return model


def weight_buckets(learner, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, model: nn.Module | None = None,
                   lora: str = "merged", device: torch.device | str | None = None,
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trained model's weights as lists of ``(name, tensor)`` pairs of at most ``bucket_bytes`` each.

    Names are the transformers model's own state-dict keys (with LoRA: see the module doc), each tied
    tensor once. Every tensor is a fresh copy that later updates do not change. A tensor larger than
    ``bucket_bytes`` comes alone in its bucket. Under a sharded learner each bucket is gathered from
    the shards when it is filled (a collective: every rank must iterate to the end, and every rank
    receives the buckets); the iterator keeps nothing of a bucket once it is handed over, so a rank
    holds its shards, the bucket being filled and whatever the caller keeps.

    Args:
        learner (Learner): the learner; its policy (or ``model``) is the transformers model.
        bucket_bytes (int): the most bytes of tensors one bucket holds (default 512 MiB).

    Keyword Args:
        model (nn.Module, optional): the transformers or peft model the loss trains (default: the
            policy's, see :func:`trained_model`).
        lora (str): for a peft model, ``"merged"`` (default) or ``"adapters"``.
        device: where the tensors go (default: where the learner holds them).

    Yields:
        Lists of ``(name, tensor)`` pairs.

    Raises:
        ValueError: a bad ``bucket_bytes`` or ``lora``, a model the learner does not train, or a
            peft model with an adapter kind that cannot be merged here (named), before anything is gathered.

    Examples:
        >>> import copy, itertools, torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm_weights import load_weights, weight_buckets
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example()
        >>> generator_model = copy.deepcopy(policy.model)  # the engine's own copy
        >>> learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1), policy=policy)
        >>> _ = learner.update(batch)
        >>> buckets = list(weight_buckets(learner, bucket_bytes=100_000))
        >>> len(buckets) > 1, max(sum(t.nbytes for _, t in b) for b in buckets) <= 100_000
        (True, True)
        >>> load_weights(generator_model, itertools.chain.from_iterable(buckets))
        27
        >>> torch.equal(generator_model.lm_head.weight, policy.model.lm_head.weight)
        True
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer (bytes per bucket), got {bucket_bytes!r}.")
    model = trained_model(learner, model)
    plan = weight_plan(model, lora, learner_source(learner, model))
    return _buckets(plan, bucket_bytes, device)


def _buckets(plan: list[Entry], bucket_bytes: int, device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for entry in plan:
        if bucket and held + entry.nbytes > bucket_bytes:
            yield bucket
            bucket, held = [], 0  # the handed-over bucket is the caller's alone from here
        tensor = entry.fetch()  # a fresh tensor: later updates do not change it
        if device is not None and tensor.device != torch.device(device):
            tensor = tensor.to(device)
        bucket.append((entry.name, tensor))
        held += entry.nbytes
    if bucket:
        yield bucket


# ---- what to send: names, sizes and how to get each full tensor ---------------------------------

@dataclass(frozen=True)
class Entry:
    """One tensor to send: its name, its size in bytes and how to get it (a fresh full tensor; a collective
    when the learner is sharded)."""

    name: str
    nbytes: int
    fetch: Callable[[], torch.Tensor]


def weight_plan(model: nn.Module, lora: str, source: Source) -> list[Entry]:
    """What :func:`weight_buckets` sends for ``model``, each tensor read from ``source`` by state key.

    Checks ``lora`` and the model's adapters before anything is read.
    """
    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, got {lora!r}: 'merged' folds LoRA adapters into the "
                         "base weights, 'adapters' sends the adapter tensors alone.")
    state = _unique_state(model)
    layers = _lora_layers(model)
    if not layers:
        if lora == "adapters":
            raise ValueError(f"lora='adapters' needs a peft model with LoRA adapters; {type(model).__name__} has none. "
                             "Use lora='merged' (the default), which sends the model's own weights.")
        return [Entry(k, source.nbytes(k), _reader(source, k)) for k in state]
    base = _base_prefix(model)
    if lora == "adapters":
        return [Entry(_without_adapter(k, layers), source.nbytes(k), _reader(source, k))
                for k in state if _lora_part(k, layers)]
    plan = []
    for key in state:
        if _lora_part(key, layers):
            continue
        owner, _, field = key.rpartition(".base_layer.")
        layer = layers.get(owner) if field else None
        name = (f"{owner}.{field}" if layer is not None else key).removeprefix(base)
        if layer is not None and field == "weight":
            plan.append(Entry(name, source.nbytes(key), _merger(source, owner, layer)))
        else:
            plan.append(Entry(name, source.nbytes(key), _reader(source, key)))
    return plan


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state-dict entries, each tensor once (a tied weight under its first key)."""
    seen, out = set(), {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            out[key] = value
    return out


def _reader(source: Source, key: str):
    if source.aliases:
        return lambda: source.read(key).clone()
    return lambda: source.read(key)


@dataclass(frozen=True)
class _Lora:
    adapter: str
    scaling: float
    transpose: bool


def _lora_layers(model: nn.Module) -> dict[str, _Lora]:
    """``{state-key prefix: adapter}`` of each LoRA layer of a peft model; raises on what cannot be merged."""
    layers = {}
    for path, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or not hasattr(module, "base_layer"):
            continue
        if not lora_a and not getattr(module, "lora_embedding_A", None):
            continue
        active = [a for a in getattr(module, "active_adapters", ()) if a in lora_a]
        problem = None
        if getattr(module, "lora_embedding_A", None):
            problem = "an embedding LoRA layer"
        elif len(active) != 1:
            problem = f"{len(active)} active adapters ({active}), expected one"
        elif getattr(module, "use_dora", {}).get(active[0], False):
            problem = "a DoRA adapter"
        elif getattr(module, "merged", False):
            problem = "adapters already merged into its base weights in place"
        elif not isinstance(module.base_layer, nn.Linear) and not getattr(module, "fan_in_fan_out", False):
            problem = f"a LoRA layer over {type(module.base_layer).__name__}"
        if problem is not None:
            raise ValueError(f"{path} has {problem}; only one active plain LoRA adapter on linear layers is sent "
                             "here. Use a plain LoRA config (no DoRA, linear target_modules), one adapter, unmerged.")
        adapter = active[0]
        layers[path] = _Lora(adapter, float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False)))
    return layers


def _lora_part(key: str, layers: dict[str, _Lora]) -> bool:
    owner, _, rest = key.rpartition(".lora_")
    return owner in layers and bool(rest)


def _without_adapter(key: str, layers: dict[str, _Lora]) -> str:
    """peft's saved name: ``<layer>.lora_A.<adapter>.weight`` -> ``<layer>.lora_A.weight``."""
    owner, _, rest = key.rpartition(".lora_")
    part, _, tail = rest.partition(".")
    adapter = layers[owner].adapter
    return f"{owner}.lora_{part}.{tail.removeprefix(adapter + '.')}"


def _base_prefix(model: nn.Module) -> str:
    """The state-key prefix of a peft model's base transformers model (``base_model.model.``)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    if base is None or base is model:
        return ""
    for path, module in model.named_modules():
        if module is base:
            return f"{path}."
    return ""


def _merger(source: Source, owner: str, layer: _Lora):
    def merged() -> torch.Tensor:
        weight = source.read(f"{owner}.base_layer.weight")
        a = source.read(f"{owner}.lora_A.{layer.adapter}.weight")
        b = source.read(f"{owner}.lora_B.{layer.adapter}.weight")
        delta = b.to(weight.dtype) @ a.to(weight.dtype)  # as peft's get_delta_weight, in the base's dtype
        if layer.transpose:
            delta = delta.T
        return weight + delta * layer.scaling

    return merged


# ---- reading the learner's tensors ---------------------------------------------------------------

def _prefix_in(loss_module: nn.Module, model: nn.Module) -> str:
    """``model``'s path in ``loss_module`` (``"actor_network.model."``); raises when it is not there."""
    stack = [("", loss_module)]
    seen = set()
    while stack:
        path, module = stack.pop()
        if module is model:
            return f"{path}." if path else ""
        if id(module) in seen:
            continue
        seen.add(id(module))
        stack.extend((f"{path}.{n}" if path else n, m) for n, m in reversed(module._modules.items()) if m is not None)
    raise ValueError(f"The {type(model).__name__} given is not a module of the learner's loss "
                     f"({type(loss_module).__name__}); pass the model the loss trains (e.g. the TransformersWrapper's "
                     ".model), not a copy.")


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


class _ShardedSource(Source):
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
    return _ShardedSource(model, learner.sharded_module)


# ---- the receiving side --------------------------------------------------------------------------

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
        >>> from fabric_learner.llm_weights import load_weights
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

    def missing(self) -> list[str]:
        return [k for k, p in self.model.named_parameters() if id(p) not in self.received]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under each of its names (``get_weights`` has them all)."""
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}


def _aliases(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """For a peft model: peft's saved adapter names (adapter name dropped) of its LoRA tensors."""
    try:
        layers = _lora_layers(model)
    except ValueError:
        return {}
    return {_without_adapter(k, layers): v for k, v in state.items() if _lora_part(k, layers)}
