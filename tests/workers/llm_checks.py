"""Token-normalised LLM losses on 2 gloo ranks, DDP and FSDP, each rank feeding its own unequal micro-batches.

Usage: python llm_checks.py OUT_DIR STRATEGY...
Writes OUT_DIR/rank{r}.pt: per strategy and case, the parameters before and after one optimizer step
(SGD, lr 1: their difference is the gradient) and what update() reported: fed as two micro-batches
through update(), and (keys ending in "budget", "packed") as the rank's whole window through
update_by_tokens, where rank 0's samples make 3 micro-batches of at most BUDGET tokens and rank 1's one.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import llm_cases
import torch
from llm_cases import SGD, make_loss, pieces
from tensordict import lazy_stack

from fabric_learner import FabricLearner
from fabric_learner.llm import micro_batches, pack_sequences, update_by_tokens

CASES = os.environ.get("FL_CASES", ",".join(llm_cases.CASES)).split(",")  # FL_CASES: a subset, when probing
TIMEOUT = timedelta(seconds=90)
BUDGET = 130  # tokens per micro-batch: rank 0's lengths (71, 63, 63, 42, 38) make 3, rank 1's (36, 31, 26) one


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
        for case, packed in [(case, False) for case in CASES] + [("token_mean", True)]:
            loss, policy = make_loss(case)
            if packed:
                pack_sequences(policy)
            window = lazy_stack([s for batch in pieces(policy)[rank] for s in batch.tensordicts])
            learner = FabricLearner(loss, SGD, strategy=strategy, devices=2, accelerator="cpu", timeout=TIMEOUT)
            before = full_state(learner)
            stepped = update_by_tokens(learner, window, BUDGET, packed=packed)
            results[strategy, case, "packed" if packed else "budget"] = {
                "before": before, "after": full_state(learner), "grad_norm": float(stepped["grad_norm"]),
                "num_updates": learner.num_updates, "micro_batches": len(micro_batches(window, BUDGET, packed=packed))}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
