"""Token-normalised LLM losses on 2 gloo ranks, DDP and FSDP, each rank feeding its own unequal micro-batches.

Usage: python llm_checks.py OUT_DIR STRATEGY...
Writes OUT_DIR/rank{r}.pt: per strategy and case, the parameters before and after one optimizer step
(SGD, lr 1: their difference is the gradient) and what update() reported.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import llm_cases
import torch
from llm_cases import SGD, make_loss, pieces

from fabric_learner import FabricLearner

CASES = os.environ.get("FL_CASES", ",".join(llm_cases.CASES)).split(",")  # FL_CASES: a subset, when probing
TIMEOUT = timedelta(seconds=90)


def full_state(learner) -> dict:
    return {k: v.clone() for k, v in learner.checkpoint()["model"].items()}


def main(out: str, strategies: list[str]) -> None:
    results = {}
    for strategy in strategies:
        for case in CASES:
            loss, policy = make_loss(case)
            batches = pieces(policy)
            learner = FabricLearner(loss, SGD, strategy=strategy, devices=2, accelerator="cpu", grad_accum_steps=2,
                                    timeout=TIMEOUT)
            rank = learner.global_rank
            before = full_state(learner)
            outputs = [learner.update(batch) for batch in batches[rank]]
            results[strategy, case] = {"before": before, "after": full_state(learner),
                                       "grad_norm": float(outputs[-1]["grad_norm"]),
                                       "num_updates": learner.num_updates}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
