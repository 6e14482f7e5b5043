"""LoRA through peft, weights to a generation engine, and export for from_pretrained (issue #35).

One process: LocalLearner is the reference and the ranks' oracle. Two ranks: one launch of
tests/workers/llm_weights_checks.py for every multi-rank check, under DDP and FSDP.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import weakref

import pytest
import torch
from lora_cases import STEPS, generated_log_probs, generator_copy, grpo_case, logits, peft_model, sgd
from multiproc import WORKERS, launch

from fabric_learner import LocalLearner
from fabric_learner.checkpoint.dcp_folder import read_full
from fabric_learner.llm import export_checkpoint, export_pretrained, load_weights, weight_buckets
from fabric_learner.testing import tiny_causal_lm

pytest.importorskip("peft")  # the llm extra

MULTI_RANK = ("ddp", "fsdp")  # strategies the worker runs the LoRA, generator and export checks under


def trained(lora: bool, optimizer=None, steps=STEPS):
    loss, policy, batch = grpo_case(lora)
    learner = LocalLearner(loss, sgd() if optimizer is None else optimizer, policy=policy)
    for _ in range(steps):
        learner.update(batch)
    return learner, policy


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# ---- 1. LoRA through peft ---------------------------------------------------------------------

def test_lora_trains_only_the_adapters_and_adam_keeps_state_for_them_only():
    loss, policy, batch = grpo_case(lora=True)
    before = {n: p.detach().clone() for n, p in loss.named_parameters()}
    learner = LocalLearner(loss, policy=policy)  # optimizer=None: Adam
    for _ in range(STEPS):
        learner.update(batch)
    changed = {n for n, p in loss.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if is_adapter(n)}
    assert changed == adapters and len(adapters) == 8  # q_proj, v_proj x A, B x 2 layers
    listed = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert listed == {id(p) for n, p in loss.named_parameters() if is_adapter(n)}
    assert len(learner.optimizer.state) == 8


def test_lora_checkpoint_holds_only_adapters_and_round_trips():
    learner, _ = trained(lora=True, optimizer=torch.optim.Adam)
    state = learner.checkpoint()
    tensors = [k for k in state["model"] if k.startswith("actor_network.")]
    assert tensors and all(is_adapter(k) for k in tensors)
    assert len(tensors) == 8 and all(is_adapter(n) for n in state["param_names"])
    loss, policy, batch = grpo_case(lora=True, adapter_seed=5)  # the same base, other adapters
    other = LocalLearner(loss, torch.optim.Adam, policy=policy)
    other.load_checkpoint(state)
    a, b = learner.checkpoint(), other.checkpoint()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for i, fields in a["optimizer"]["state"].items():
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][i][field]))
    learner.update(batch)
    other.update(batch)
    for (n, p), (_, q) in zip(learner.loss_module.named_parameters(), other.loss_module.named_parameters()):
        assert torch.equal(p, q), n


def test_lora_save_and_load_on_disk(tmp_path):
    learner, _ = trained(lora=True)
    learner.save(tmp_path / "lora.ckpt")
    saved = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    assert all(is_adapter(k) for k in saved["model"] if k.startswith("actor_network."))
    loss, policy, _ = grpo_case(lora=True, adapter_seed=5)
    other = LocalLearner(loss, sgd(), policy=policy)
    other.load(tmp_path / "lora.ckpt")
    for (n, p), (_, q) in zip(learner.loss_module.named_parameters(), other.loss_module.named_parameters()):
        assert torch.equal(p, q), n


def test_a_checkpoint_holding_frozen_entries_loads_them_too():
    """A sharded folder, or a checkpoint written before the base was frozen, may hold frozen entries."""
    learner, _ = trained(lora=True, steps=1)
    state = learner.checkpoint()
    base = {k: v.clone() for k, v in learner.loss_module.state_dict().items() if k not in state["model"]}
    key = next(k for k in base if k.endswith("embed_tokens.weight"))
    state["model"].update(base)
    state["model"][key] = base[key] + 1.0
    loss, policy, _ = grpo_case(lora=True)
    other = LocalLearner(loss, sgd(), policy=policy)
    other.load_checkpoint(state)
    assert torch.equal(other.loss_module.state_dict()[key], base[key] + 1.0)
    state["model"][key] = torch.zeros(3)  # a frozen entry of the wrong shape is refused, as any other
    with pytest.raises(ValueError, match="shape mismatches"):
        other.load_checkpoint(state)


def test_an_optimizer_instance_over_frozen_parameters_is_refused():
    loss, policy, _ = grpo_case(lora=True)
    before = [p.detach().clone() for p in loss.parameters()]
    with pytest.raises(ValueError, match="frozen parameter"):
        LocalLearner(loss, torch.optim.Adam(loss.parameters()), policy=policy)
    assert all(torch.equal(a, b) for a, b in zip(before, loss.parameters()))


# ---- 2. weights to the generation side -----------------------------------------------------------

def test_get_weights_feed_a_generator_copy_by_name():
    learner, policy = trained(lora=False)
    generator = generator_copy(False, policy.tokenizer)
    theirs, ours = generated_log_probs(generator, policy.model)
    assert (theirs - ours).abs().max() > 1e-2  # another model before the load
    load_weights(generator, learner.get_weights())
    theirs, ours = generated_log_probs(generator, policy.model)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_weights_of_a_learner_built_without_policy_are_refused_naming_policy_not_lora():
    """Its get_weights() has the loss's layout ('actor_network.model.model...'): the refusal gave LoRA advice."""
    loss, policy, batch = grpo_case(False)
    learner = LocalLearner(loss, sgd())
    learner.update(batch)
    generator = generator_copy(False, policy.tokenizer)
    before = {k: v.clone() for k, v in generator.model.state_dict().items()}
    with pytest.raises(KeyError, match="has it without 'actor_network.model.'") as refused:
        load_weights(generator, learner.get_weights(cpu_offload=False))
    assert "built without policy=" in str(refused.value) and "lora=" not in str(refused.value), refused.value
    assert all(torch.equal(v, before[k]) for k, v in generator.model.state_dict().items())  # nothing copied


@pytest.mark.parametrize("lora", ["merged", "adapters"])
def test_lora_weights_feed_a_generator_merged_or_as_adapters(lora):
    learner, policy = trained(lora=True)
    generator = generator_copy(lora == "adapters", policy.tokenizer)  # adapters go to a peft copy
    load_weights(generator, itertools.chain.from_iterable(weight_buckets(learner, 50_000, lora=lora)),
                 strict=lora == "merged")
    if lora == "adapters":  # the copy's base is another model: give it the learner's base too
        base = {k: v for k, v in policy.model.state_dict().items() if not is_adapter(k)}
        load_weights(generator, base, strict=False)
    theirs, ours = generated_log_probs(generator, policy.model)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_merged_weights_equal_peft_merge_and_unload():
    learner, policy = trained(lora=True)
    merged = dict(itertools.chain.from_iterable(weight_buckets(learner, lora="merged")))
    reference = copy.deepcopy(policy.model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], reference[key], atol=1e-7, rtol=0, msg=key)
    adapters = dict(itertools.chain.from_iterable(weight_buckets(learner, lora="adapters")))
    from peft import get_peft_model_state_dict

    theirs = get_peft_model_state_dict(policy.model)
    assert adapters.keys() == theirs.keys() and all(torch.equal(adapters[k], theirs[k]) for k in theirs)


def test_buckets_are_bounded_and_not_kept_by_the_iterator():
    learner, _ = trained(lora=True, steps=1)
    bound = 30_000
    refs, sizes = [], []
    for bucket in weight_buckets(learner, bound):
        assert sum(n for ref, n in refs if ref() is not None) == 0  # earlier buckets: freed once dropped
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        largest = max(t.numel() * t.element_size() for _, t in bucket)
        assert sizes[-1] <= bound or len(bucket) == 1, (sizes[-1], largest)
        refs = [(weakref.ref(t), t.numel() * t.element_size()) for _, t in bucket]
        del bucket
    total = sum(p.numel() * p.element_size() for p in tiny_causal_lm().parameters())
    assert sum(sizes) == total and len(sizes) >= 10  # every weight once, in many buckets


def test_weight_stream_refuses_bad_arguments_before_reading():
    learner, policy = trained(lora=False, steps=1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        weight_buckets(learner, 0)
    with pytest.raises(ValueError, match="lora must be one of"):
        weight_buckets(learner, lora="both")
    with pytest.raises(ValueError, match="needs a peft model"):
        weight_buckets(learner, lora="adapters")
    with pytest.raises(ValueError, match="not a module of the learner's loss"):
        weight_buckets(learner, model=copy.deepcopy(policy.model))
    target = tiny_causal_lm(3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    weights = {**dict(itertools.chain.from_iterable(weight_buckets(learner))), "lm_head.wieght": torch.zeros(1)}
    with pytest.raises(KeyError, match="lm_head.wieght"):
        load_weights(target, weights)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing copied


# ---- 4. export ---------------------------------------------------------------------------------

def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner, policy = trained(lora=False)
    folder = export_pretrained(learner, tmp_path / "hf", tokenizer=policy.tokenizer, max_shard_bytes=200_000)
    files = sorted(os.listdir(folder))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 2
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary sibling left
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(logits(loaded), logits(policy.model), atol=1e-6, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "the answer is seven"
    assert tokenizer(text)["input_ids"] == policy.tokenizer(text)["input_ids"]


def test_lora_export_merged_and_adapters(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner, policy = trained(lora=True)
    merged = export_pretrained(learner, tmp_path / "merged")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(merged)), logits(policy.model),
                               atol=1e-6, rtol=0)
    adapters = export_pretrained(learner, tmp_path / "adapters", lora="adapters")
    assert sorted(os.listdir(adapters)) == ["adapter_config.json", "adapter_model.safetensors"]
    reloaded = PeftModel.from_pretrained(tiny_causal_lm(0), adapters)
    torch.testing.assert_close(logits(reloaded), logits(policy.model), atol=1e-6, rtol=0)


def test_export_from_a_saved_checkpoint_offline(tmp_path):
    from transformers import AutoModelForCausalLM

    learner, policy = trained(lora=True)
    learner.save(tmp_path / "learner.ckpt")
    live = export_pretrained(learner, tmp_path / "live")
    model = peft_model(0, adapter_seed=9)  # the same base, adapters to be filled from the checkpoint
    offline = export_checkpoint(tmp_path / "learner.ckpt", model, tmp_path / "offline")
    for a, b in zip(sorted(os.listdir(live)), sorted(os.listdir(offline))):
        assert a == b
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(offline)), logits(policy.model),
                               atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot tell where"):
        export_checkpoint(tmp_path / "learner.ckpt", tiny_causal_lm(0), tmp_path / "wrong")  # not a peft model
    assert not (tmp_path / "wrong").exists()


def test_export_is_atomic_and_refuses_an_existing_folder(tmp_path):
    learner, policy = trained(lora=False, steps=1)

    class BrokenTokenizer:
        def save_pretrained(self, folder):
            (open(os.path.join(folder, "half-written"), "w")).close()
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        export_pretrained(learner, tmp_path / "hf", tokenizer=BrokenTokenizer())
    assert os.listdir(tmp_path) == []  # neither the folder nor its temporary sibling
    export_pretrained(learner, tmp_path / "hf")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_pretrained(learner, tmp_path / "hf")
    learner.update(grpo_case(False)[2])
    export_pretrained(learner, tmp_path / "hf", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    with pytest.raises(ValueError, match="lora must be one of"):
        export_pretrained(learner, tmp_path / "other", lora="merge")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ---- two ranks: one launch ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm_weights")
    proc = launch(os.path.join(WORKERS, "llm_weights_checks.py"), out, *MULTI_RANK, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out, {s: [torch.load(out / f"{s}-rank{r}.pt", weights_only=False) for r in (0, 1)] for s in MULTI_RANK}


@pytest.fixture(scope="module")
def reference():
    """LocalLearner on the whole batch: what each rank's learner must hold."""
    learner, policy = trained(lora=True)
    return learner, policy


def test_sharded_weights_are_gathered_bucket_by_bucket(ranks):
    """Under FSDP today (an MLP actor the loss trains): every bucket is gathered from the shards, at most
    400 bytes at a time, nothing of an earlier bucket kept, and together they are the full weights."""
    out, _ = ranks
    for rank in (0, 1):
        res = torch.load(out / f"fsdp-stream-rank{rank}.pt", weights_only=False)
        assert res["sharded"] and res["local_fraction"] < 0.7  # each rank holds about half of them
        assert all(size <= 400 for size, _ in res["sizes"]) and [n for _, n in res["sizes"]] == [2, 2]
        assert max(res["held"]) == 0
        assert res["weights"].keys() == res["expected"].keys()
        for key, value in res["weights"].items():
            assert torch.equal(value, res["expected"][key]), key


def test_export_from_a_sharded_checkpoint_folder_offline(ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = ranks
    assert (out / "fsdp-fresh.ckpt" / "LATEST").is_file()  # a folder of shards from 2 FSDP ranks
    assert all(is_adapter(k) for k in read_full(out / "fsdp-fresh.ckpt")["model"] if k.startswith("actor_network."))
    folder = export_checkpoint(out / "fsdp-fresh.ckpt", peft_model(0, adapter_seed=9), tmp_path / "hf")
    want = copy.deepcopy(peft_model(0, adapter_seed=1)).merge_and_unload()  # what the learner was built with
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(folder)), logits(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("strategy", MULTI_RANK)
def test_lora_on_two_ranks_equals_one_process_and_checkpoints_adapters(ranks, reference, strategy):
    out, results = ranks
    learner, _ = reference
    want = learner.checkpoint()["model"]
    on_disk = read_full(out / "fsdp.ckpt") if strategy == "fsdp" else torch.load(out / "ddp.ckpt", weights_only=True)
    assert on_disk["model"].keys() == want.keys()  # the file, or the folder of shards: no base weight
    for res in results[strategy]:
        assert res["sharded"] == (strategy == "fsdp")
        assert res["model"].keys() == want.keys()  # adapters and the loss's buffers: no base weight
        for key in want:
            torch.testing.assert_close(res["model"][key], want[key], atol=1e-6, rtol=0, msg=key)
            assert torch.equal(res["reloaded"][key], res["model"][key]), key
        assert all(is_adapter(n) for n in res["param_names"]) and res["optimizer_params"] == 8
    a, b = results[strategy]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in want)  # ranks agree


@pytest.mark.parametrize("strategy", MULTI_RANK)
def test_weights_on_two_ranks_come_in_bounded_buckets_and_feed_each_ranks_generator(ranks, reference, strategy):
    _, results = ranks
    _, policy = reference
    merged = copy.deepcopy(policy.model).merge_and_unload().state_dict()
    from peft import get_peft_model_state_dict

    adapters = get_peft_model_state_dict(policy.model)
    for res in results[strategy]:
        for kind, want in (("merged", merged), ("adapters", adapters)):
            stream = res[kind]
            assert all(size <= 20_000 or count == 1 for size, count in stream["sizes"])  # a larger tensor: alone
            assert len(stream["sizes"]) >= (10 if kind == "merged" else 1)  # adapters: 7 kB, one bucket
            assert max(stream["held"]) == 0  # no earlier bucket kept alive by the iterator
            assert stream["weights"].keys() == want.keys()
            for key in want:
                torch.testing.assert_close(stream["weights"][key], want[key], atol=1e-6, rtol=0, msg=key)
        assert res["log_prob_gap"] < 1e-5


@pytest.mark.parametrize("strategy", MULTI_RANK)
def test_export_from_two_ranks_loads_with_from_pretrained(ranks, reference, strategy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, results = ranks
    _, policy = reference
    assert all(res["exported-merged"] and res["exported-adapters"] for res in results[strategy])
    merged = AutoModelForCausalLM.from_pretrained(out / f"{strategy}-merged")
    torch.testing.assert_close(logits(merged), logits(policy.model), atol=1e-6, rtol=0)
    adapters = PeftModel.from_pretrained(tiny_causal_lm(0), out / f"{strategy}-adapters")
    torch.testing.assert_close(logits(adapters), logits(policy.model), atol=1e-6, rtol=0)
    offline = export_checkpoint(out / f"{strategy}.ckpt", peft_model(0, 9), out / f"{strategy}-offline")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(offline)), logits(policy.model),
                               atol=1e-6, rtol=0)

