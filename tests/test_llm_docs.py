"""docs/llm.md's code runs as written under ``strategy="fsdp", devices=2`` (issue #55).

One launch: the page's blocks, in the page's order, become one script run on 2 ranks (the one block
marked offline runs afterwards in this process, as the page says), followed by checks of what they
did and of what the page warns about (an empty ``get_weights()`` on rank 1, a copy of a sharded model).
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from multiproc import ROOT, launch

pytest.importorskip("transformers")  # the llm extra

PAGE = os.path.join(ROOT, "docs", "llm.md")

# Runs after the page's blocks on each rank, in their scope. Nothing here is for a reader.
CHECKS = '''
import copy as _copy
from fabric_learner.llm import load_weights as _load

_rank = learner.fabric.global_rank
_res = {"num_updates": learner.num_updates, "sharded": learner.capabilities.sharded,
        "trained": {k: v.clone() for k, v in learner.get_weights(cpu_offload=False).flatten_keys(".").items()},
        "generator": {k: v.clone() for k, v in generator.model.state_dict().items()}}
_rank0_only = learner.get_weights()  # cpu_offload=True: the full weights on rank 0 only
_res["rank0_only_keys"] = len(_rank0_only.flatten_keys(".").keys())
try:
    _res["rank0_only_loaded"] = _load(_copy.deepcopy(generator), _rank0_only)
except ValueError as error:
    _res["rank0_only_loaded"] = str(error)
_res["buckets_sent"] = sum(len(b) for b in weight_buckets(learner))

# a learner built without policy=, trained: its model holds no weights outside update
_bare_model = tiny_causal_lm(seed=1, tokenizer=tokenizer)
_bare_policy = TransformersWrapper(_bare_model, tokenizer=tokenizer, input_mode="history", generate=False,
                                   return_log_probs=True, pad_output=False)
_bare_batch = grpo_batch(_bare_policy, [3, 2], seed=_rank)
_bare = FabricLearner(GRPOLoss(_bare_policy, masking_strategy="rlhf"), optim, strategy="fsdp", devices=2)
_bare.update(_bare_batch)
try:
    _copy.deepcopy(_bare_model)
    _res["bare_copy"] = "copied"
except Exception as error:
    _res["bare_copy"] = f"{type(error).__name__}: {error}"
with _bare.full_parameters():
    _inside = _copy.deepcopy(_bare_model)
_res["copy_inside_full_parameters"] = {k: v.clone() for k, v in _inside.state_dict().items()}
_res["bare_trained"] = {k: v.clone() for k, v in _bare.get_weights(cpu_offload=False).flatten_keys(".").items()}
_bare.close()
torch.save(_res, f"rank{_rank}.pt")
learner.close()
'''


def page_blocks() -> tuple[list[str], list[str]]:
    """(the blocks run on the ranks, the offline blocks), in the page's order."""
    blocks = re.findall(r"```python\n(.*?)```", open(PAGE).read(), re.S)
    offline = [b for b in blocks if "export_checkpoint(" in b]
    return [b for b in blocks if b not in offline], offline


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm_docs")
    online, offline = page_blocks()
    script = out / "llm_page.py"
    script.write_text("import os, sys\nos.chdir(sys.argv[1])\n" + "\n".join(online) + CHECKS)
    proc = launch(str(script), out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    cwd = os.getcwd()
    os.chdir(out)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for block in offline:
                exec(compile(block, "docs/llm.md (offline)", "exec"), {"__name__": "llm_page_offline"})
    finally:
        os.chdir(cwd)
    proc.offline_warnings = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], proc


def test_the_page_has_a_block_for_each_step_it_describes():
    online, offline = page_blocks()
    assert len(online) == 4 and len(offline) == 1, (len(online), len(offline))
    assert "policy=policy" in online[0] and 'strategy="fsdp"' in online[0] and "devices=2" in online[0]


def test_the_pages_code_prints_no_warning_the_package_causes(ran):
    """Fabric's all_gather in save() (through torch.distributed.nn's, deprecated) warned on both ranks, and the
    offline export's one-process read of the shards made torch say it assumed one process."""
    _, _, proc = ran
    for said in ("is deprecated", "torch.distributed is disabled"):
        assert said not in proc.stdout, proc.stdout[-6000:]
    assert proc.offline_warnings == [], proc.offline_warnings


def test_the_page_trains_on_two_sharded_ranks_and_feeds_each_rank_generator_the_trained_weights(ran):
    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    _, ranks, proc = ran
    assert proc.leftovers == 0
    initial = tiny_causal_lm(tokenizer=tiny_tokenizer()).state_dict()
    for res in ranks:
        assert res["sharded"] and res["num_updates"] == 2  # two update_by_tokens calls: one optimizer step each
        generator, trained = res["generator"], {k.removeprefix("model."): v for k, v in res["trained"].items()}
        assert generator.keys() == initial.keys()
        moved = [k for k in generator if not torch.equal(generator[k], initial[k])]
        assert len(moved) > 20, moved  # the copy was taken before training and now holds the trained weights
        assert all(torch.equal(generator[k], trained[k]) for k in generator)
    assert all(torch.equal(v, ranks[1]["generator"][k]) for k, v in ranks[0]["generator"].items())


def test_get_weights_and_weight_buckets_send_the_counts_the_page_gives(ran):
    _, ranks, _ = ran
    text = " ".join(open(PAGE).read().split())
    assert "(29 for the tiny Qwen2: 27 parameters and the rotary embedding's `inv_freq` and `original_inv_freq`" in text
    assert "`weight_buckets` the model's state dict (27:" in text
    for res in ranks:
        assert len(res["trained"]) == 29 and res["buckets_sent"] == 27 == len(res["generator"])
        assert {k for k in res["trained"] if "rotary_emb" in k} == {"model.model.rotary_emb.inv_freq",
                                                                   "model.model.rotary_emb.original_inv_freq"}


def test_an_empty_get_weights_on_rank_1_is_refused_saying_nothing_was_sent_and_the_fix(ran):
    _, (rank0, rank1), _ = ran
    assert rank0["rank0_only_keys"] == 29 and rank0["rank0_only_loaded"] == 29
    assert rank1["rank0_only_keys"] == 0
    message = rank1["rank0_only_loaded"]
    assert isinstance(message, str) and "nothing was sent" in message, message
    assert "rank 0 only" in message and "cpu_offload=False" in message and "weight_buckets" in message, message


def test_a_copy_of_a_model_sharded_without_policy_is_refused_naming_the_fix_and_works_inside_full_parameters(ran):
    _, ranks, _ = ran
    for res in ranks:
        refusal = res["bare_copy"]
        assert refusal.startswith("RuntimeError: copy.deepcopy of the loss's module"), refusal
        assert "before building the learner" in refusal and "policy=" in refusal and "nothing was copied" in refusal
        trained = {k.removeprefix("actor_network.model."): v for k, v in res["bare_trained"].items()}
        copied = res["copy_inside_full_parameters"]
        assert copied.keys() <= trained.keys() and len(copied) == 27
        assert all(torch.equal(v, trained[k]) for k, v in copied.items())


def test_the_exported_folders_reload_with_from_pretrained_holding_the_trained_weights(ran):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, (rank0, _), _ = ran
    live = AutoModelForCausalLM.from_pretrained(out / "out" / "model")
    offline = AutoModelForCausalLM.from_pretrained(out / "out" / "offline")
    assert AutoTokenizer.from_pretrained(out / "out" / "model")("the answer")["input_ids"]
    for model in (live, offline):
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in rank0["generator"].items())


@pytest.mark.parametrize("empty", ["TensorDict", "dict", "stream"])
def test_load_weights_given_nothing_says_nothing_was_sent_and_why_under_fsdp_and_copies_nothing(empty):
    from tensordict import TensorDict

    from fabric_learner.llm import load_weights
    from fabric_learner.testing import tiny_causal_lm

    model = tiny_causal_lm(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = {"TensorDict": TensorDict(), "dict": {}, "stream": iter([])}[empty]
    with pytest.raises(ValueError) as refused:
        load_weights(model, weights)
    message = str(refused.value)
    assert "nothing was sent" in message and "rank 0 only" in message and "cpu_offload=False" in message, message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_load_weights_given_an_empty_tensordict_refuses_even_without_strict():
    from tensordict import TensorDict

    from fabric_learner.llm import load_weights
    from fabric_learner.testing import tiny_causal_lm

    with pytest.raises(ValueError, match="nothing was sent"):
        load_weights(tiny_causal_lm(3), TensorDict(), strict=False)
