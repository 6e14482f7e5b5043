"""What a token-level loss needs from the learner: each micro-batch's count, summed over the window and ranks.

torchrl's LLM losses average over what their batch holds: ``GRPOLoss`` (and ``DAPO``, ``CISPOLoss``)
with ``aggregation="token_mean"`` over its masked tokens, with ``"prompt_mean"`` over its samples,
``SFTLoss(reduction="mean")`` over its samples. Averaging those means again over micro-batches and
ranks (what a hand-written loop that divides by the accumulation steps does, and what DDP's gradient
average does) weighs a token of a short micro-batch more than one of a long one.

The learner instead backpropagates each micro-batch's *sum*: its mean times the count it averaged
over, read while the loss runs (:class:`LossCount`). At the window's end the counts of its
micro-batches are summed over the data-parallel ranks (one all-reduce of one number per optimizer
step) and the gradients divided by that total (times the rank count, which undoes the ranks'
average). The step then equals one process's on the whole batch, however the tokens fall over
micro-batches and ranks. The loss is not changed and runs as it is.

One hazard: torchrl's KL terms (``loss_kl_to_ref``, ``loss_kl_to_inference``) are means over the
padded ``[batch, time]`` positions, not over the masked tokens. The learner weighs them like the
other entries (by the micro-batch's count), which equals one process only when every micro-batch has
the same ratio of tokens to padded positions; their own definition depends on the padding anyway.
"""

from __future__ import annotations

import types

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["LossCount", "loss_count"]

_COUNT = "_fabric_learner_count"  # where the hooked loss leaves the count of its last forward


class LossCount:
    """Reads what one forward of a torchrl LLM loss averaged over: its tokens or its samples.

    Built by :func:`loss_count`; ``take(batch)`` after each forward returns the count as a
    tensor (on the loss output's device, float), and ``kind`` names what is counted.

    Examples:
        >>> from fabric_learner.llm import loss_count
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example(reply_words=(3, 9))
        >>> count = loss_count(loss)
        >>> count.kind
        'tokens'
        >>> _ = loss(batch)
        >>> int(count.take(batch)) == sum(int(m.sum()) for m in batch.get(("masks", "all_assistant_mask"), as_list=True))
        True
    """

    def __init__(self, loss: nn.Module, kind: str) -> None:
        self.loss, self.kind = loss, kind
        self.muted = False  # set while a rank runs empty work (llm/batching.py): its count, hence its gradient, is 0

    def reset(self) -> None:
        """Forget a count left by a forward that was not taken (called before each of the learner's)."""
        self.loss.__dict__.pop(_COUNT, None)

    def take(self, batch: TensorDictBase) -> torch.Tensor:
        """The count of the forward just run on ``batch`` (0 while ``muted``); raises when the loss left none."""
        if self.kind == "samples":
            count = torch.tensor(float(batch.batch_size.numel()))
        else:
            count = self.loss.__dict__.pop(_COUNT, None)
        if count is None:
            raise RuntimeError(
                f"{type(self.loss).__name__} aggregated no loss entry in its last forward, so the learner cannot tell "
                "how many tokens it averaged over. Nothing was backpropagated. Check that the loss returns "
                "'loss_*' entries (e.g. loss_objective)."
            )
        return count * 0 if self.muted else count


def loss_count(loss: nn.Module) -> LossCount | None:
    """A :class:`LossCount` for torchrl's GRPO-family and SFT losses; ``None`` for any other loss.

    For ``GRPOLoss`` (``DAPO``, ``CISPOLoss``) it hooks the loss's own aggregation on this instance,
    so the count is the very mask sum the loss divided by. Raises ``ValueError`` for settings whose
    output is not a mean the learner can make exact (``aggregation="none"``, ``reduction="none"``),
    naming the setting to use.

    Examples:
        >>> from fabric_learner.llm import loss_count
        >>> from fabric_learner.testing import dqn_example, grpo_example
        >>> loss_count(dqn_example()[0]) is None
        True
        >>> loss_count(grpo_example(aggregation="prompt_mean")[0]).kind
        'samples'
    """
    try:
        from torchrl.objectives.llm import GRPOLoss, SFTLoss
    except ImportError:  # an older torchrl without the LLM losses
        return None
    if isinstance(loss, SFTLoss):
        if loss.reduction != "mean":
            raise ValueError(
                f"SFTLoss(reduction={loss.reduction!r}) is not a mean over samples, which the learner needs to make "
                "micro-batches and ranks add up to the whole batch. Build it with reduction='mean'."
            )
        return LossCount(loss, "samples")
    if not isinstance(loss, GRPOLoss):
        return None
    aggregation = loss.aggregation
    if aggregation not in ("token_mean", "prompt_mean") or getattr(loss, "reduction", "mean") == "none":
        raise ValueError(
            f"{type(loss).__name__}(aggregation={aggregation!r}, reduction={getattr(loss, 'reduction', None)!r}) "
            "returns per-token losses, but the learner needs a scalar to backpropagate. Build it with "
            "aggregation='token_mean' (every token weighs the same) or 'prompt_mean' (every sample does)."
        )
    if not isinstance(loss.__dict__.get("_aggregate_loss_value"), types.MethodType):
        loss._aggregate_loss_value = types.MethodType(_counting_aggregate, loss)
    return LossCount(loss, "tokens" if aggregation == "token_mean" else "samples")


def _counting_aggregate(loss, value: torch.Tensor, mask: torch.Tensor, tensordict=None) -> torch.Tensor:
    """``GRPOLoss._aggregate_loss_value``, leaving the count it divides by on the loss (once per forward).

    For ``"token_mean"`` that is the mask sum ``LossModule._reduce_loss`` divides by: the loss's mask
    and, where the batch holds them, its loss-mask entries (``("collector", "mask")``, ...).
    """
    if _COUNT not in loss.__dict__:
        if loss.aggregation == "token_mean":
            from tensordict.utils import expand_as_right

            combined = expand_as_right(mask, value)
            for key in (loss._loss_mask_keys() if tensordict is not None else ()):
                extra = tensordict.get(key, default=None)
                if extra is not None:
                    combined = combined & loss._expand_loss_mask(extra, value)
            count = combined.sum()
        else:
            count = value.shape[0]
        loss.__dict__[_COUNT] = torch.as_tensor(count, dtype=value.dtype, device=value.device).detach()
    return type(loss)._aggregate_loss_value(loss, value, mask, tensordict=tensordict)
