"""The training side of torchrl's GRPO recipe (sota-implementations/grpo/grpo-sync.py), by hand, as a reference.

What the recipe's loop does with each micro-batch the replay buffer hands out (config
grpo_countdown.yaml / mode sync: micro-batches of optim_batch_size / gradient_accumulation_steps =
32 / 8 = 4 samples): ``loss = loss_fn(batch)``; ``(loss.mean(reduce=True) / accum).backward()``;
and every ``accum`` micro-batches ``clip_grad_norm_(params, 1.0)``, ``Adam(lr, eps=1e-5,
weight_decay=0).step()``, ``zero_grad(set_to_none=True)``. ``loss.mean(reduce=True)`` is the mean of
every entry of the loss output (its loss terms and its detached logging entries alike), and each
micro-batch's GRPO loss is a token mean over that micro-batch only: a micro-batch of few tokens
weighs as much as one of many.

Not reproduced: the recipe's step condition ``(global_step + 1) % accum == 0`` with ``global_step``
counted from 1 makes its first window ``accum - 1`` micro-batches long (each still divided by
``accum``); here every window has ``accum`` micro-batches, as the learner's do. Mixed precision and
the GradScaler (fp16 only) are left out: the comparison runs in fp32.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, lazy_stack

RECIPE_EPS = 1e-5
RECIPE_CLIP = 1.0


def recipe_updates(loss_fn, micro_batches, *, accum: int, lr: float, eps: float = RECIPE_EPS,
                   clip: float = RECIPE_CLIP, weight_decay: float = 0.0):
    """Run the recipe's loop over ``micro_batches``; ``[(grad_norm, weights after the step), ...]`` per step."""
    params = [p for p in loss_fn.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr, eps=eps, weight_decay=weight_decay)
    steps = []
    for i, batch in enumerate(micro_batches, start=1):
        out = loss_fn(batch)
        (out.mean(reduce=True) / accum).backward()
        if i % accum == 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append((float(grad_norm), TensorDict.from_module(loss_fn).clone()))
    return steps


def learner_updates(learner, micro_batches):
    """The same micro-batches through ``learner.update``; ``[(grad_norm, weights after the step), ...]`` per step."""
    steps = []
    for batch in micro_batches:
        out = learner.update(batch)
        if "grad_norm" in out.keys():
            steps.append((float(out["grad_norm"]), TensorDict.from_module(learner.loss_module).clone()))
    return steps


def token_counts(samples) -> list[int]:
    """Each sample's count of assistant tokens (what ``GRPOLoss``'s token mean divides by)."""
    return [int(mask.sum()) for mask in samples.get(("masks", "all_assistant_mask"), as_list=True)]


def pick(samples, indices) -> TensorDict:
    """The samples at ``indices``, as a lazy stack (each keeps its own length)."""
    return lazy_stack([samples.tensordicts[i] for i in indices])
