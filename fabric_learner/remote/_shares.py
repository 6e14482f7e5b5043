"""How ``RemoteLearner`` cuts one global batch into one share per rank.

A plain TensorDict is cut into equal, contiguous shares: the ranks' averaged gradients then equal
one process's on the whole batch for any loss that means over its samples. A lazy stack of samples
of different lengths (a language model's batch) is dealt by token count instead: torchrl's LLM losses
are normalised by the window's token count over all ranks (``fabric_learner.llm``), so shares may
hold different numbers of samples, and balancing tokens balances the ranks' work.

The partition is the token-budget batching's own (``fabric_learner.llm.balanced_shares``): the
controller deals a global batch as the SPMD ranks deal theirs.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, lazy_stack

TOKEN_MASKS = (("masks", "all_attention_mask"), ("masks", "all_assistant_mask"))


def split(batch: TensorDictBase, ranks: int) -> tuple[list[TensorDictBase], list[list[int]] | None]:
    """``ranks`` shares of ``batch``: views of its tensors (``remote._wire`` copies out just their elements).

    Returns the shares and, for balanced lazy stacks, the sample indices each share holds
    (``None`` for contiguous equal shares). Raises ``ValueError`` (nothing sent) when a plain batch
    does not divide evenly or holds fewer samples than ranks.
    """
    if not isinstance(batch, TensorDictBase):
        raise TypeError(f"update() takes a TensorDict batch, got {type(batch).__name__}.")
    if batch.batch_dims == 0:
        raise ValueError("update() needs a batch with a leading batch dimension to split over the ranks; got batch_size [].")
    n = batch.batch_size[0]
    if n < ranks:
        raise ValueError(f"The batch holds {n} samples for {ranks} learner ranks: every rank needs at least one. "
                         "Nothing was sent. Give a larger batch or fewer num_learners.")
    if isinstance(batch, LazyStackedTensorDict) and batch.stack_dim == 0 and _ragged(batch):
        groups = balanced_shares(sample_tokens(batch), ranks)
        return [lazy_stack([batch.tensordicts[i] for i in g]) for g in groups], groups
    if n % ranks:
        raise ValueError(
            f"The batch's {n} samples do not split into {ranks} equal shares, and unequal shares would weigh the "
            "samples of the smaller ones more than one process does. Nothing was sent. Give a batch size divisible "
            f"by num_learners={ranks}.")
    return list(batch.split(n // ranks)), None


def _ragged(batch: LazyStackedTensorDict) -> bool:
    """Whether the samples' attention masks differ in length (a language model's unpadded batch). A stack
    without them (a replay buffer's samples) is cut into equal shares like a plain batch."""
    try:
        batch.get(TOKEN_MASKS[0], None)
    except (RuntimeError, ValueError):  # they cannot be stacked
        return True
    return False


def sample_tokens(batch: LazyStackedTensorDict) -> list[int]:
    """Each sample's token count: its attention (or assistant) mask's sum, else its largest entry's size."""
    for key in TOKEN_MASKS:
        try:
            masks = batch.get(key, as_list=True)
        except (KeyError, RuntimeError):
            continue
        return [int(m.sum()) for m in masks]
    return [max((t.numel() for t in td.values(True, True) if isinstance(t, torch.Tensor)), default=1)
            for td in batch.tensordicts]


def balanced_shares(costs: list[int], ranks: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens (``fabric_learner.llm.balanced_shares``); a sample
    of no tokens counts as one, so that with at least as many samples as ranks every rank gets one."""
    from fabric_learner.llm.batching import balanced_shares as by_tokens

    return by_tokens([max(c, 1) for c in costs], ranks)
