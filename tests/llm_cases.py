"""The token-normalisation cases the LLM tests share: losses, and micro-batches of very unequal lengths.

Rank 0 feeds far more tokens than rank 1 (3x or more), each rank's two micro-batches differ in
length, and every micro-batch mixes lengths (so it is padded); the whole batch is their union.
"""

from __future__ import annotations

import functools

import torch
from tensordict import lazy_stack

from fabric_learner.testing import grpo_batch, grpo_example

#: reply lengths in words: PIECES[rank][micro-batch]
PIECES = {0: ([14, 3, 11], [9, 16]), 1: ([1, 4], [2])}
CASES = ("token_mean", "prompt_mean", "sft")
VARIANTS = ("dapo", "cispo")  # GRPO's subclasses, token_mean: checked in one process


def make_loss(case: str):
    """``(loss, policy)``, the same weights for every case and rank."""
    if case == "sft":
        from torchrl.objectives.llm import SFTLoss

        _, policy, _ = grpo_example(reply_words=(1,))
        return SFTLoss(policy, reduction="mean"), policy
    if case in VARIANTS:
        from torchrl.objectives.llm import DAPO, CISPOLoss

        _, policy, _ = grpo_example(reply_words=(1,))
        kind = DAPO if case == "dapo" else CISPOLoss
        return kind(policy, masking_strategy="rlhf", clip_epsilon=(0.2, 0.28)), policy
    loss, policy, _ = grpo_example(reply_words=(1,), aggregation=case)
    return loss, policy


def pieces(policy) -> dict[int, list]:
    """Each rank's micro-batches; the sample log-probs are the policy's own (ratios of 1)."""
    return {rank: [grpo_batch(policy, words, seed=10 * rank + i) for i, words in enumerate(micro)]
            for rank, micro in PIECES.items()}


def whole(batches: dict[int, list]):
    """The union of every rank's micro-batches: one lazy stack of all samples."""
    return lazy_stack([sample for rank in sorted(batches) for batch in batches[rank] for sample in batch.tensordicts])


def tokens(batch) -> int:
    return sum(int(mask.sum()) for mask in batch.get(("masks", "all_assistant_mask"), as_list=True))


SGD = functools.partial(torch.optim.SGD, lr=1.0)  # a step is minus the gradient: parameters compare gradients


def gradients(before: dict, after: dict) -> dict:
    return {name: before[name] - after[name] for name in before}
