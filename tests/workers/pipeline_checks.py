"""Pipeline parallelism (2 stages on 2 gloo ranks) for torchrl's LLM losses, in one launch (tests/test_pipeline.py).

Usage: python pipeline_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt: per case, this stage's parameters after STEPS SGD steps (lr 1, clipping that bites),
the learner's outputs, and the faults' messages. Every rank passes the whole batch (the stages share it).
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from fabric_learner import FabricLearner
from fabric_learner.pipeline import PipelineStrategy
from fabric_learner.testing import grpo_batch, grpo_example

TIMEOUT = timedelta(seconds=60)
REPLIES = (3, 9, 5, 2, 12, 4, 7)  # 7 samples of unequal lengths: micro-batches of unequal token counts
STEPS = 2
CLIP = 0.05  # below every step's gradient norm (checked in the test): clipping bites
# case: (loss, schedule, micro-batches, scale_grads)
CASES = {
    "grpo": ("grpo", "1F1B", 3, False),
    "sft": ("sft", "GPipe", 2, False),
    "grpo_scaled": ("grpo", "1F1B", 3, True),
}


def sgd():
    return functools.partial(torch.optim.SGD, lr=1.0)


def build(kind):
    """``(loss, policy)``: GRPO (token mean) or SFT on the tiny Qwen2 (2 decoder layers), seed 0."""
    from torchrl.objectives.llm import SFTLoss

    loss, policy, _ = grpo_example(REPLIES)
    if kind == "sft":
        return SFTLoss(policy, reduction="mean"), policy
    return loss, policy


def batches(policy):
    """The STEPS batches, built from the initial policy (before any split)."""
    return [grpo_batch(policy, list(REPLIES), seed=step) for step in range(STEPS)]


def train(learner, data):
    outs = [learner.update(batch) for batch in data]
    return {"model": {k: v.detach().clone() for k, v in learner.loss_module.state_dict().items()},
            "params": sorted(n for n, _ in learner.loss_module.named_parameters()),
            "losses": [{k: float(v) for k, v in o.items()} for o in outs]}


def main(out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    learners = []
    for case, (kind, schedule, micro, scaled) in CASES.items():
        loss, policy = build(kind)
        data = batches(policy)
        strategy = PipelineStrategy(schedule=schedule, microbatches=micro, scale_grads=scaled)
        learner = FabricLearner(loss, sgd(), policy=policy, strategy=strategy, accelerator="cpu", devices=2,
                                clip_grad_norm=CLIP, timeout=TIMEOUT)
        learners.append(learner)
        results[case] = {"type": type(learner).__name__, "stage": learner.stage}
        if case == "grpo":  # a batch the schedule cannot carry: refused on every rank before any stage runs
            before = {k: v.clone() for k, v in learner.loss_module.state_dict().items()}
            try:
                learner.update(data[0][:2])
            except ValueError as err:
                results[case]["too_small"] = str(err)
            try:  # different batches on the two stages: refused on both, before any stage runs
                learner.update(data[0][:5 - rank])
            except ValueError as err:
                results[case]["unequal"] = str(err)
            results[case]["unchanged"] = all(torch.equal(before[k], v)
                                             for k, v in learner.loss_module.state_dict().items())
            results[case]["updates_after_refusal"] = learner.num_updates
        results[case].update(train(learner, data))
        if case == "grpo":  # the whole policy's weights, gathered from the stages on rank 0
            results[case]["weights"] = learner.get_weights()
            results[case]["weights_everywhere"] = learner.get_weights(cpu_offload=False)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    for learner in learners:  # every learner closed on every rank: the last one ends the group, at once
        learner.close()


if __name__ == "__main__":
    main(sys.argv[1])
