"""A language model's weights from the learner to a generation engine, by parameter name, in bounded buckets.

Inference engines (vLLM, SGLang, a second ``TransformersWrapper(generate=True)``) hold their own copy
of the model and take weights as ``(name, tensor)`` pairs named as the transformers model names its
own state (``model.layers.0.self_attn.q_proj.weight``). :func:`weight_buckets` yields them from a
learner in lists of at most ``bucket_bytes``: under a sharded (FSDP) learner each tensor is gathered
only when its bucket is filled and nothing is kept once the bucket is handed over, so a rank holds
its shards plus one bucket, never a second full model. :func:`load_weights` (``receive.py``) copies
pairs (or a ``get_weights()`` TensorDict) into a model by name.

With a ``peft`` LoRA model, ``lora="merged"`` gives the base weights with the adapters folded in
(``W + scaling * B @ A``, named as the base model, what an engine without LoRA support loads) and
``lora="adapters"`` the adapter tensors alone, named as peft saves them (the adapter name dropped:
``...q_proj.lora_A.weight``), what ``PeftModel.from_pretrained`` and engines with LoRA support read
(``lora.py``). Where each full tensor comes from (live, or gathered from shards) is ``sources.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fabric_learner.llm.lora import base_prefix, is_lora_part, lora_layers, merged_reader, saved_adapter_name
from fabric_learner.llm.receive import load_weights
from fabric_learner.llm.sources import Source, learner_source

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
        >>> from fabric_learner.llm import trained_model
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
        >>> from fabric_learner.llm import load_weights, weight_buckets
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
    return fill_buckets(plan, bucket_bytes, device)


def fill_buckets(plan: list[Entry], bucket_bytes: int, device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``plan`` cut into lists of at most ``bucket_bytes``, each tensor fetched only when its bucket is filled."""
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
    layers = lora_layers(model)
    if not layers:
        if lora == "adapters":
            raise ValueError(f"lora='adapters' needs a peft model with LoRA adapters; {type(model).__name__} has none. "
                             "Use lora='merged' (the default), which sends the model's own weights.")
        return [Entry(k, source.nbytes(k), _reader(source, k)) for k in state]
    base = base_prefix(model)
    if lora == "adapters":
        return [Entry(saved_adapter_name(k, layers), source.nbytes(k), _reader(source, k))
                for k in state if is_lora_part(k, layers)]
    plan = []
    for key in state:
        if is_lora_part(key, layers):
            continue
        owner, _, field = key.rpartition(".base_layer.")
        layer = layers.get(owner) if field else None
        name = (f"{owner}.{field}" if layer is not None else key).removeprefix(base)
        if layer is not None and field == "weight":
            plan.append(Entry(name, source.nbytes(key), merged_reader(source, owner, layer)))
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


# ---- which model the learner trains ------------------------------------------------------------

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
