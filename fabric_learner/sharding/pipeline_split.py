"""Pipeline splits of a model: the default one for transformers decoders, and the check every split passes.

A split is a function ``split_fn(model, stage, num_stages) -> model`` that keeps, in ``model`` itself, only
what stage ``stage`` of ``num_stages`` runs: the modules of the other stages are removed (set to ``None``) or
replaced by pass-throughs, so the parameters keep the names they have in the whole model. The first stage is
called as the model is (token ids and attention mask) and returns hidden states; a later stage is called with
``inputs_embeds=`` those hidden states and the same mask; the last returns the logits.

:func:`decoder_split` is such a split for transformers decoders (Qwen2, Llama, ...: ``model.model.layers``):
by decoder layer, balanced by parameter count. It is a convenience kept out of the learner: any function of
that shape works (``PipelineStrategy(split_fn=...)``). :func:`check_split` refuses, before training, a split
that leaves a parameter in no stage or puts it in two; it runs the split on parameter-less (meta) copies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["check_split", "decoder_split", "decoder_stage_bounds"]

Split = Callable[[nn.Module, int, int], nn.Module]


class PassThrough(nn.Module):
    """Stands for a decoder layer another stage runs: returns the hidden states it is given."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _decoder_parts(model: nn.Module):
    """``(inner, layers)`` of a transformers causal LM: ``model.model`` and its decoder layers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head"):
        raise TypeError(
            f"decoder_split splits transformers decoders laid out as model.model.embed_tokens, model.model.layers, "
            f"model.model.norm and model.lm_head (Qwen2, Llama); {type(model).__name__} is not. Pass your own "
            "split_fn(model, stage, num_stages) to PipelineStrategy."
        )
    return inner, layers


def _size(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def decoder_stage_bounds(model: nn.Module, num_stages: int) -> list[tuple[int, int]]:
    """Each stage's decoder layers ``[start, end)``, contiguous, balanced by parameter count.

    The first stage also holds the token embeddings, the last the final norm and the LM head; the cut
    minimises the largest stage's parameter count, every stage holding at least one layer.

    Examples:
        >>> from fabric_learner.sharding.pipeline_split import decoder_stage_bounds
        >>> from fabric_learner.testing import tiny_causal_lm
        >>> decoder_stage_bounds(tiny_causal_lm(), 2)
        [(0, 1), (1, 2)]
    """
    inner, layers = _decoder_parts(model)
    n = len(layers)
    if not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise ValueError(f"decoder_split needs 1 to {n} stages for a model of {n} decoder layers (one layer at "
                         f"least per stage), got {num_stages!r}. Use fewer pipeline stages.")
    sizes = [_size(layer) for layer in layers]
    head, tail = _size(inner.embed_tokens), _size(inner.norm) + _size(model.lm_head)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def cost(stage: int, start: int, end: int) -> int:
        return (prefix[end] - prefix[start] + (head if stage == 0 else 0)
                + (tail if stage == num_stages - 1 else 0))

    # best[s][e]: the least largest stage over stages 0..s-1 holding layers [0, e); cut[s][e]: where stage s-1 starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for e in range(s, n + 1):
            for start in range(s - 1, e):
                value = max(best[s - 1][start], cost(s - 1, start, e))
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, start
    bounds, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def decoder_split(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Keep in ``model`` (in place) what pipeline stage ``stage`` of ``num_stages`` runs; return it.

    Stage ``s`` keeps its decoder layers (:func:`decoder_stage_bounds`), the others replaced by pass-throughs;
    the first stage keeps the token embeddings and gives the last layer's hidden states as its "logits" (norm and
    LM head are identities there); later stages drop the embeddings (they are called with ``inputs_embeds=``);
    the last keeps the final norm and the LM head. Parameter names stay the whole model's. Tied input and output
    embeddings (``tie_word_embeddings=True``) would live on two stages and are refused.

    Examples:
        >>> from fabric_learner.sharding.pipeline_split import decoder_split
        >>> from fabric_learner.testing import tiny_causal_lm
        >>> last = decoder_split(tiny_causal_lm(), 1, 2)
        >>> sorted({name.split(".")[2] if name.startswith("model.layers") else name.split(".")[1]
        ...         for name, _ in last.named_parameters()})
        ['1', 'norm', 'weight']
    """
    inner, layers = _decoder_parts(model)
    if num_stages > 1 and model.lm_head.weight is inner.embed_tokens.weight:
        raise ValueError(
            f"{type(model).__name__} ties its LM head to its input embeddings (tie_word_embeddings=True): one "
            "parameter on the first and the last stage, which this split does not keep in step. Untie them "
            "(model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())) or use one stage."
        )
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be an integer in [0, {num_stages}), got {stage!r}.")
    start, end = decoder_stage_bounds(model, num_stages)[stage]
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = PassThrough()
    if stage > 0:
        inner.embed_tokens = None
    if stage < num_stages - 1:
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory, no data copied)."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def check_split(model: nn.Module, split_fn: Split, num_stages: int) -> list[set[str]]:
    """Each stage's parameter names under ``split_fn``; raises unless every parameter is in exactly one stage.

    Runs ``split_fn`` on a meta copy of ``model`` per stage (``model`` is not changed), so every rank refuses a
    bad split alike, before any process group or training. Trainable parameters only (frozen ones are kept where
    the split puts them, in no optimizer).

    Raises:
        ValueError: a parameter in no stage or in several, or a ``split_fn`` that returned another module.

    Examples:
        >>> from fabric_learner.sharding.pipeline_split import check_split, decoder_split
        >>> from fabric_learner.testing import tiny_causal_lm
        >>> [len(names) for names in check_split(tiny_causal_lm(), decoder_split, 2)]
        [13, 14]
    """
    everything = [name for name, p in model.named_parameters() if p.requires_grad]
    stages = []
    for stage in range(num_stages):
        part = meta_copy(model)
        kept = split_fn(part, stage, num_stages)
        if kept is not part:
            raise ValueError(
                f"split_fn returned a {type(kept).__name__} for stage {stage}, not the model it was given. A split "
                "keeps the stage's part in the model itself (other stages' modules set to None or replaced by "
                "pass-throughs) and returns it, so parameters keep their names."
            )
        stages.append({name for name, p in kept.named_parameters() if p.requires_grad})
    union = set().union(*stages)
    missing = [name for name in everything if name not in union]
    twice = [name for name in everything if sum(name in s for s in stages) > 1]
    foreign = sorted(union.difference(everything))
    if missing or twice or foreign:
        what = []
        if missing:
            what.append(f"in no stage: {_few(missing)}")
        if twice:
            where = {name: [s for s, names in enumerate(stages) if name in names] for name in twice}
            what.append("in several stages: " + _few([f"{name} (stages {where[name]})" for name in twice]))
        if foreign:
            what.append(f"not in the model: {_few(foreign)}")
        raise ValueError(
            f"The pipeline split does not cover the model exactly once over its {num_stages} stages; parameters "
            + "; ".join(what) + ". Nothing was trained. Fix split_fn so that each of the model's parameters is in "
            "exactly one stage under its own name (fabric_learner.sharding.pipeline_split.decoder_split does so "
            "for transformers decoders)."
        )
    return stages


def _few(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
