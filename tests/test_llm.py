"""torchrl's LLM losses through the learner: token and sample means exact over micro-batches and ranks.

The oracle is one process on the whole batch. Ranks feed micro-batches of very unequal lengths
(tests/llm_cases.py); a recipe that averages per-micro-batch means (torchrl's GRPO recipe divides each
by the accumulation steps, and DDP averages ranks) must differ from it, and the learner must not. The
same launch cuts each rank's window by a token budget (``update_by_tokens``: 3 micro-batches on rank 0,
one and two of empty work on rank 1), padded and packed.
"""

from __future__ import annotations

import os

import pytest
import torch
from llm_cases import CASES, PIECES, SGD, VARIANTS, gradients, make_loss, pieces, tokens, whole
from multiproc import WORKERS, launch

from fabric_learner import LocalLearner
from fabric_learner.step.output import as_tensordict, total_loss

STRATEGIES = ("ddp", "fsdp")
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm")
    proc = launch(os.path.join(WORKERS, "llm_checks.py"), out, *STRATEGIES, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def local_step(case, feed, grad_accum_steps=1):
    """``(before, after, grad_norm)`` of LocalLearner fed ``feed(batches)``'s micro-batches (SGD, lr 1)."""
    loss, policy = make_loss(case)
    learner = LocalLearner(loss, SGD, grad_accum_steps=grad_accum_steps)
    before = {k: v.clone() for k, v in learner.checkpoint()["model"].items()}
    out = [learner.update(batch) for batch in feed(pieces(policy))]
    return before, learner.checkpoint()["model"], float(out[-1]["grad_norm"])


def recipe_gradients(case):
    """What a loop that averages per-micro-batch means computes: each mean over (micro-batches x ranks)."""
    loss, policy = make_loss(case)
    batches = [batch for micro in pieces(policy).values() for batch in micro]
    for batch in batches:
        (total_loss(as_tensordict(loss(batch))) / len(batches)).backward()
    return {f"{name}": p.grad for name, p in loss.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return {case: local_step(case, lambda b: [whole(b)]) for case in CASES + VARIANTS}


def test_the_ranks_feed_very_unequal_token_counts():
    _, policy = make_loss("token_mean")
    batches = pieces(policy)
    per_rank = {rank: sum(tokens(b) for b in micro) for rank, micro in batches.items()}
    assert per_rank[0] >= 3 * per_rank[1], per_rank
    assert tokens(batches[0][0]) != tokens(batches[0][1]) and tokens(batches[1][0]) != tokens(batches[1][1])
    assert {len(b) for micro in PIECES.values() for b in micro} != {1}  # micro-batches hold several lengths: padded


@pytest.mark.parametrize("case", CASES + VARIANTS)
def test_micro_batches_in_one_process_equal_the_whole_batch(reference, case):
    before, after, norm = local_step(case, lambda b: [batch for micro in b.values() for batch in micro], 4)
    ref_before, ref_after, ref_norm = reference[case]
    want, got = gradients(ref_before, ref_after), gradients(before, after)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    assert norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_unequal_ranks_and_micro_batches_equal_one_process_on_the_whole_batch(ranks, reference, strategy, case):
    ref_before, ref_after, ref_norm = reference[case]
    want = gradients(ref_before, ref_after)
    for rank in ranks:
        got = rank[strategy, case]
        assert got["num_updates"] == 1
        grads = gradients(got["before"], got["after"])
        for name in want:
            torch.testing.assert_close(grads[name], want[name], **TOL, msg=f"{strategy} {case} {name}")
        assert got["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for name in want:  # ranks agree bit for bit
        assert torch.equal(ranks[0][strategy, case]["after"][name], ranks[1][strategy, case]["after"][name]), name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case,cut", [(case, "budget") for case in CASES] + [("token_mean", "packed")])
def test_micro_batches_cut_by_a_token_budget_on_unequal_ranks_equal_one_process_on_the_whole_batch(
        ranks, reference, strategy, case, cut):
    ref_before, ref_after, ref_norm = reference[case]
    want = gradients(ref_before, ref_after)
    assert [rank[strategy, case, cut]["micro_batches"] for rank in ranks] == [3, 1]  # rank 1 runs 2 empty ones
    for rank in ranks:
        got = rank[strategy, case, cut]
        assert got["num_updates"] == 1
        grads = gradients(got["before"], got["after"])
        for name in want:
            torch.testing.assert_close(grads[name], want[name], **TOL, msg=f"{strategy} {case} {cut} {name}")
        assert got["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for name in want:
        assert torch.equal(ranks[0][strategy, case, cut]["after"][name], ranks[1][strategy, case, cut]["after"][name])


@pytest.mark.parametrize("case", CASES)
def test_a_token_budget_in_one_process_equals_the_whole_batch(reference, case):
    from fabric_learner.llm import micro_batches, update_by_tokens

    loss, policy = make_loss(case)
    learner = LocalLearner(loss, SGD)
    before = {k: v.clone() for k, v in learner.checkpoint()["model"].items()}
    batch = whole(pieces(policy))
    assert len(micro_batches(batch, 130)) == 4
    out = update_by_tokens(learner, batch, 130)
    ref_before, ref_after, ref_norm = reference[case]
    want, got = gradients(ref_before, ref_after), gradients(before, learner.checkpoint()["model"])
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    assert float(out["grad_norm"]) == pytest.approx(ref_norm, rel=1e-5) and learner.num_updates == 1


@pytest.mark.parametrize("case", ["token_mean", "prompt_mean"])
def test_averaging_per_micro_batch_means_differs_from_the_whole_batch(reference, case):
    """The recipe's normalisation on the same micro-batches: its gradient is not the whole batch's."""
    ref_before, ref_after, _ = reference[case]
    want = gradients(ref_before, ref_after)
    got = recipe_gradients(case)
    difference = sum(float((got[n] - want[n]).norm() ** 2) for n in got) ** 0.5
    scale = sum(float(want[n].norm() ** 2) for n in got) ** 0.5
    assert difference > 0.05 * scale, (difference, scale)


def test_per_token_aggregation_is_refused_with_the_setting_to_use():
    loss, _ = make_loss("token_mean")
    loss.aggregation = "none"
    with pytest.raises(ValueError, match="aggregation='token_mean'"):
        LocalLearner(loss)
