"""Pipeline parallelism for language models (issue #69): 2 stages on 2 real gloo processes.

One launch (tests/workers/pipeline_checks.py) trains GRPO (token mean, 1F1B, 3 micro-batches of unequal token
counts) and SFT (GPipe, 2 micro-batches) on the tiny Qwen2 split by decoder layer, with SGD (lr 1) and clipping
that bites; the tests compare each stage's parameters with LocalLearner on the whole batch. The same launch
saves and loads checkpoints across layouts (2 stages, FSDP on 2 ranks, one process), with SGD and momentum.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
from multiproc import WORKERS, launch

pytest.importorskip("transformers")
sys.path.insert(0, WORKERS)
import pipeline_checks as checks

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.checkpoint import dcp_folder
from fabric_learner.pipeline import PipelineStrategy, check_split, decoder_split
from fabric_learner.sharding.pipeline_split import decoder_stage_bounds
from fabric_learner.testing import tiny_causal_lm


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The launch's folder: each rank's results and the checkpoints it wrote."""
    out = tmp_path_factory.mktemp("pipeline")
    proc = launch(os.path.join(WORKERS, "pipeline_checks.py"), out, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out


@pytest.fixture(scope="module")
def ranks(launched):
    return [torch.load(launched / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def local(kind):
    """LocalLearner on the whole batches: the weights and outputs after checks.STEPS steps."""
    loss, policy = checks.build(kind)
    data = checks.batches(policy)
    learner = LocalLearner(loss, checks.sgd(), policy=policy, clip_grad_norm=checks.CLIP)
    outs = [learner.update(batch) for batch in data]
    return {"model": loss.state_dict(), "losses": [{k: float(v) for k, v in o.items()} for o in outs]}


def stage_difference(ranks, case, oracle):
    """The largest difference between a stage's trained parameters and one process's, over both stages."""
    worst = 0.0
    for rank in ranks:
        got = rank[case]
        for name in got["params"]:
            worst = max(worst, float((got["model"][name] - oracle["model"][name]).abs().max()))
    return worst


@pytest.mark.parametrize("case", ["grpo", "sft"])
def test_two_pipeline_stages_train_like_one_process_on_the_whole_batch(ranks, case):
    """GRPOLoss (token mean, 1F1B, 3 micro-batches of unequal token counts) and SFTLoss (GPipe, 2 micro-batches):
    two SGD steps with clipping that bites, the model split over 2 ranks by decoder layer, equal LocalLearner on
    the whole batch within 1e-5, parameter for parameter on each stage; the reported loss and norm too."""
    oracle = local(checks.CASES[case][0])
    assert [r[case]["type"] for r in ranks] == ["PipelineLearner"] * 2 and [r[case]["stage"] for r in ranks] == [0, 1]
    first, last = (set(r[case]["params"]) for r in ranks)
    assert not first & last and first | last == {n for n in oracle["model"] if n.startswith("actor_network.")}
    assert any("embed_tokens" in n for n in first) and any("lm_head" in n for n in last)
    assert stage_difference(ranks, case, oracle) < 1e-5
    for rank in ranks:
        for got, want in zip(rank[case]["losses"], oracle["losses"]):
            assert want["grad_norm"] > 2 * checks.CLIP  # clipping bites
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5
            for key in (k for k in want if k.startswith("loss")):
                assert abs(got[key] - want[key]) < 1e-5, key


def test_get_weights_gathers_the_stages_into_the_whole_policy_under_its_own_names(ranks):
    """After training, rank 0's get_weights() holds every tensor of the unsplit policy under the names one
    process's get_weights() gives them, equal to its values within 1e-5; rank 1 gets an empty TensorDict, and with
    cpu_offload=False both ranks get the whole policy."""
    loss, policy = checks.build("grpo")
    learner = LocalLearner(loss, checks.sgd(), policy=policy, clip_grad_norm=checks.CLIP)
    for batch in checks.batches(policy):
        learner.update(batch)
    want = learner.get_weights().flatten_keys(".")
    assert len(ranks[1]["grpo"]["weights"].keys()) == 0
    for got in (ranks[0]["grpo"]["weights"], ranks[0]["grpo"]["weights_everywhere"],
                ranks[1]["grpo"]["weights_everywhere"]):
        got = got.flatten_keys(".")
        assert list(got.keys()) == list(want.keys())
        for key in want.keys():
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)


def test_per_micro_batch_means_with_torch_scale_grads_do_not_equal_one_process(ranks):
    """PipelineStrategy(scale_grads=True), torch's default: each micro-batch's own mean, the gradients divided by
    the micro-batch count. With unequal token counts that weighs tokens unequally: the step differs from one
    process's by more than ten times the 1e-5 the exact normalisation meets."""
    oracle = local("grpo")
    assert stage_difference(ranks, "grpo_scaled", oracle) > 1e-4  # measured: 6.6e-4; the exact run: 7e-9


def test_a_batch_the_schedule_cannot_carry_is_refused_on_every_rank_before_any_stage_runs(ranks):
    """2 samples for 3 micro-batches, batches of 5 and 4 samples on the two stages, and a batch stage 1 cannot read
    (no advantages there, which its loss reads before the model): an error on both ranks before any stage runs
    (the stage that could not read it raises the loss's own error, the other names that stage), no parameter
    changed and no update counted; the learner then trains as usual (the comparisons above)."""
    for rank in ranks:
        got = rank["grpo"]
        assert "2 samples cannot be cut into the schedule's 3 micro-batches" in got["too_small"]
        assert "No stage ran" in got["too_small"]
        assert "batches of 4 to 5 samples" in got["unequal"] and "the same batch" in got["unequal"]
        assert got["unchanged"] and got["updates_after_refusal"] == 0
    assert ranks[0]["grpo"]["unreadable"].startswith("ValueError: Stage 1 (rank 1) could not read this batch")
    assert "No stage ran" in ranks[0]["grpo"]["unreadable"]
    assert ranks[1]["grpo"]["unreadable"] == "ValueError: Advantage key advantage not in tensordict."


# ---- checkpoints across layouts: the stages, FSDP on 2 ranks, one process -------------------------------


def difference(got, want):
    """The largest difference of parameters and momenta between two whole-model states (same names, counted)."""
    assert got["model"].keys() == want["model"].keys() and got["momentum"].keys() == want["momentum"].keys()
    assert set(want["momentum"]) == set(want["model"]) - {"clip_epsilon_low", "clip_epsilon_high"}  # every parameter
    return max(float((got[part][k] - want[part][k]).abs().max()) for part in ("model", "momentum") for k in want[part])


def one_process():
    loss, policy = checks.build("grpo")
    return LocalLearner(loss, checks.MOMENTUM, policy=policy), checks.ckpt_batches(policy)


@pytest.mark.filterwarnings("ignore:The checkpoint holds the random state of 2 rank")  # 2 -> 1
def test_a_pipeline_checkpoint_loads_into_one_process_which_then_trains_as_the_stages_do(ranks, launched):
    """The stages' folder (after one SGD-with-momentum step) loads into a LocalLearner: every parameter and momentum
    equal within 1e-6, one update counted; its next step equals the stages' next step within 1e-6. The momenta
    matter: the same step from the loaded weights without them lands more than 1e-2 away."""
    saved, trained_on = ranks[0]["ckpt"]["pipeline_saved"], ranks[0]["ckpt"]["pipeline_trained_on"]
    learner, data = one_process()
    learner.load(launched / "pipeline.ckpt")
    assert learner.num_updates == 1 and difference(checks.state(learner), saved) < 1e-6  # measured: 0
    learner.update(data[1])
    assert learner.num_updates == 2 and difference(checks.state(learner), trained_on) < 1e-6  # measured: 7e-8
    forgetful, _ = one_process()
    forgetful.load(launched / "pipeline.ckpt")
    forgetful.optimizer.state.clear()  # the weights without the momenta
    forgetful.update(data[1])
    assert difference(checks.state(forgetful), trained_on) > 1e-2


def test_a_pipeline_checkpoint_loads_into_fsdp_on_two_ranks_which_then_trains_as_the_stages_do(ranks):
    """FabricLearner(strategy="fsdp", devices=2) on the same ranks loads the stages' folder (each rank reading its
    shards of the whole model's tensors): equal to what the stages saved, one update counted; its next step on the
    batch's halves equals the stages' on the whole batch within 1e-6."""
    got = ranks[0]["ckpt"]
    assert got["fsdp_loaded"]["num_updates"] == 1 and difference(got["fsdp_loaded"], got["pipeline_saved"]) < 1e-6
    assert got["fsdp_trained_on"]["num_updates"] == 2
    assert difference(got["fsdp_trained_on"], got["pipeline_trained_on"]) < 1e-6  # measured: 1.2e-7


def test_an_fsdp_checkpoint_loads_into_the_stages_which_then_train_as_fsdp_does(ranks):
    """The stages load FSDP's folder (written by 2 ranks each holding half of every tensor): equal to what FSDP
    saved, two updates counted; their next step equals FSDP's within 1e-6."""
    got = ranks[0]["ckpt"]
    assert got["from_fsdp_loaded"]["num_updates"] == 2
    assert difference(got["from_fsdp_loaded"], got["fsdp_trained_on"]) < 1e-6
    assert got["from_fsdp_trained_on"]["num_updates"] == 3
    assert difference(got["from_fsdp_trained_on"], got["fsdp_trained_further"]) < 1e-6  # measured: 6e-8


def test_a_one_process_checkpoint_file_loads_into_the_stages_which_then_train_as_one_process_does(ranks):
    """The stages load a LocalLearner's single file (each stage taking its part of the whole model): equal to what
    it saved, one update counted; their next step equals the one process's within 1e-6."""
    got = ranks[0]["ckpt"]
    assert got["from_local_loaded"]["num_updates"] == 1
    assert difference(got["from_local_loaded"], got["local_saved"]) < 1e-6
    assert got["from_local_trained_on"]["num_updates"] == 2
    assert difference(got["from_local_trained_on"], got["local_trained_on"]) < 1e-6  # measured: 7e-8


def test_each_stage_writes_only_its_own_part_under_the_whole_models_names(ranks, launched):
    """The folder is FSDP's layout for the whole model: meta.json names every key of the unsplit loss and one
    optimizer group over all its parameters (nothing says how it was split); stage r's tensors (its parameters
    and their momenta) are stored in rank r's shard file only."""
    import json

    folder = dcp_folder.latest_version(launched / "pipeline.ckpt")
    meta = json.loads((folder / "meta.json").read_text())
    whole = checks.build("grpo")[0]
    assert meta["model_keys"] == list(whole.state_dict()) and meta["world_size"] == 2 and "stages" not in meta
    assert [g["params"] for g in meta["param_groups"]] == [[n for n, _ in whole.named_parameters()]]
    assert meta["param_groups"][0]["momentum"] == 0.9
    where = {index.fqn: info.relative_path for index, info in dcp_folder.read_metadata(folder).storage_data.items()}
    for rank in (0, 1):
        for name in ranks[rank]["grpo"]["params"]:
            assert where[f"model/{name}"] == where[f"optim/{name}/momentum_buffer"] == f"__{rank}_0.distcp", name


@pytest.mark.filterwarnings("ignore:The checkpoint holds the random state of 2 rank")  # 2 -> 1
def test_a_save_that_fails_mid_write_on_one_stage_leaves_the_previous_checkpoint_current(ranks, launched):
    """Stage 1's write stops half-way (a full disk, simulated) in the second save to the same folder: both ranks
    raise a RuntimeError naming stage 1's error and that LATEST still names the previous version; the half-written
    version stays beside it, never read; the folder loads the first save (one update counted, its weights)."""
    first = ranks[0]["ckpt"]["pipeline_saved"]
    for rank in ranks:
        got = rank["ckpt"]
        assert got["failed_save"].startswith(f"RuntimeError: Rank {ranks.index(rank)}: save(")
        assert "stage 1 (rank 1): OSError: [Errno 28] No space left on device (simulated mid-write)" in got["failed_save"]
        assert "LATEST still names the previous complete version" in got["failed_save"]
        assert got["latest_after_failed_save"].startswith("v000000001-")
        assert len(got["versions_after_failed_save"]) == 2
    learner, _ = one_process()
    learner.load(launched / "pipeline.ckpt")
    assert learner.num_updates == 1 and difference(checks.state(learner), first) == 0.0


def test_a_missing_path_or_another_models_checkpoint_is_refused_on_every_stage_and_changes_nothing(ranks):
    """load() of a path with nothing there, of another loss's pipeline folder (SFT: no GRPO clipping constants)
    and of another model's file (a DQN LocalLearner's): the same error on both stages, naming what failed, that
    nothing was loaded and the fix; parameters, momenta and the update count unchanged."""
    for rank in ranks:
        got = rank["ckpt"]
        assert got["missing"].startswith("FileNotFoundError: No checkpoint at ")
        assert "nothing was loaded. Pass the path save() wrote." in got["missing"]
        assert got["foreign_folder"].startswith("ValueError: The checkpoint at ")
        assert "holds another model than this learner's (not in the checkpoint: ['clip_epsilon_high', " \
               "'clip_epsilon_low']" in got["foreign_folder"] and "nothing was loaded" in got["foreign_folder"]
        assert "dqn.ckpt: The checkpoint's model state does not match this loss module; nothing was loaded" \
            in got["foreign_file"]
    assert difference(ranks[0]["ckpt"]["unchanged_after_refusals"], ranks[0]["ckpt"]["pipeline_saved"]) == 0.0
    assert ranks[0]["ckpt"]["unchanged_after_refusals"]["num_updates"] == 1


def _leave_out_layer_1(model, stage, num_stages):
    decoder_split(model, stage, num_stages)
    if stage == 1:
        model.model.layers[1] = torch.nn.Identity()
    return model


def _layer_0_twice(model, stage, num_stages):
    layer = model.model.layers[0]
    decoder_split(model, stage, num_stages)
    model.model.layers[0] = layer
    return model


@pytest.mark.parametrize("split, named", [(_leave_out_layer_1, "in no stage: model.layers.1."),
                                          (_layer_0_twice, "in several stages: model.layers.0.")])
def test_a_split_that_does_not_cover_the_model_exactly_once_is_refused_before_any_rank_starts(split, named):
    """One process: check_split names the parameters in no stage or in two; the learner refuses such a split before
    launching its ranks (the same check on every rank, no collective), the model unchanged."""
    model = tiny_causal_lm()
    with pytest.raises(ValueError, match=named):
        check_split(model, split, 2)
    loss, policy = checks.build("grpo")
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    with pytest.raises(ValueError, match="does not cover the model exactly once"):
        FabricLearner(loss, checks.sgd(), policy=policy, strategy=PipelineStrategy(split_fn=split),
                      accelerator="cpu", devices=2)
    assert all(torch.equal(before[k], v) for k, v in loss.state_dict().items())
    assert len(policy.model.model.layers) == 2 and type(policy.model.model.layers[1]).__name__ == "Qwen2DecoderLayer"


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_decoder_split_chains_to_the_whole_model_for_qwen2_and_llama(family):
    """One process: a Qwen2 and a Llama of 3 decoder layers built from a config, split by decoder_split into 2
    stages balanced by parameter count (embeddings and layers 0-1, then layer 2, norm and head: both cuts weigh
    the same, as embeddings and head do, and the first is kept; 3 stages: a layer each); stage 0's hidden states
    fed to stage 1 as inputs_embeds give the whole model's logits, and each parameter is in one stage under its
    own name."""
    import copy

    import transformers

    config = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    build = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    model = build[1](build[0](**config)).eval()
    ids = torch.randint(300, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on one row
    assert decoder_stage_bounds(model, 2) == [(0, 2), (2, 3)]
    assert decoder_stage_bounds(model, 3) == [(0, 1), (1, 2), (2, 3)]
    names = check_split(model, decoder_split, 2)
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}
    first = decoder_split(copy.deepcopy(model), 0, 2)
    last = decoder_split(copy.deepcopy(model), 1, 2)
    with torch.no_grad():
        hidden = first(ids, mask).logits
        logits = last(None, mask, inputs_embeds=hidden).logits
        torch.testing.assert_close(logits, model(ids, mask).logits, atol=1e-5, rtol=0)
    assert {n for n, _ in first.named_parameters()} == names[0]


# ---- faults: a stage that raises or dies (a launch of its own: the process group does not survive it) ---------


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The faults' launch (tests/workers/pipeline_faults.py), bounded at 3 minutes while its learners' collective
    timeout is an hour: whatever it reports came from an announcement or a closed connection, not a timeout."""
    out = tmp_path_factory.mktemp("pipeline_faults")
    proc = launch(os.path.join(WORKERS, "pipeline_faults.py"), out, timeout=180)
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    status = int((out / "stage1_status.txt").read_text())
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], status


def test_a_stage_whose_loss_raises_is_named_on_every_stage_and_the_learner_stops(faults):
    """Stage 1's loss raises a KeyError in the forward of micro-batch 1 while stage 0 waits on a transfer (whose
    gloo wait has no timeout): stage 1 raises a RuntimeError naming its own error and where; stage 0 raises one
    naming stage 1 and its error, read from stage 1's announcement. No stage stepped (weights and update count as
    after the first update); the next update() is refused on both, naming the earlier failure."""
    (rank0, rank1), _ = faults
    assert rank1["raises"].startswith("RuntimeError: Rank 1 (stage 1): update() call 2 failed in this stage's forward "
                                      "of micro-batch 1: KeyError: 'boom on purpose'. The other stages were told")
    assert rank0["raises"].startswith("RuntimeError: Rank 0 (stage 0): update() call 2 stopped: stage 1 (rank 1) "
                                      "failed in its forward of micro-batch 1 (KeyError: 'boom on purpose').")
    for got in (rank0, rank1):
        assert "No stage stepped its optimizer" in got["raises"] and "cannot go on" in got["raises"]
        assert got["unchanged"] and got["num_updates"] == 1
        assert got["again"].startswith("RuntimeError: This learner stopped in an earlier update(): Rank ")


def test_a_stage_killed_mid_update_is_named_by_the_other_stage_as_a_dead_process(faults):
    """A second learner in the same process group (the first one's failure is not read as its own): stage 1's
    process is SIGKILLed in the forward of micro-batch 1; stage 0's update() raises at once, naming stage 1, the
    closed connection and that no stage announced a failure, so that its process died."""
    (rank0, _), status = faults
    assert status == -signal.SIGKILL
    assert rank0["dies"].startswith("RuntimeError: Rank 0 (stage 0): update() call 2 lost its connection to stage 1 "
                                    "(rank 1) (a peer closed its connection), and no stage announced a failure: a "
                                    "stage's process died or was killed."), rank0["dies"]
