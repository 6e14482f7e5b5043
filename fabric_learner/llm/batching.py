"""Micro-batches cut by a token budget, and a global batch dealt over ranks by token count.

RL batches of language-model samples are long-tailed: most replies are short, a few long. Cut into
micro-batches of a fixed number of samples, each padded to its longest sample, most of the compute
runs on pad tokens. Here a window's samples are sorted by length and cut so that each micro-batch's
padded size (samples x longest, or with packing its rows x their width) stays within ``max_tokens``; the
number of micro-batches then follows the data. The step stays exact whatever the cut: the learner
backpropagates each micro-batch's token (or sample) sum and divides by the window's total over the
ranks (``counts.py``).

Under FSDP every data-parallel rank must run the same number of forwards and backwards (each is a
collective): :func:`update_by_tokens` agrees on the largest count over the ranks (one all-reduce of
one number) and a rank with fewer micro-batches runs its shortest sample as empty work, whose count,
hence its gradient, is zero.

A sample's length is the sum of its attention mask (``("masks", "all_attention_mask")``, what
torchrl's ``TransformersWrapper`` writes), the tokens the model reads for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase, lazy_stack

__all__ = ["balanced_shares", "micro_batches", "sample_lengths", "share_of_rank", "update_by_tokens"]

LENGTH_KEY = ("masks", "all_attention_mask")
PACKED = "_fabric_learner_packed"  # set on a model whose forward packs its rows (packing.py)


def sample_lengths(samples: TensorDictBase, key=LENGTH_KEY) -> list[int]:
    """Each sample's length in tokens: the sum of its ``key`` mask (a lazy stack's samples may differ in length).

    Examples:
        >>> from fabric_learner.llm import sample_lengths
        >>> from fabric_learner.testing import grpo_example
        >>> _, _, batch = grpo_example(reply_words=(3, 9))
        >>> [n == t.numel() for n, t in zip(sample_lengths(batch), batch.get(("tokens", "full"), as_list=True))]
        [True, True]
    """
    if not isinstance(samples, TensorDictBase) or samples.batch_dims != 1:
        raise TypeError(f"samples must be a TensorDict (or lazy stack) with one batch dimension, got "
                        f"{type(samples).__name__}{'' if not isinstance(samples, TensorDictBase) else samples.batch_size}.")
    try:
        masks = samples.get(key, as_list=True)
    except KeyError:
        masks = None
    if masks is None:
        raise KeyError(f"The samples lack {key!r}, the mask whose sum is a sample's length; nothing was cut. Pass "
                       "samples as torchrl's TransformersWrapper writes them, or name the mask with key=.")
    return [int(mask.sum()) for mask in masks]


def micro_batches(samples: TensorDictBase, max_tokens: int, *, packed: bool = False,
                  key=LENGTH_KEY) -> list[TensorDictBase]:
    """``samples`` cut into micro-batches whose size in tokens stays within ``max_tokens``.

    Padded, a micro-batch's size is its sample count times its longest sample: the samples are
    sorted by length and cut into runs within the budget, the cut that minimises the pad tokens
    plus one average sample per micro-batch (what one more forward and backward costs).
    ``packed`` (several samples in one row, see :func:`pack_sequences`), its size is its rows times
    their width: rows as wide as the longest sample left, as many as ``max_tokens`` holds, filled
    best fit, longest first, the packed forward's own rows (the last micro-batch's trimmed to what
    it holds). Every sample lands in exactly one micro-batch (a lazy stack
    of the samples themselves, not copies).

    Args:
        samples: a window's samples, one batch dimension (typically a lazy stack of any lengths).
        max_tokens (int): the largest size of one micro-batch, in tokens.

    Keyword Args:
        packed (bool): size micro-batches as packed rows (rows x width) instead of padded ones.
        key: the mask whose sum is a sample's length.

    Raises:
        ValueError: ``max_tokens`` is not a positive integer, or a sample is longer than it (named,
            with the budget to use); nothing is cut.

    Examples:
        >>> from fabric_learner.llm import micro_batches, sample_lengths
        >>> from fabric_learner.testing import grpo_example
        >>> _, _, batch = grpo_example(reply_words=(2, 30, 3, 28, 2))
        >>> lengths = sample_lengths(batch)
        >>> parts = micro_batches(batch, max_tokens=2 * max(lengths))
        >>> [len(part) for part in parts], sum(len(p) for p in parts) == len(batch)
        ([2, 3], True)
        >>> all(len(p) * max(sample_lengths(p)) <= 2 * max(lengths) for p in parts)
        True
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer (tokens per micro-batch), got {max_tokens!r}.")
    lengths = sample_lengths(samples, key)
    if not lengths:
        raise ValueError("samples holds no sample; nothing was cut. Pass at least one sample per rank and window.")
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > max_tokens:
        raise ValueError(f"Sample {longest} holds {lengths[longest]} tokens, more than max_tokens={max_tokens}; "
                         f"nothing was cut. Raise max_tokens to at least {lengths[longest]}, or drop or truncate "
                         "such samples before the update.")
    return [_select(samples, group) for group in _groups(lengths, max_tokens, packed)]


def _groups(lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Sample indices in micro-batches within ``max_tokens``, trading pad tokens against micro-batches.

    Padded: the samples sorted longest first and cut into runs (a run's size is its sample count
    times its first sample's length), the cut of least cost found by dynamic programming, a
    micro-batch costing its padded size plus one average sample (the fixed cost of one more forward
    and backward, and under FSDP of gathering the weights again). Packed: rows as wide as the
    longest sample left, as many as ``max_tokens`` holds, filled best fit longest first
    (:func:`fill_rows`); the samples that fit make the micro-batch, the rest go on to the next.
    ``packed_rows`` finds these rows (or cheaper ones, never more tokens) for the micro-batch's
    lengths alone, so its forward stays within ``max_tokens`` too.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        groups = []
        while order:  # one micro-batch: rows as wide as the longest sample left, as many as the budget holds
            width = lengths[order[0]]
            rows, _ = fill_rows([lengths[i] for i in order], width, max_rows=max_tokens // width)
            groups.append([i for i, row in zip(order, rows) if row is not None])
            order = [i for i, row in zip(order, rows) if row is None]
        return groups
    sorted_lengths = [lengths[i] for i in order]
    overhead = sum(lengths) / len(lengths)  # what one more micro-batch costs: one average sample
    best = [0.0] + [float("inf")] * len(order)  # best[j]: the least cost of the first j sorted samples
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):  # the run order[i:j], padded to sorted_lengths[i]
            size = (j - i) * sorted_lengths[i]
            if size > max_tokens:
                break  # longer runs only grow
            if best[i] + size + overhead < best[j]:
                best[j], cut[j] = best[i] + size + overhead, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def fill_rows(lengths: Sequence[int], width: int, max_rows: int | None = None) -> tuple[list[int | None], list[int]]:
    """Best fit in the given order: each length into the fullest row it fits, else a new row.

    Returns each length's row (``None``: no room within ``max_rows`` rows) and each row's used width.
    Rows open in order, so with ``max_rows`` the fill of the lengths that found a row is exactly the
    fill of those lengths alone without it (what lets :func:`packed_rows` find a micro-batch's rows).
    """
    used: list[int] = []
    place: list[int | None] = []
    for n in lengths:
        row = max((r for r in range(len(used)) if used[r] + n <= width), key=used.__getitem__, default=None)
        if row is None and n <= width and (max_rows is None or len(used) < max_rows):
            row = len(used)
            used.append(0)
        if row is not None:
            used[row] += n
        place.append(row)
    return place, used


def update_by_tokens(learner, samples: TensorDictBase, max_tokens: int, *, packed: bool = False,
                     key=LENGTH_KEY) -> TensorDictBase:
    """One optimizer step on this rank's window ``samples``, cut by :func:`micro_batches`; every rank calls it.

    The number of micro-batches is agreed over the data-parallel ranks (the largest, one all-reduce);
    a rank with fewer runs its shortest sample as empty work, weighted zero. The step equals one
    process's on all ranks' samples (the learner's token or sample normalisation, ``counts.py``),
    for any ``max_tokens``. Works with torchrl's GRPO-family and SFT losses only: any other loss's
    step would depend on how the window is cut.

    Args:
        learner (Learner): the learner, built over a GRPO-family or SFT loss, with no window open.
        samples: this rank's samples for one optimizer step (see :func:`micro_batches`).
        max_tokens (int): the largest micro-batch, in tokens.

    Keyword Args:
        packed (bool): micro-batches sized as packed rows; the loss's model must pack them
            (:func:`pack_sequences`).
        key: the mask whose sum is a sample's length.

    Returns:
        The loss output of this rank's last micro-batch, with the step's ``"grad_norm"``.

    Raises:
        ValueError: a loss without token or sample counts, a window left open by ``update`` calls,
            ``packed`` without a packing model, or what :func:`micro_batches` refuses; nothing changed.

    Examples:
        >>> import torch
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm import update_by_tokens
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example(reply_words=(2, 30, 3, 28, 2))
        >>> learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1), policy=policy)
        >>> out = update_by_tokens(learner, batch, max_tokens=200)
        >>> learner.num_updates, "grad_norm" in out.keys()
        (1, True)
    """
    counts = getattr(learner, "_counts", None)
    if counts is None:
        raise ValueError(f"update_by_tokens needs a loss the learner normalises by its token or sample count "
                         f"(torchrl's GRPOLoss, DAPO, CISPOLoss, SFTLoss); {type(learner.loss_module).__name__}'s "
                         "step would depend on how the window is cut. Nothing changed; use learner.update.")
    if learner._accum_step:
        raise ValueError(f"A window is open: {learner._accum_step} of {learner.grad_accum_steps} micro-batches were "
                         "fed through update(). Nothing changed; finish that window before update_by_tokens.")
    if packed and not any(getattr(m, PACKED, False) for m in learner.loss_module.modules()):
        raise ValueError("packed=True sizes micro-batches as packed rows, but the loss's model does not pack them; "
                         "nothing changed. Call fabric_learner.llm.pack_sequences(policy) first, or drop packed=True.")
    parts = micro_batches(samples, max_tokens, packed=packed, key=key)
    steps = len(parts)
    if learner.world_size > 1:
        from fabric_learner.collectives import all_reduce

        steps = int(all_reduce(torch.tensor([steps]), "max").item())
    idle = _select(samples, [min(range(len(samples)), key=sample_lengths(samples, key).__getitem__)])
    accum, last = learner.grad_accum_steps, None
    learner.grad_accum_steps = steps
    try:
        for i in range(steps):
            counts.muted = i >= len(parts)
            out = learner.update(parts[i] if i < len(parts) else idle)
            if i < len(parts):
                last = out
    finally:
        counts.muted = False
        learner.grad_accum_steps = accum
        if learner._accum_step:  # a micro-batch failed mid-window: drop its gradients, as update would
            learner._abandon_window()
    if out is not last and "grad_norm" in out.keys():
        last.set("grad_norm", out["grad_norm"])
    return last


def balanced_shares(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Sample indices for each of ``ranks`` ranks, balanced by tokens: longest first, each to the lightest rank.

    Guarantee (the greedy's): the heaviest share holds at most the mean share plus the longest
    sample, since the share that took its last sample was then the lightest, at or under the mean.
    Each share lists its indices in increasing order; every index is in exactly one share.

    Examples:
        >>> from fabric_learner.llm import balanced_shares
        >>> lengths = [400, 30, 25, 20, 380, 35, 15, 40]
        >>> shares = balanced_shares(lengths, 2)
        >>> [sum(lengths[i] for i in share) for share in shares]
        [475, 470]
        >>> sorted(i for share in shares for i in share) == list(range(len(lengths)))
        True
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}.")
    heap = [(0, r) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(share) for share in shares]


def share_of_rank(samples: TensorDictBase, rank: int, ranks: int, *, key=LENGTH_KEY) -> TensorDictBase:
    """Rank ``rank``'s part of a global batch dealt by :func:`balanced_shares`; every rank gets the same ``samples``.

    The partition depends on the lengths only, so every rank computes the same one without communicating.

    Examples:
        >>> from fabric_learner.llm import sample_lengths, share_of_rank
        >>> from fabric_learner.testing import grpo_example
        >>> _, _, batch = grpo_example(reply_words=(30, 28, 2, 3))
        >>> halves = [sum(sample_lengths(batch[:2])), sum(sample_lengths(batch[2:]))]  # by sample count
        >>> dealt = [sum(sample_lengths(share_of_rank(batch, r, 2))) for r in (0, 1)]  # by tokens
        >>> max(dealt) < max(halves), sum(dealt) == sum(halves)
        (True, True)
    """
    shares = balanced_shares(sample_lengths(samples, key), ranks)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank!r}.")
    if not shares[rank]:
        raise ValueError(f"{len(samples)} samples leave rank {rank} of {ranks} without one; deal at least one "
                         "sample per rank.")
    return _select(samples, shares[rank])


def _select(samples: TensorDictBase, indices: list[int]) -> TensorDictBase:
    """The samples at ``indices`` as a lazy stack of the samples themselves (no padding, no copy)."""
    members = getattr(samples, "tensordicts", None)
    if members is not None and samples.stack_dim == 0:
        return lazy_stack([members[i] for i in indices])
    return samples[torch.tensor(indices)]
