"""LoRA training, weights to a generator and export on 2 ranks, in one launch (tests/test_llm_weights.py).

Usage: python llm_weights_checks.py OUT_DIR STRATEGY [STRATEGY ...]   (STRATEGY: ddp, fsdp)
Writes OUT_DIR/<strategy>-rank{r}.pt with what the tests compare against LocalLearner, and the
exported folders OUT_DIR/<strategy>-merged, OUT_DIR/<strategy>-adapters (written by rank 0).
"""

from __future__ import annotations

import os
import sys
import weakref
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy
from lora_cases import STEPS, generated_log_probs, generator_copy, grpo_case, half, sgd
from rl_cases import halves, make_batch, make_loss

from fabric_learner import FabricLearner
from fabric_learner.llm import export_pretrained, load_weights, weight_buckets

TIMEOUT = timedelta(seconds=90)
BUCKET = 20_000  # bytes: the tiny model (~450 kB) comes in many buckets


def build(strategy, loss, policy):
    if strategy == "ddp":
        placement = DDPStrategy(timeout=TIMEOUT)
    else:
        placement = "fsdp"  # the package's own plan for the loss (per-decoder-layer units for transformers)
    return FabricLearner(loss, sgd(), policy=policy, accelerator="cpu", devices=2, strategy=placement)


def buckets_held(learner, lora, model=None, bound=BUCKET):
    """Stream the weights; at each bucket's arrival, the bytes of earlier buckets' tensors still alive."""
    refs, sizes, held, pairs = [], [], [], {}
    for bucket in weight_buckets(learner, bound, lora=lora, model=model):
        held.append(sum(n for ref, n in refs if ref() is not None))  # the iterator kept none of them
        sizes.append((sum(t.numel() * t.element_size() for _, t in bucket), len(bucket)))
        refs = [(weakref.ref(t), t.numel() * t.element_size()) for _, t in bucket]
        pairs.update((name, t.clone()) for name, t in bucket)
        del bucket
    return {"sizes": sizes, "held": held, "weights": pairs}


def checks(strategy, out_dir, rank):
    res = {}
    loss, policy, batch = grpo_case(lora=True)
    learner = build(strategy, loss, policy)
    res["sharded"] = learner.capabilities.sharded
    for _ in range(STEPS):
        learner.update(half(batch, rank))
    state = learner.checkpoint()
    res["model"], res["param_names"] = state["model"], state["param_names"]
    res["optimizer_params"] = sum(len(g["params"]) for g in learner.optimizer.param_groups)
    path = os.path.join(out_dir, f"{strategy}.ckpt")
    learner.save(path)
    again_loss, again_policy, _ = grpo_case(lora=True)
    again = build(strategy, again_loss, again_policy)
    again.load(path)
    res["reloaded"] = again.checkpoint()["model"]
    # the weights, merged and adapters alone, in buckets
    res["merged"] = buckets_held(learner, "merged")
    res["adapters"] = buckets_held(learner, "adapters")
    # this rank's own generation engine: a plain copy receiving merged weights
    generator = generator_copy(False, policy.tokenizer)
    load_weights(generator, (pair for b in weight_buckets(learner, BUCKET) for pair in b))
    with learner.full_parameters():
        theirs, ours = generated_log_probs(generator, policy.model)
    res["log_prob_gap"] = (theirs - ours).abs().max().item()
    for lora in ("merged", "adapters"):
        export_pretrained(learner, os.path.join(out_dir, f"{strategy}-{lora}"), lora=lora, bucket_bytes=BUCKET,
                          tokenizer=policy.tokenizer if lora == "merged" else None)
        res[f"exported-{lora}"] = os.path.isdir(os.path.join(out_dir, f"{strategy}-{lora}"))
    torch.save(res, os.path.join(out_dir, f"{strategy}-rank{rank}.pt"))
    learner.fabric.barrier()


def sharded_stream(out_dir, rank):
    """The bucketed gather under FSDP today, on a network FSDP already shards (PPO's actor, in the loss)."""
    loss, actor = make_loss("ppo", functional=False)
    learner = FabricLearner(loss, sgd(), policy=actor, accelerator="cpu", devices=2, strategy="fsdp")
    learner.update(halves(make_batch("ppo"), rank))
    res = {"sharded": learner.capabilities.sharded, **buckets_held(learner, "merged", model=actor, bound=400)}
    res["expected"] = learner.get_weights(cpu_offload=False).flatten_keys(".").to_dict()  # full on every rank
    params = learner.optimizer.param_groups[0]["params"]
    res["local_fraction"] = sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params)
    torch.save(res, os.path.join(out_dir, f"fsdp-stream-rank{rank}.pt"))
    learner.fabric.barrier()


def sharded_folder(out_dir, rank):
    """A sharded checkpoint folder of the LoRA learner under FSDP as built (updates wait for the FSDP plan)."""
    loss, policy, _ = grpo_case(lora=True)
    learner = FabricLearner(loss, sgd(), policy=policy, accelerator="cpu", devices=2, strategy="fsdp")
    learner.save(os.path.join(out_dir, "fsdp-fresh.ckpt"))
    learner.fabric.barrier()


def main(out_dir, strategies):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sharded_stream(out_dir, rank)
    sharded_folder(out_dir, rank)
    for strategy in strategies:
        checks(strategy, out_dir, rank)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
