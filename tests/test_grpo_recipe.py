"""The ported GRPO recipe (examples/grpo_countdown.py's recipe_learner) steps as torchrl's loop (tests/grpo_recipe.py).

One process, fp32, LocalLearner with grad_accum_steps: the first 3 updates (2 micro-batches of 2
samples each) give the recipe's weights within 1e-5 when every micro-batch holds the same number of
assistant tokens, and differ by more than 1e-3 (from the first update on) when one micro-batch holds several times the other's:
the recipe weighs micro-batches equally, the learner weighs tokens equally.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from grpo_recipe import learner_updates, pick, recipe_updates, token_counts
from multiproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))
import grpo_countdown as port

from fabric_learner import LocalLearner
from fabric_learner.testing import grpo_batch, tiny_causal_lm, tiny_tokenizer

LR = 1e-3  # the recipe's 1e-5 moves weights by about 3e-5, too little to tell 1e-5 apart
UPDATES, ACCUM = 3, 2


def _loss(seed=0):
    from torchrl.modules.llm import TransformersWrapper

    tokenizer = tiny_tokenizer()
    policy = TransformersWrapper(tiny_causal_lm(seed, tokenizer=tokenizer), tokenizer=tokenizer, input_mode="history",
                                 generate=False, return_log_probs=True, pad_output=False)
    return port.make_loss(policy), policy


@pytest.fixture(scope="module")
def pool():
    """30 scored samples (replies of 1 to 10 words, prompts of 2 to 6) and their assistant-token counts."""
    _, policy = _loss()
    samples = grpo_batch(policy, [1 + i % 10 for i in range(30)], seed=5)
    return samples, token_counts(samples)


def _micro_batches(pool, equal: bool):
    """UPDATES * ACCUM micro-batches of 2 samples: all of one count (equal) or short and long alternating."""
    samples, counts = pool
    n = UPDATES * ACCUM
    if equal:
        groups = _pairs_of_equal_sum(counts, n)
    else:
        order = sorted(range(len(counts)), key=counts.__getitem__)
        short, long = order[:n], order[-n:]
        groups = [short[j:j + 2] if j % 2 == 0 else long[j - 1:j + 1] for j in range(n)]
    batches = [pick(samples, g) for g in groups]
    tokens = [sum(counts[i] for i in g) for g in groups]
    return batches, tokens


def _pairs_of_equal_sum(counts, n):
    """``n`` disjoint pairs of samples whose token counts add up to the same total (different samples, prompts)."""
    for total in sorted({a + b for a in counts for b in counts}):
        free, pairs = set(range(len(counts))), []
        for i in range(len(counts)):
            mate = next((j for j in sorted(free) if j != i and i in free and counts[i] + counts[j] == total), None)
            if mate is not None:
                free -= {i, mate}
                pairs.append([i, mate])
        if len(pairs) >= n:
            return pairs[:n]
    raise AssertionError(f"no {n} pairs of equal token count in {counts}")


def _both(pool, equal):
    batches, tokens = _micro_batches(pool, equal)
    ref_loss, _ = _loss()
    reference = recipe_updates(ref_loss, batches, accum=ACCUM, lr=LR)
    loss, policy = _loss()
    learner = port.recipe_learner(loss, policy, lr=LR, micro_batches=ACCUM, learner_cls=LocalLearner)
    return reference, learner_updates(learner, batches), tokens, port.recipe_output_entries(loss)


def _max_diff(a, b):
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a.keys(True, True))


def test_equal_token_counts_give_the_recipes_updates(pool):
    reference, ported, tokens, k = _both(pool, equal=True)
    assert len(set(tokens)) == 1, tokens
    assert len(reference) == len(ported) == UPDATES
    assert k == 8  # loss_objective, clip_fraction, kl_approx, ESS, entropy, loss_entropy, KL to inference (2)
    start = _loss()[0]
    from tensordict import TensorDict

    moved = _max_diff(TensorDict.from_module(start), reference[-1][1])
    assert moved > 1e-3  # the weights did move
    for (ref_norm, ref_weights), (norm, weights) in zip(reference, ported):
        assert norm == pytest.approx(k * ref_norm, rel=1e-4)  # the learner's gradient is the loss terms' sum
        assert _max_diff(ref_weights, weights) < 1e-5


def test_unequal_token_counts_differ_as_the_weighting_does(pool):
    reference, ported, tokens, _ = _both(pool, equal=False)
    assert max(tokens[1::2]) >= 3 * min(tokens[0::2]), tokens  # long micro-batches hold 3x the short ones' tokens
    assert _max_diff(reference[0][1], ported[0][1]) > 1e-3  # 100x the tolerance above, from the first update on


def test_the_learners_step_is_the_token_mean_of_the_window(pool):
    """What the learner does instead: its first gradient is one token mean over the whole window."""
    batches, _ = _micro_batches(pool, equal=False)
    loss, policy = _loss()
    learner = port.recipe_learner(loss, policy, lr=LR, micro_batches=ACCUM, learner_cls=LocalLearner)
    norm = learner_updates(learner, batches[:ACCUM])[0][0]
    whole, _ = _loss()
    out = whole(pick_all(batches[:ACCUM]))
    total = sum(v for key, v in out.items() if key.startswith("loss_") and v is not None)
    grads = torch.autograd.grad(total, [p for p in whole.parameters() if p.requires_grad], allow_unused=True)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None]))
    assert norm == pytest.approx(float(expected), rel=1e-4)


def pick_all(batches):
    from tensordict import lazy_stack

    return lazy_stack([td for b in batches for td in b.tensordicts])
