"""FSDP2 for transformers models inside torchrl's LLM losses (issue #35), on 2 real gloo processes.

One launch (tests/workers/llm_fsdp_checks.py) trains GRPO and SFT on the tiny Qwen2 under
``strategy="fsdp"``'s plan, with activation checkpointing, in bf16, with a frozen reference model
and with frozen parameters; the tests compare each with LocalLearner on the full batch (SGD lr 1,
so a gradient difference shows in the weights) and the ranks with each other.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from multiproc import WORKERS, launch

pytest.importorskip("transformers")
sys.path.insert(0, WORKERS)
import llm_fsdp_checks as checks

from fabric_learner import LocalLearner
from fabric_learner.llm import ReferenceLogProbs
from fabric_learner.testing import tiny_causal_lm

BLOCKS = ["actor_network.model.model.layers.0", "actor_network.model.model.layers.1"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm_fsdp")
    proc = launch(os.path.join(WORKERS, "llm_fsdp_checks.py"), out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def local(case, optimizer=None, frozen=(), reference=False, halves=False, **loss_kwargs):
    """LocalLearner on the full batches, as the ranks trained on their halves (with ``halves``: each step
    accumulated over two micro-batches, the ranks' halves, which the learner weighs as it weighs two ranks)."""
    loss, policy = checks.tied_example() if case == "tied" else checks.build(case, **loss_kwargs)
    ref = ReferenceLogProbs(tiny_causal_lm(seed=1, tokenizer=policy.tokenizer), policy.tokenizer) if reference else None
    data = checks.batches(policy, None, ref)
    for name, p in loss.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    initial = copy.deepcopy(loss.state_dict())
    learner = LocalLearner(loss, optimizer or checks.sgd(), policy=policy, grad_accum_steps=2 if halves else 1)
    fed = [half for batch in data for half in (batch[:2], batch[2:])] if halves else data
    return {**checks.train(learner, fed), "data": data, "initial": initial}


def assert_states(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=atol, rtol=0, msg=k)


def assert_ranks_agree(ranks, case):
    assert_states(ranks[0][case]["model"], ranks[1][case]["model"], atol=0)


@pytest.mark.parametrize("case", ["grpo", "sft"])
def test_llm_losses_train_under_fsdp_like_one_process(ranks, case):
    """GRPOLoss (token mean) and SFTLoss on a TransformersWrapper: two SGD steps on 2 ranks, each on its half of
    each batch (unequal token counts), equal one process on the whole batch; the ranks agree bit for bit."""
    oracle = local(case)
    assert_ranks_agree(ranks, case)
    assert_states(ranks[0][case]["model"], oracle["model"], atol=1e-5)
    for got, want in zip(ranks[0][case]["losses"], oracle["losses"]):
        assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5
    moved = max((oracle["model"][k] - oracle["initial"][k]).abs().max() for k in oracle["model"])
    assert moved > 1e-2  # the steps really changed the weights
    if case == "grpo":  # get_weights: the full policy on rank 0, as the loss holds it
        weights = {f"actor_network.{k}": v for k, v in ranks[0][case]["weights"].flatten_keys(".").items()}
        trained = {k: v for k, v in oracle["model"].items() if k.startswith("actor_network.")}
        assert_states({k: weights[k] for k in trained}, trained, atol=1e-5)  # weights also hold rotary buffers


def test_each_decoder_layer_is_its_own_unit_gathered_only_while_it_runs(ranks):
    """Decoder layers are found from the model's _no_split_modules (Qwen2DecoderLayer) and each is one FSDP2 unit
    holding all its parameters; embeddings, final norm and LM head stay in the root unit. While a layer runs,
    forward and backward, it is the only decoder layer holding full weights (resharded after forward)."""
    for rank in ranks:
        got = rank["grpo"]
        lay = got["layout"]
        assert lay["blocks"] == BLOCKS and lay["block_is_unit"] == [True, True]
        assert lay["leaf_units"] == []  # small layers: no unit of their own inside or outside a decoder layer
        for block, names in lay["block_params"].items():
            assert len(names) == 12 and all(n.startswith(block + ".") for n in names), names
        assert lay["at_rest_sharded"] and lay["shard_fraction"] == 0.5
        seen, backward = got["probes"]["seen"], got["probes"]["backward"]
        assert [p for p, _ in seen] == BLOCKS * checks.STEPS
        assert [p for p, _ in backward] == BLOCKS[::-1] * checks.STEPS
        for path, full in seen + backward:
            assert full == [path], (path, full)


def test_activation_checkpointing_recomputes_each_decoder_layer_with_the_same_result(ranks):
    """shard_loss(activation_checkpointing=True): each decoder layer's forward runs again in its backward (twice
    the calls), inside its unit's re-gather; the weights after two steps equal the run without it."""
    for rank in ranks:
        got = rank["checkpointed"]
        assert got["flags"] == [True, True]
        assert rank["grpo"]["probes"]["leaf_calls"] == [checks.STEPS]
        assert got["probes"]["leaf_calls"] == [2 * checks.STEPS]
        for path, full in got["probes"]["seen"] + got["probes"]["backward"]:
            assert full == [path]
        assert_states(got["model"], rank["grpo"]["model"], atol=1e-6)
    assert_ranks_agree(ranks, "checkpointed")


@pytest.mark.parametrize("precision, stored", [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")])
def test_bf16_goes_through_fsdp2_mixed_precision(ranks, precision, stored):
    """bf16-mixed keeps float32 shards and gradients and gathers each unit in bfloat16; bf16-true stores, gathers
    and reduces into bfloat16. Both train like the float32 run within bfloat16's precision."""
    fp32 = ranks[0]["grpo"]["model"]
    for rank in ranks:
        got = rank[precision]
        assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in got["policy"]
        assert got["layout"]["param_dtypes"] == [stored] and got["grad_dtypes"] == {stored}
        assert got["gathered"] == {"torch.bfloat16"}
        assert_states(got["model"], fp32, atol=1e-2)  # measured: 4e-3 (mixed), 5e-3 (true); steps move 0.2
    assert_ranks_agree(ranks, precision)
    diff = max((ranks[0][precision]["model"][k].float() - fp32[k]).abs().max() for k in fp32)
    assert diff > 0  # really computed in bfloat16


def test_frozen_reference_model_is_sharded_and_gives_one_process_log_probs(ranks):
    """ReferenceLogProbs on the learner's ranks: sharded per decoder layer like the policy, frozen, in no optimizer
    and no checkpoint; its log-probs equal one process's on the same samples, and GRPO with kl_to_ref_coeff
    trains like one process."""
    # torchrl's KL term is a mean over padded positions (see fabric_learner.llm): one process compares on the
    # ranks' micro-batches
    oracle = local("grpo", reference=True, halves=True, kl_to_ref_coeff=0.5)
    for r, rank in enumerate(ranks):
        got = rank["reference"]
        assert got["ref_sharded"] and got["ref_units"] == ["FSDPQwen2DecoderLayer"] * 2 + ["FSDPQwen2ForCausalLM"]
        assert got["ref_grads"] == [] and not got["ref_in_optimizer"]
        assert not any("ref" in k for k in got["checkpoint_keys"])
        for step, batch in enumerate(oracle["data"]):
            want = batch.get(("next", "ref_log_probs", "full"), as_list=True)[2 * r:2 * r + 2]
            for a, b in zip(got["ref_log_probs"][step], want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert oracle["losses"][1]["kl_to_ref"] > 0
    assert_ranks_agree(ranks, "reference")
    assert_states(ranks[0]["reference"]["model"], oracle["model"], atol=1e-5)


def test_frozen_parameters_are_sharded_without_gradients_or_optimizer_state(ranks):
    """Parameters with requires_grad=False inside the loss's model (as LoRA leaves the base weights) are sharded
    like the others, get no gradient and no optimizer state (SGD's momentum), stay as they were, survive a save/load, and the rest
    trains like one process."""
    frozen = ranks[0]["frozen"]["frozen"]
    oracle = local("grpo", optimizer=checks.MOMENTUM, frozen=frozen)
    for rank in ranks:
        got = rank["frozen"]
        assert got["frozen_sharded"] and got["frozen_grads"] == [] and got["frozen_state"] == []
        assert not set(frozen) & set(got["model"])  # checkpoints leave frozen parameters out
        assert got["trained_state"] == len(got["model"]) - 2  # all but the 2 loss buffers
        assert got["reloaded_equal"]
        for name in frozen:
            assert torch.equal(got["frozen_values"][name], oracle["initial"][name]), name
    assert_ranks_agree(ranks, "frozen")
    assert_states(ranks[0]["frozen"]["model"], oracle["model"], atol=1e-5)


def test_tied_embeddings_train_save_and_load_like_one_process(ranks):
    """A model whose LM head is its input embedding (one parameter in two layers, tie_word_embeddings=True, as
    small Qwen2 models ship): both layers use the one sharded parameter, gathered with the root; training equals
    one process, the checkpoint holds both names as one process's does, and the folder loads back on 2 ranks and
    into one process."""
    oracle = local("tied")
    assert_ranks_agree(ranks, "tied")
    got = ranks[0]["tied"]
    assert "actor_network.model.lm_head.weight" in got["model"]
    assert_states(got["model"], oracle["model"], atol=1e-5)
    assert_states(got["reloaded"], got["model"], atol=0)
    loss, policy = checks.tied_example()
    one = LocalLearner(loss, checks.sgd(), policy=policy)
    one.load(got["folder"])
    assert_states(one.checkpoint()["model"], got["model"], atol=0)
    assert policy.model.lm_head.weight is policy.model.model.embed_tokens.weight  # still tied after the load


def test_bad_inputs_are_refused_before_anything_changes():
    """One process, no launch: what the reference model and the plan refuse, with the fix named."""
    import torch.nn as nn

    from fabric_learner.sharding import apply_fsdp

    model = tiny_causal_lm()
    with pytest.raises(ValueError, match="activation_checkpointing=True applies to the decoder layers"):
        apply_fsdp(model, None, activation_checkpointing=True)
    assert not any(hasattr(m, "_get_fsdp_state") for m in model.modules())  # nothing was sharded
    with pytest.raises(TypeError, match="copy.deepcopy"):
        ReferenceLogProbs(model.state_dict(), None)
    _, policy = checks.build("grpo")
    reference = ReferenceLogProbs(model, policy.tokenizer)
    batch = checks.batches(policy)[0]
    with pytest.raises(KeyError, match="lacks"):
        reference(batch.exclude("history"))
    assert ("next", "ref_log_probs", "full") not in batch.keys(include_nested=True)
    assert isinstance(model, nn.Module) and not any(p.requires_grad for p in model.parameters())
