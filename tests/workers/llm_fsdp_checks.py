"""FSDP2 for transformers models inside torchrl's LLM losses, in one 2-rank launch (forked from tests/zygote.py;
plain ``python`` runs it too).

Usage: python llm_fsdp_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt with what tests/test_llm_fsdp.py compares against LocalLearner.
Every learner trains with SGD (lr 1) on samples REPLIES, rank r taking samples 2r and 2r+1.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from fabric_learner import FabricLearner, shard_loss
from fabric_learner.llm import ReferenceLogProbs
from fabric_learner.testing import grpo_batch, grpo_example

TIMEOUT = timedelta(seconds=90)
REPLIES = (3, 8, 5, 2)
STEPS = 2


MOMENTUM = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.9)  # state only for parameters with a gradient


def sgd():
    return functools.partial(torch.optim.SGD, lr=1.0)


def build(case, **loss_kwargs):
    """``(loss, policy)`` of a case: GRPO (token mean) or SFT on the tiny Qwen2, seed 0."""
    from torchrl.objectives.llm import SFTLoss

    if case == "sft":
        _, policy, _ = grpo_example(REPLIES)
        return SFTLoss(policy, reduction="mean", **loss_kwargs), policy
    loss, policy, _ = grpo_example(REPLIES, **loss_kwargs)
    return loss, policy


def tied_example():
    """``(loss, policy)``: GRPO on a tiny Qwen2 whose LM head is its input embedding (tie_word_embeddings=True)."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fabric_learner.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=False,
                                 return_log_probs=True, pad_output=False)
    return GRPOLoss(policy, masking_strategy="rlhf"), policy


def batches(policy, rank=None, reference=None):
    """The STEPS batches, built from the initial policy; this rank's half of each (all when ``rank`` is None)."""
    out = []
    for step in range(STEPS):
        full = grpo_batch(policy, list(REPLIES), seed=step)
        part = full if rank is None else full[2 * rank:2 * rank + 2]
        out.append(reference(part) if reference is not None else part)
    return out


def fsdp(loss, policy, parallelize_fn=shard_loss, optimizer=None, **kwargs):
    strategy = ModelParallelStrategy(parallelize_fn=parallelize_fn, timeout=TIMEOUT)
    return FabricLearner(loss, optimizer or sgd(), policy=policy, accelerator="cpu", devices=2, strategy=strategy,
                         **kwargs)


def train(learner, data):
    outs = [learner.update(batch) for batch in data]
    return {"model": learner.checkpoint()["model"], "losses": [{k: float(v) for k, v in o.items()} for o in outs]}


def probe_units(learner):
    """Record, while each decoder layer runs (forward, and backward re-gather), which decoder layers hold full
    weights, and the dtype they are gathered in; plus how often a leaf inside the first layer ran."""
    owner = learner.sharded_module
    blocks = owner.block_units()
    seen, backward, dtypes, calls = [], [], set(), [0]

    def full_blocks():
        return [b.path for b in blocks if not any(isinstance(p, DTensor) for p in b.parameters())]

    def probe(block, args, kwargs):
        seen.append((block.path, full_blocks()))
        dtypes.update(str(p.dtype) for p in block.parameters())

    def on_pre_backward(block, original, *args, **kwargs):
        result = original(*args, **kwargs)
        backward.append((block.path, full_blocks()))
        return result

    grads = set()
    learner.optimizer.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.update(str(p.grad.dtype) for g in opt.param_groups for p in g["params"]
                                     if p.grad is not None))
    for b in blocks:
        b.register_forward_pre_hook(probe, with_kwargs=True)
        group = b._get_fsdp_state()._fsdp_param_group
        group.pre_backward = functools.partial(on_pre_backward, b, group.pre_backward)
    first = blocks[0].layers[next(iter(blocks[0].layers))].leaf
    first.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return {"seen": seen, "backward": backward, "dtypes": dtypes, "leaf_calls": calls, "grad_dtypes": grads}


def layout(learner):
    """Which modules are FSDP units, what the root holds, and the parameters' and gradients' dtypes."""
    from torch.distributed.fsdp import FSDPModule

    owner = learner.sharded_module
    params = dict(owner.named_loss_parameters())
    return {
        "blocks": [b.path for b in owner.block_units()],
        "block_is_unit": [isinstance(b, FSDPModule) for b in owner.block_units()],
        "leaf_units": [u.path for u in owner.layer_units() if isinstance(u, FSDPModule)],
        "block_params": {b.path: sorted(n for u in b.layers.values() for n in u.attrs.values())
                         for b in owner.block_units()},
        "at_rest_sharded": all(isinstance(p, DTensor) for p in params.values()),
        "param_dtypes": sorted({str(p.dtype) for p in params.values()}),
        "shard_fraction": sum(p.to_local().numel() for p in params.values()) / sum(p.numel() for p in params.values()),
    }


def main(out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    # 1, 2: GRPO and SFT under the default plan, one unit per decoder layer
    for case in ("grpo", "sft"):
        loss, policy = build(case)
        data = batches(policy, rank)
        learner = fsdp(loss, policy)
        probes = probe_units(learner) if case == "grpo" else None
        results[case] = train(learner, data)
        results[case]["layout"] = layout(learner)
        if probes is not None:
            results[case]["probes"] = probes
            results[case]["weights"] = learner.get_weights(cpu_offload=True)
    # 3: activation checkpointing of each decoder layer
    loss, policy = build("grpo")
    data = batches(policy, rank)
    learner = fsdp(loss, policy, parallelize_fn=functools.partial(shard_loss, activation_checkpointing=True))
    probes = probe_units(learner)
    results["checkpointed"] = {**train(learner, data), "probes": probes,
                               "flags": [b.checkpointed for b in learner.sharded_module.block_units()]}
    # 4: bf16 through FSDP2's MixedPrecisionPolicy
    for precision in ("bf16-mixed", "bf16-true"):
        loss, policy = build("grpo")
        data = batches(policy, rank)
        learner = fsdp(loss, policy, precision=precision)
        probes = probe_units(learner)
        results[precision] = {**train(learner, data), "layout": layout(learner), "gathered": probes["dtypes"],
                              "grad_dtypes": probes["grad_dtypes"],
                              "policy": repr(learner.sharded_module.mp_policy)}
    # 5: a frozen reference model, sharded like the policy, for the KL term
    loss, policy = build("grpo", kl_to_ref_coeff=0.5)
    learner = fsdp(loss, policy)
    from fabric_learner.testing import tiny_causal_lm

    reference = ReferenceLogProbs(tiny_causal_lm(seed=1, tokenizer=policy.tokenizer), policy.tokenizer,
                                  learner=learner)
    data = batches(policy, rank, reference)
    results["reference"] = {
        **train(learner, data),
        "ref_log_probs": [b.get(("next", "ref_log_probs", "full"), as_list=True) for b in data],
        "ref_sharded": all(isinstance(p, DTensor) for p in reference.model.parameters()),
        "ref_units": sorted(type(m).__name__ for m in reference.model.modules() if hasattr(m, "_get_fsdp_state")),
        "ref_grads": [n for n, p in reference.model.named_parameters() if p.grad is not None or p.requires_grad],
        "ref_in_optimizer": any(id(p) in {id(q) for q in reference.model.parameters()}
                                for g in learner.optimizer.param_groups for p in g["params"]),
        "checkpoint_keys": sorted(learner.checkpoint()["model"]),
    }
    # 6: frozen parameters inside the loss's model (as LoRA leaves the base weights), with SGD's momentum state
    loss, policy = build("grpo")
    frozen = [n for n, p in loss.named_parameters() if "embed_tokens" in n or "layers.0.self_attn" in n]
    for n, p in loss.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    learner = fsdp(loss, policy, optimizer=MOMENTUM)
    res = train(learner, batches(policy, rank))
    owner = learner.sharded_module
    state = learner.optimizer.optimizer.state
    path = os.path.join(out_dir, "frozen_ckpt")
    learner.save(path)
    saved = learner.checkpoint()
    learner.update(batches(policy, rank)[0])
    learner.load(path)
    after = learner.checkpoint()
    results["frozen"] = {
        **res, "frozen": frozen,
        "frozen_sharded": all(isinstance(owner.param(n), DTensor) for n in frozen),
        "frozen_grads": [n for n in frozen if owner.param(n).grad is not None],
        "frozen_state": [n for n in frozen if state.get(owner.param(n))],
        "trained_state": sum(1 for n, p in owner.named_loss_parameters() if n not in frozen and state.get(p)),
        "reloaded_equal": all(torch.equal(saved["model"][k], after["model"][k]) for k in saved["model"]),
    }
    with learner.full_parameters():  # checkpoints leave frozen parameters out (checkpoint/frozen.py): read them here
        results["frozen"]["frozen_values"] = {n: p.detach().clone() for n, p in loss.named_parameters() if n in frozen}
    # 7: tied input and output embeddings: one parameter, two layers; saved as one process saves it
    loss, policy = tied_example()
    data = batches(policy, rank)
    learner = fsdp(loss, policy)
    res = train(learner, data)
    path = os.path.join(out_dir, "tied_ckpt")
    learner.save(path)
    learner.update(data[0])
    learner.load(path)
    results["tied"] = {**res, "reloaded": learner.checkpoint()["model"], "folder": path}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
