"""Learner.update_minibatches: many updates in one call, equal to the loop a script writes around update().

One process here (the ranks' loop is the same code: tests/test_remote_learner.py runs it on two Ray ranks
against this learner); SGD, so a wrong partition, scale or order shows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from rl_cases import make_batch, make_loss

from fabric_learner import LocalLearner
from fabric_learner.onpolicy import normalize_advantage, partition_indices

SGD = functools.partial(torch.optim.SGD, lr=0.1)
TOL = {"atol": 1e-6, "rtol": 1e-6}


def pair(case="ppo", **kwargs):
    return [LocalLearner(make_loss(case)[0], SGD, **kwargs) for _ in range(2)]


def test_epochs_of_seeded_partitions_with_standardised_advantages_equal_the_hand_written_loop():
    mine, theirs = pair()
    batch = make_batch("ppo", n=20, seed=3)
    got = mine.update_minibatches(batch.clone(), 8, epochs=3, seed=11, normalize_advantage=True)
    generator, want = torch.Generator().manual_seed(11), []
    for _ in range(3):
        for index in partition_indices(20, 8, generator=generator):  # 2 of 8 a epoch; 4 samples left out
            minibatch = batch[index]
            normalize_advantage(minibatch)
            want.append(theirs.update(minibatch))
    assert got.batch_size == (6,) and mine.num_updates == theirs.num_updates == 6
    for key in ("loss_objective", "loss_critic", "grad_norm"):
        torch.testing.assert_close(got[key], torch.stack([w[key] for w in want]), **TOL)
    for k, v in theirs.loss_module.state_dict().items():
        torch.testing.assert_close(mine.loss_module.state_dict()[k], v, **TOL)


def test_in_order_minibatches_are_k_updates_and_each_td_error_lands_at_its_rows():
    mine, theirs = pair("dqn")
    samples = [make_batch("dqn", n=8, seed=20 + k) for k in range(3)]
    batch = torch.cat(samples)
    got = mine.update_minibatches(batch, 8, shuffle=False)
    want = [theirs.update(sample) for sample in samples]
    torch.testing.assert_close(got["loss"], torch.stack([w["loss"] for w in want]), **TOL)
    torch.testing.assert_close(batch["td_error"], torch.cat([s["td_error"] for s in samples]), **TOL)


def test_with_accumulation_each_minibatch_is_one_step_of_equal_micro_batches():
    mine, theirs = pair(grad_accum_steps=2)
    batch = make_batch("ppo", n=16, seed=4)
    got = mine.update_minibatches(batch, 8, shuffle=False, epochs=2)
    want = []
    for _ in range(2):
        for minibatch in batch.split(8):
            outs = [theirs.update(micro) for micro in minibatch.split(4)]
            want.append((outs[0]["loss_objective"] + outs[1]["loss_objective"]) / 2)
            assert "grad_norm" in outs[1].keys()
    assert mine.num_updates == 4
    torch.testing.assert_close(got["loss_objective"], torch.stack(want), **TOL)
    assert "grad_norm" in got.keys()


def test_bad_arguments_are_refused_before_any_update():
    learner = LocalLearner(make_loss("ppo")[0], SGD, grad_accum_steps=2)
    batch = make_batch("ppo", n=16)
    before = {k: v.clone() for k, v in learner.loss_module.state_dict().items()}
    cases = [({"minibatch_size": 0}, ValueError, "minibatch_size must be an integer >= 1"),
             ({"minibatch_size": 8, "epochs": 0}, ValueError, "epochs must be"),
             ({"minibatch_size": 32}, ValueError, "fewer than one minibatch"),
             ({"minibatch_size": 5}, ValueError, "must divide by it"),
             ({"minibatch_size": 8, "normalize_advantage": "adv"}, KeyError, "lacks"),
             ({"minibatch_size": 8, "seed": 1.5}, TypeError, "seed must be")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            learner.update_minibatches(batch, **kwargs)
    with pytest.raises(ValueError, match="reshape"):
        learner.update_minibatches(batch.reshape(4, 4), 4)
    learner.update(batch[:4])
    with pytest.raises(ValueError, match="window's start"):
        learner.update_minibatches(batch, 8)
    assert learner.num_updates == 0
    for k, v in learner.loss_module.state_dict().items():
        assert torch.equal(v, before[k]), k
