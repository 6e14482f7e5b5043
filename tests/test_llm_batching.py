"""Cutting a window by a token budget, dealing a batch over ranks by tokens, and packed rows, in one process.

The multi-rank equivalence of the token budget (DDP, FSDP; padded and packed) shares the launch of
tests/test_llm.py. Here: the cut's bounds, the balance's stated tolerance on a long-tailed law, the
packed forward against the padded one, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from fabric_learner import LocalLearner
from fabric_learner.llm import balanced_shares, micro_batches, pack_sequences, sample_lengths, update_by_tokens
from fabric_learner.llm.packing import packed_rows
from fabric_learner.step.output import as_tensordict, total_loss
from fabric_learner.testing import dqn_example, grpo_example


def long_tailed(n: int, seed: int) -> list[int]:
    """Reply lengths from a log-normal law (median 55 tokens, sigma 1), clipped to [8, 512]."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in (torch.randn(n, generator=g) + 4.0).exp().clamp(8, 512)]


def samples_of(lengths: list[int]):
    """A lazy stack of samples holding only an attention mask of each length."""
    return lazy_stack([TensorDict(masks=TensorDict(all_attention_mask=torch.ones(n, dtype=torch.bool)))
                       for n in lengths])


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_stay_within_the_budget_and_hold_every_sample_once(packed):
    lengths = long_tailed(64, seed=0)
    samples = samples_of(lengths)
    parts = micro_batches(samples, 1024, packed=packed)
    sizes = [_rows_size(sample_lengths(p)) if packed else len(p) * max(sample_lengths(p)) for p in parts]
    assert max(sizes) <= 1024
    assert sorted(n for p in parts for n in sample_lengths(p)) == sorted(lengths)
    assert all(any(s is t for t in samples.tensordicts) for p in parts for s in p.tensordicts)  # no copies
    assert len(parts) < len(lengths) // 2  # samples share micro-batches: the count follows the data
    padded = sum(sizes)
    assert 1 - sum(lengths) / padded < (0.03 if packed else 0.15), (packed, 1 - sum(lengths) / padded)


def _rows_size(lengths: list[int], crossover: float = 1024.0) -> int:
    """The tokens a packed forward runs on: its rows times their width, as the model's hook lays them out."""
    width, _, rows = packed_rows(lengths, crossover)
    return len(rows) * width


@pytest.mark.parametrize("crossover", [64.0, 1024.0, 1e6])
def test_packed_rows_stay_within_the_budget_whatever_the_attention_cost(crossover):
    # the rows micro_batches plans are among packed_rows' candidates, so the forward never runs on more
    # tokens; a sample of exactly the budget is a micro-batch of one full row
    for lengths, budget in [(long_tailed(64, seed=3), 1024), ([512, 7, 512, 300, 9, 212], 512), ([5, 5, 5], 15)]:
        parts = micro_batches(samples_of(lengths), budget, packed=True)
        sizes = [_rows_size(sample_lengths(p), crossover) for p in parts]
        assert max(sizes) <= budget, (lengths, sizes)
        assert sorted(n for p in parts for n in sample_lengths(p)) == sorted(lengths)
    # rows as wide as the longest sample left: 300 fills its micro-batch's one row, 212 opens two rows of 212
    assert [sample_lengths(p) for p in micro_batches(samples_of([512, 7, 512, 300, 9, 212]), 512, packed=True)] \
        == [[512], [512], [300], [212, 9, 7]]
    assert _rows_size([212, 9, 7], crossover) == 228  # the last micro-batch: one row trimmed to what it holds


def test_a_sample_longer_than_the_budget_is_refused_with_the_budget_to_use():
    with pytest.raises(ValueError, match="Raise max_tokens to at least 300"):
        micro_batches(samples_of([20, 300, 40]), 256)
    with pytest.raises(ValueError, match="positive integer"):
        micro_batches(samples_of([20]), 0)


def test_shares_balanced_by_tokens_stay_within_the_longest_sample_of_the_mean():
    for seed in range(5):
        lengths = long_tailed(64, seed)
        mean = sum(lengths) / 2
        shares = balanced_shares(lengths, 2)
        assert sorted(i for s in shares for i in s) == list(range(64))
        loads = [sum(lengths[i] for i in s) for s in shares]
        assert max(loads) <= mean + max(lengths)  # the stated tolerance
        by_count = [sum(lengths[:32]), sum(lengths[32:])]  # the deal by sample count it replaces
        assert max(loads) <= max(by_count)
        assert max(loads) / mean < 1.02, (seed, loads)  # measured on this law: within 2 % of the mean


@pytest.mark.parametrize("words,hooked", [((2, 30, 5, 17), "wrapper"),  # rows with tails
                                          ((40, 2, 3, 2), "model")])  # one full row, no tail; the model passed
def test_packed_rows_give_the_padded_log_probs_loss_and_gradients(words, hooked):
    loss, policy, batch = grpo_example(reply_words=words)
    padded_out = as_tensordict(loss(batch.copy()))
    params = list(policy.model.parameters())
    padded_grads = torch.autograd.grad(total_loss(padded_out), params)
    tokens = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
    mask = batch.get(("masks", "all_attention_mask"), as_padded_tensor=True, padding_side="left")
    with torch.no_grad():
        padded_lp = policy(batch.copy()).get(("log_probs", "full"), as_list=True)
        padded_logits = policy.model(tokens, mask).logits[mask.bool()]
    assert pack_sequences(policy if hooked == "wrapper" else policy.model) is policy.model
    with torch.no_grad():
        packed_lp = policy(batch.copy()).get(("log_probs", "full"), as_list=True)
        torch.testing.assert_close(policy.model(tokens, mask).logits[mask.bool()], padded_logits, atol=1e-5, rtol=1e-5)
    packed_out = as_tensordict(loss(batch.copy()))
    packed_grads = torch.autograd.grad(total_loss(packed_out), params)
    for a, b in zip(packed_lp, padded_lp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total_loss(packed_out), total_loss(padded_out), atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_grads, padded_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_packing_refuses_an_attention_implementation_that_ignores_it_before_hooking():
    loss, policy, batch = grpo_example(reply_words=(2, 9))
    policy.model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'.*set_attn_implementation\\('sdpa'\\)"):
        pack_sequences(policy)
    assert not policy.model._forward_pre_hooks and not policy.model._forward_hooks
    learner = LocalLearner(loss)
    with pytest.raises(ValueError, match="pack_sequences"):
        update_by_tokens(learner, batch, 1000, packed=True)
    assert learner.num_updates == 0


def test_a_token_budget_is_refused_for_a_loss_without_counts_and_for_an_open_window():
    loss, net, batch = dqn_example()
    with pytest.raises(ValueError, match="use learner.update"):
        update_by_tokens(LocalLearner(loss, policy=net), batch, 100)
    loss, policy, batch = grpo_example(reply_words=(2, 9))
    learner = LocalLearner(loss, grad_accum_steps=2)
    learner.update(batch)
    with pytest.raises(ValueError, match="A window is open: 1 of 2"):
        update_by_tokens(learner, batch, 1000)
    assert learner.num_updates == 0 and learner._accum_step == 1


def test_the_trainer_cuts_each_step_by_tokens_as_update_by_tokens_does():
    from fabric_learner import Trainer

    steps = []
    for by_trainer in (True, False):
        loss, policy, batch = grpo_example(reply_words=(2, 30, 5, 17))
        learner = LocalLearner(loss, lambda p: torch.optim.SGD(p, lr=0.1))
        if by_trainer:
            trainer = Trainer(learner=learner, collector=None, total_frames=0, optim_steps_per_batch=1,
                              progress_bar=False, max_tokens=150)
            trainer.optim_steps(batch)
        else:
            update_by_tokens(learner, batch, 150)
        steps.append(learner.checkpoint()["model"])
    assert len(micro_batches(batch, 150)) > 1 and learner.num_updates == 1
    for name in steps[0]:
        assert torch.equal(steps[0][name], steps[1][name]), name
    loss, net, _ = dqn_example()
    with pytest.raises(ValueError, match="Leave max_tokens=None"):
        Trainer(learner=LocalLearner(loss, policy=net), collector=None, total_frames=0, optim_steps_per_batch=1,
                progress_bar=False, max_tokens=150)
