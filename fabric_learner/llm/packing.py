"""Packed sequences: a micro-batch's samples share rows with no padding between them, each attending only to itself.

torchrl's ``TransformersWrapper`` hands the model a padded batch (``input_ids``, ``attention_mask``).
:func:`pack_sequences` hooks the model so that such a call runs as rows at least the longest sample
wide (:func:`packed_rows`), each holding several samples' tokens back to back (best fit, longest first), with
``position_ids`` restarting at 0 for each sample and no attention mask:
transformers then builds a block-diagonal causal mask from the positions (``masking_utils``: the
packed-sequence format, read only without a cache), and the logits are put back in the padded layout
the wrapper reads. Log-probs, loss and gradients equal the padded forward's (tested within 1e-5, fp32).

Which attention implementations honour the restarting positions was checked, not assumed
(transformers 5.25, CPU, Qwen2): ``"eager"`` and ``"sdpa"`` do (log-probs equal to a per-sample
forward within 1e-6); ``"flex_attention"`` builds the mask too but has no backward on CPU. torchrl's
own packing (``TransformersWrapper(pad_model_input=False)``) passes a block-diagonal mask that is not
causal, and its log-probs differ from the padded forward's (by several nats on the tiny Qwen2 here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fabric_learner.llm.batching import PACKED, fill_rows

__all__ = ["PACKING_ATTENTION", "attention_crossover", "pack_sequences", "packed_rows"]

CROSSOVER = 1024.0  # attention_crossover's answer for a config that does not give the sizes

#: the attention implementations that honour packed rows, by device type (others are refused by name)
PACKING_ATTENTION = {"cpu": ("eager", "sdpa"), "cuda": ("eager", "sdpa")}
_LAYOUT = "_fabric_learner_packed_layout"  # the padded layout of the call in flight, for the output hook


def pack_sequences(policy: nn.Module) -> nn.Module:
    """Make ``policy``'s transformers model run each padded batch as packed rows; returns the model.

    ``policy`` is torchrl's ``TransformersWrapper`` (its ``.model`` is hooked) or the transformers
    model itself. Only calls with a 2-D attention mask and no cache are packed (the learner's and the
    reference's forwards); generation runs as before. Parameters and their names do not change, so
    sharding, checkpoints and weights by name are unaffected. Memory: the logits are returned in the
    padded layout (``[batch, longest, vocabulary]``), as the wrapper and torchrl's losses read them
    (GRPO's ``"rlhf"`` masking builds its distribution from them), so they grow with a micro-batch's
    samples x longest, not with its tokens.

    Raises:
        ValueError: an attention implementation that does not honour packed rows on the model's
            device (named, with the setting to use), before anything is hooked.

    Examples:
        >>> import torch
        >>> from fabric_learner.llm import pack_sequences
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example(reply_words=(2, 30, 5))
        >>> padded = [lp.clone() for lp in batch.get(("log_probs", "full"), as_list=True)]
        >>> model = pack_sequences(policy)
        >>> with torch.no_grad():
        ...     packed = policy(batch.copy()).get(("log_probs", "full"), as_list=True)
        >>> max(float((a - b).abs().max()) for a, b in zip(packed, padded)) < 1e-5
        True
    """
    model = policy if hasattr(policy, "config") else getattr(policy, "model", None)  # a causal LM has .model too
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"pack_sequences takes torchrl's TransformersWrapper or a transformers model, got "
                        f"{type(policy).__name__}.")
    implementation = getattr(model.config, "_attn_implementation", None)
    device = next(model.parameters()).device.type
    allowed = PACKING_ATTENTION.get(device, ())
    if implementation not in allowed:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={implementation!r}, which is not known to honour "
            f"packed rows (position_ids restarting per sample) with a backward on {device}; nothing was changed. "
            f"Use one of {allowed or PACKING_ATTENTION['cpu']}: model.set_attn_implementation('sdpa'), or "
            "from_pretrained(..., attn_implementation='sdpa'); or train without packing (packed=False).")
    if not getattr(model, PACKED, False):
        model.register_forward_pre_hook(_pack, with_kwargs=True)
        model.register_forward_hook(_unpack, with_kwargs=True)
        object.__setattr__(model, PACKED, attention_crossover(model.config))  # truthy: packs
    return model


def _pack(model: nn.Module, args: tuple, kwargs: dict[str, Any]):
    """A padded call ``(input_ids, attention_mask)`` as packed rows (:func:`packed_rows`).

    Positions restart at 0 for each sample, and a row's unused tail is a block of its own whose
    logits are dropped.
    """
    names = ("input_ids", "attention_mask")
    given = dict(zip(names, args))
    if len(args) > 2 or any(n in kwargs for n in given):
        return None
    input_ids, mask = given.get("input_ids", kwargs.get("input_ids")), given.get("attention_mask",
                                                                                  kwargs.get("attention_mask"))
    if (input_ids is None or mask is None or mask.dim() != 2 or kwargs.get("position_ids") is not None
            or kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None):
        return None  # generation, or a call that sets its own positions: as it is
    keep = mask.bool()
    lengths = keep.sum(-1).tolist()
    width, place, rows = packed_rows(lengths, getattr(model, PACKED))
    ids = input_ids.new_zeros(len(rows), width)
    positions = torch.arange(width, device=input_ids.device).repeat(len(rows), 1)
    source = []  # for each real token, in the padded layout's order: its index in the packed rows
    for i, n in enumerate(lengths):
        row, start = place[i]
        ids[row, start:start + n] = input_ids[i][keep[i]]
        positions[row, start:start + n] = torch.arange(n, device=input_ids.device)
        source.append(row * width + start + torch.arange(n, device=input_ids.device))
    for row, used in enumerate(rows):  # the tail: positions restart, a block of its own
        positions[row, used:] = torch.arange(width - used, device=input_ids.device)
    model.__dict__[_LAYOUT] = (keep, torch.cat(source))
    packed = {k: v for k, v in kwargs.items() if k not in names}
    packed.update(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False)
    return (), packed


def packed_rows(lengths: list[int], crossover: float = CROSSOVER) -> tuple[int, dict[int, tuple[int, int]], list[int]]:
    """Rows for ``lengths``: ``(width, {sample: (row, start)}, [each row's used width])``.

    Samples go longest first into the fullest row with room (best fit, :func:`fill_rows`). The width,
    at least the longest sample, is the one of least cost, a row of width ``w`` costing
    ``w * (1 + w / crossover)``: its tokens through the layers, plus its attention, which the dense
    block mask makes grow with the square of the row (``crossover``: the width at which the two are
    equal, :func:`attention_crossover`). The rows hold at most the tokens of the rows that
    ``micro_batches(..., packed=True)`` planned (those rows at the longest sample's width are among
    the candidates, and a wider layout of no more cost has fewer tokens), so a micro-batch's forward
    stays within ``max_tokens``; the last micro-batch's rows shrink to what it holds.

    Examples:
        >>> from fabric_learner.llm.packing import packed_rows
        >>> width, starts, used = packed_rows([100, 300, 200])  # two full rows: no tail
        >>> width, used, starts[0]
        (300, [300, 300], (1, 200))
        >>> packed_rows([212, 9, 7])[::2]  # one row is cheaper than two rows of 212
        (228, [228])
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ordered = [lengths[i] for i in order]
    total = sum(ordered)
    best, best_cost, width = None, float("inf"), ordered[0]
    while width <= total and total * (1 + width / crossover) < best_cost:  # no wider layout can cost less
        place, used = fill_rows(ordered, width)
        cost = len(used) * width * (1 + width / crossover)
        if cost < best_cost:
            best, best_cost = (width, place, used), cost
        if len(used) == 1:
            break
        width = max(width + 1, -(-total // (len(used) - 1)))  # narrower than this, no fewer rows fit
    width, place, used = best
    starts, filled = {}, [0] * len(used)
    for i, row in zip(order, place):
        starts[i] = (row, filled[row])
        filled[row] += lengths[i]
    return width, starts, used


def attention_crossover(config) -> float:
    """The row width at which a packed row's attention costs as much as the rest of its decoder layers.

    Per token and layer, the projections and the MLP multiply ``hidden x (q + k + v + o widths) +
    3 x hidden x intermediate``, and attention over a row of width ``w`` multiplies ``2 x heads x
    head_dim x w`` (scores and values; the mask is dense). :data:`CROSSOVER` for a config without
    these sizes.

    Examples:
        >>> from transformers import Qwen2Config
        >>> from fabric_learner.llm.packing import attention_crossover
        >>> attention_crossover(Qwen2Config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
        ...                                 num_key_value_heads=2))
        1152.0
    """
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    inter = getattr(config, "intermediate_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads, inter)):
        return CROSSOVER
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    linear = hidden * (2 * heads * head_dim + 2 * kv * head_dim) + 3 * hidden * inter
    return linear / (2 * heads * head_dim)


def _unpack(model: nn.Module, args: tuple, kwargs: dict[str, Any], output):
    """The packed rows' logits back in the padded layout (zeros at pads, which the wrapper masks out)."""
    layout = model.__dict__.pop(_LAYOUT, None)
    if layout is None:
        return None
    keep, source = layout
    logits = output.logits
    padded = logits.new_zeros(*keep.shape, logits.shape[-1])
    padded[keep] = logits.reshape(-1, logits.shape[-1])[source]
    output["logits"] = padded
    return output
