"""Prioritized replay: torchrl's sampler where its extension loads, the plain-torch one otherwise, sampling alike."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler

from fabric_learner.replay import TorchPrioritizedSampler, prioritized_sampler, torchrl_extension_error

ALPHA, BETA, N = 0.7, 0.5, 32


def _filled(sampler):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(N), sampler=sampler, priority_key="td_error", batch_size=8)
    index = rb.extend(TensorDict({"x": torch.arange(N, dtype=torch.float32)}, [N]))
    priorities = torch.linspace(0.1, 3.0, N)
    rb.update_priority(index, priorities)
    return rb, priorities


def test_the_sampler_is_torchrls_own_where_its_extension_loads_else_the_torch_one():
    sampler = prioritized_sampler(N, alpha=ALPHA, beta=BETA)
    error = torchrl_extension_error()
    if error is None:
        assert type(sampler) is PrioritizedSampler
    else:
        assert type(sampler) is TorchPrioritizedSampler and error  # the reason is kept for the user to read


def test_the_torch_sampler_draws_in_proportion_to_priority_and_weighs_like_torchrl():
    torch.manual_seed(0)
    rb, priorities = _filled(TorchPrioritizedSampler(N, alpha=ALPHA, beta=BETA))
    mass = (priorities + 1e-8) ** ALPHA
    probs = mass / mass.sum()
    counts = torch.zeros(N)
    for _ in range(2000):
        batch = rb.sample()
        idx = batch["index"]
        counts += torch.bincount(idx, minlength=N)
        # importance weights: (N p_i)^-beta, normalised by the largest one (that of the rarest entry)
        expected = (probs[idx] * N) ** -BETA / (probs.min() * N) ** -BETA
        torch.testing.assert_close(batch["priority_weight"], expected.to(batch["priority_weight"].dtype),
                                   rtol=1e-4, atol=1e-6)
    freq = counts / counts.sum()
    assert (freq - probs).abs().max() < 0.01, (freq - probs).abs().max()


def test_the_torch_sampler_equals_torchrls_draw_for_draw_where_torchrls_loads():
    error = torchrl_extension_error()
    if error is not None:
        pytest.skip(f"torchrl's C++ extension does not load in this install ({error[:120]}); nothing to compare with")
    draws = []
    for sampler in (PrioritizedSampler(N, ALPHA, BETA), TorchPrioritizedSampler(N, ALPHA, BETA)):
        torch.manual_seed(0)
        rb, _ = _filled(sampler)
        draws.append([rb.sample() for _ in range(20)])
    for a, b in zip(*draws):
        assert torch.equal(a["index"], b["index"])
        torch.testing.assert_close(a["priority_weight"], b["priority_weight"])
