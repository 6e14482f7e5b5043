"""peft LoRA layers, as the weights sent to a generation engine need them: found, named, merged.

Only one active, unmerged, plain LoRA adapter on linear layers is supported; anything else (DoRA,
embedding adapters, several adapters) is refused by name before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fabric_learner.llm.sources import Source


@dataclass(frozen=True)
class LoraLayer:
    adapter: str
    scaling: float
    transpose: bool


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
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
        layers[path] = LoraLayer(adapter, float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False)))
    return layers


def is_lora_part(key: str, layers: dict[str, LoraLayer]) -> bool:
    owner, _, rest = key.rpartition(".lora_")
    return owner in layers and bool(rest)


def saved_adapter_name(key: str, layers: dict[str, LoraLayer]) -> str:
    """peft's saved name: ``<layer>.lora_A.<adapter>.weight`` -> ``<layer>.lora_A.weight``."""
    owner, _, rest = key.rpartition(".lora_")
    part, _, tail = rest.partition(".")
    adapter = layers[owner].adapter
    return f"{owner}.lora_{part}.{tail.removeprefix(adapter + '.')}"


def base_prefix(model: nn.Module) -> str:
    """The state-key prefix of a peft model's base transformers model (``base_model.model.``)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    if base is None or base is model:
        return ""
    for path, module in model.named_modules():
        if module is base:
            return f"{path}."
    return ""


def merged_reader(source: Source, owner: str, layer: LoraLayer):
    def merged() -> torch.Tensor:
        weight = source.read(f"{owner}.base_layer.weight")
        a = source.read(f"{owner}.lora_A.{layer.adapter}.weight")
        b = source.read(f"{owner}.lora_B.{layer.adapter}.weight")
        delta = b.to(weight.dtype) @ a.to(weight.dtype)  # as peft's get_delta_weight, in the base's dtype
        if layer.transpose:
            delta = delta.T
        return weight + delta * layer.scaling

    return merged
