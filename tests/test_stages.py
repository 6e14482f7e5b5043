"""Several optimizers (stages): TD3's delayed actor, SAC's temperature, DDPG, against torchrl's own."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from conftest import make_learner
from rl_cases import CLIP, LR, flat_params, make_batch, make_loss
from torchrl.trainers.algorithms.td3 import TD3OptimizationStepper

from fabric_learner import LocalLearner, Stage

STEPS = 20


def opt():
    return functools.partial(torch.optim.Adam, lr=LR)


def td3_stages(clip=CLIP):
    return [Stage("critic", "qvalue_network_params", opt(), method="value_loss", clip_grad_norm=clip),
            Stage("actor", "actor_network_params", opt(), method="actor_loss", every=2, clip_grad_norm=clip)]


def sac_stages():
    return [Stage("critic", "qvalue_network_params", opt(), loss="loss_qvalue", clip_grad_norm=CLIP),
            Stage("actor", "actor_network_params", opt(), loss="loss_actor", clip_grad_norm=CLIP),
            Stage("alpha", "log_alpha", functools.partial(torch.optim.Adam, lr=3e-3), loss="loss_alpha")]


def ddpg_stages():
    return [Stage("critic", "value_network_params", opt(), loss="loss_value", clip_grad_norm=CLIP),
            Stage("actor", "actor_network_params", opt(), loss="loss_actor", clip_grad_norm=CLIP)]


def params_of(loss, prefix):
    return [p for n, p in loss.named_parameters() if n == prefix or n.startswith(prefix + ".")]


def assert_same_weights(a, b):
    for k, v in flat_params(a).items():
        assert torch.equal(v, flat_params(b)[k]), k


@pytest.mark.parametrize("kind", ["local", "fabric"])
def test_td3_with_a_delayed_actor_reproduces_torchrls_td3_stepper_bit_for_bit(kind):
    loss, reference = make_loss("td3")[0], make_loss("td3")[0]
    learner = make_learner(kind, loss, stages=td3_stages())
    stepper = TD3OptimizationStepper(opt()(params_of(reference, "actor_network_params")),
                                     opt()(params_of(reference, "qvalue_network_params")), policy_update_delay=2)
    # the part of torchrl's Trainer that its stepper calls
    trainer = types.SimpleNamespace(compute_loss=lambda b, method=None: getattr(reference, method)(b),
                                    clip_grad_norm=True, clip_norm=CLIP, loss_module=reference)
    for step in range(STEPS):
        batch = make_batch("td3", seed=200 + step)
        torch.manual_seed(step)
        out = learner.update(batch.clone())
        torch.manual_seed(step)
        expected = stepper.step(trainer, batch.clone())
        assert torch.equal(out["loss_critic"], expected["loss_qvalue"])
        assert ("grad_norm_actor" in out.keys()) == (step % 2 == 1)  # the actor steps on every 2nd update
        if step % 2:
            assert torch.equal(out["loss_actor"], expected["loss_actor"])
    assert learner.num_updates == STEPS
    assert_same_weights(loss, reference)


def hand_shared_forward(reference, stage_params, stage_keys, clips, lrs, case, seeds):
    """One forward, one backward of the summed terms, then each optimizer clipped and stepped: how
    torchrl's SAC and DDPG scripts step their separate optimizers."""
    optims = [torch.optim.Adam(params_of(reference, p), lr=lr) for p, lr in zip(stage_params, lrs)]
    for step, seed in enumerate(seeds):
        torch.manual_seed(step)
        out = reference(make_batch(case, seed=seed))
        sum(out[k] for k in stage_keys).backward()
        for o, clip in zip(optims, clips):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], clip)
            o.step()
        for o in optims:
            o.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["local", "fabric"])
def test_sac_with_a_temperature_optimizer_equals_the_hand_written_three_optimizer_loop(kind):
    loss, reference = make_loss("sac")[0], make_loss("sac")[0]
    learner = make_learner(kind, loss, stages=sac_stages())
    seeds = [300 + s for s in range(STEPS)]
    for step, seed in enumerate(seeds):
        torch.manual_seed(step)
        out = learner.update(make_batch("sac", seed=seed))
        assert {"grad_norm_critic", "grad_norm_actor", "grad_norm_alpha"} <= set(out.keys())
    hand_shared_forward(reference, ["qvalue_network_params", "actor_network_params", "log_alpha"],
                        ["loss_qvalue", "loss_actor", "loss_alpha"], [CLIP, CLIP, None], [LR, LR, 3e-3], "sac", seeds)
    assert_same_weights(loss, reference)


def test_ddpg_with_two_optimizers_equals_the_hand_written_loop():
    loss, reference = make_loss("ddpg")[0], make_loss("ddpg")[0]
    learner = LocalLearner(loss, stages=ddpg_stages())
    seeds = [400 + s for s in range(STEPS)]
    for step, seed in enumerate(seeds):
        torch.manual_seed(step)
        learner.update(make_batch("ddpg", seed=seed))
    hand_shared_forward(reference, ["value_network_params", "actor_network_params"], ["loss_value", "loss_actor"],
                        [CLIP, CLIP], [LR, LR], "ddpg", seeds)
    assert_same_weights(loss, reference)


@pytest.mark.parametrize("stages", ["ddpg_stages", "ddpg_method_stages"])
def test_two_accumulated_halves_equal_one_full_batch_in_every_stage(stages):
    whole, halves = make_loss("ddpg")[0], make_loss("ddpg")[0]
    a = LocalLearner(whole, stages=globals()[stages]())
    b = LocalLearner(halves, stages=globals()[stages](), grad_accum_steps=2)
    for step in range(4):
        batch = make_batch("ddpg", n=16, seed=500 + step)
        out_a = a.update(batch)
        b.update(batch[:8])
        out_b = b.update(batch[8:])
        for name in ("critic", "actor"):
            torch.testing.assert_close(out_b[f"grad_norm_{name}"], out_a[f"grad_norm_{name}"], atol=1e-6, rtol=1e-5)
    for k, v in flat_params(whole).items():
        torch.testing.assert_close(flat_params(halves)[k], v, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("kind", ["local", "fabric"])
def test_a_staged_checkpoint_round_trips_and_training_continues_identically(kind, tmp_path):
    loss, fresh_loss = make_loss("sac")[0], make_loss("sac", seed=4)[0]
    learner = make_learner(kind, loss, stages=sac_stages())
    for step in range(3):
        torch.manual_seed(step)
        learner.update(make_batch("sac", seed=600 + step))
    learner.save(tmp_path / "staged.pt")
    fresh = make_learner(kind, fresh_loss, stages=sac_stages())
    fresh.load(tmp_path / "staged.pt")
    assert fresh.num_updates == 3
    for run in (learner, fresh):
        torch.manual_seed(9)
        run.update(make_batch("sac", seed=700))
    assert_same_weights(loss, fresh_loss)
    single = make_learner(kind, make_loss("sac")[0], opt())
    with pytest.raises(ValueError, match="several optimizers"):
        single.load(tmp_path / "staged.pt")


def ddpg_method_stages():
    return [Stage("critic", "value_network_params", opt(), method="loss_value", clip_grad_norm=CLIP),
            Stage("actor", "actor_network_params", opt(), method="loss_actor", clip_grad_norm=CLIP)]


def test_a_non_finite_stage_is_skipped_alone_or_raises_naming_the_stage():
    """Stages with their own forward refuse alone; stages sharing a forward share its backward, so a
    non-finite term refuses all of them."""
    batch = make_batch("ddpg", seed=1)
    batch["next", "reward"][0] = float("nan")  # reaches the critic's loss only
    learner = LocalLearner(make_loss("ddpg")[0], stages=ddpg_method_stages(), on_nonfinite="skip")
    before = {k: v.clone() for k, v in flat_params(learner.loss_module).items()}
    learner.update(batch)
    after = flat_params(learner.loss_module)
    assert learner.skipped_updates == 1 and learner.num_updates == 1  # the actor stepped
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("value_network"))
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("actor_network"))
    raising = LocalLearner(make_loss("ddpg")[0], stages=ddpg_method_stages())
    with pytest.raises(FloatingPointError, match="stage 'critic' refused"):
        raising.update(batch)
    shared = LocalLearner(make_loss("ddpg")[0], stages=ddpg_stages(), on_nonfinite="skip")
    shared.update(batch)
    assert shared.num_updates == 0 and shared.skipped_updates == 1


@pytest.mark.parametrize("stages, match", [
    ([Stage("a", "qvalue_network_params"), Stage("b", "qvalue_network_params.module.2")], "belongs to stages"),
    ([Stage("critic", "qvalue_network_params", method="value_loss")], "No stage trains"),
    ([Stage("critic", "qvalue_network_params", method="critic_loss"),
      Stage("actor", "actor_network_params", method="actor_loss")], "does not have"),
    ([Stage("critic", "qvalue_network_params", method="value_loss"),
      Stage("actor", "actor_network_params", method="actor_loss"), Stage("x", "target")], "trains no parameter"),
    ([Stage("critic", "qvalue_network_params"), Stage("actor", "actor_network_params")], "name their loss entries"),
])
def test_stages_that_cannot_train_the_loss_are_refused_before_anything_is_built(stages, match):
    with pytest.raises(ValueError, match=match):
        LocalLearner(make_loss("td3")[0], stages=stages)


@pytest.mark.parametrize("case, wrong, named", [
    ("ddpg", "value_loss", "['loss_actor', 'loss_value']"),
    ("td3", "loss_value", "['actor_loss', 'value_loss']"),
    ("sac", "critic_loss", "['actor_loss', 'alpha_loss', 'qvalue_v1_loss', 'qvalue_v2_loss', 'value_loss']"),
    ("dqn", "value_loss", "DQNLoss has no loss method besides forward"),
])
def test_an_unknown_stage_method_is_refused_naming_the_methods_that_loss_really_has(case, wrong, named):
    loss = make_loss(case)[0]
    first = next(n for n, _ in loss.named_parameters()).split(".")[0]
    with pytest.raises(ValueError, match=f"{wrong!r}, which {type(loss).__name__} does not have") as err:
        LocalLearner(loss, stages=[Stage("critic", first, method=wrong)])
    assert named in str(err.value)


STAGES = {"ddpg_stages": ddpg_stages, "ddpg_method_stages": ddpg_method_stages, "td3_stages": td3_stages,
          "sac_stages": sac_stages}
CASE = {"ddpg_stages": "ddpg", "ddpg_method_stages": "ddpg", "td3_stages": "td3", "sac_stages": "sac"}
DETERMINISTIC = {"ddpg_stages", "ddpg_method_stages"}


@pytest.fixture(scope="module")
def launch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stages")


@pytest.fixture(scope="module")
def ranks(launch_dir):
    import os

    from multiproc import WORKERS, launch

    out = launch_dir
    proc = launch(os.path.join(WORKERS, "stages_checks.py"), out, timeout=480)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def one_process(stages):
    """LocalLearner on the full batch, on the schedule the ranks shared (with its checkpoint reload)."""
    learner = LocalLearner(make_loss(CASE[stages])[0], stages=STAGES[stages]())
    norms = []
    for step in range(6):
        torch.manual_seed(step)
        out = learner.update(make_batch(CASE[stages], n=16, seed=800 + step))
        norms.append({k: out[k] for k in out.keys() if str(k).startswith("grad_norm")})
    return learner, norms


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("stages", list(STAGES))
def test_stages_on_two_ranks_keep_ranks_identical_and_deterministic_ones_equal_one_process(ranks, strategy, stages):
    r0, r1 = (r[(strategy, stages)] for r in ranks)
    for k, v in r0["model"].items():
        assert torch.equal(v, r1["model"][k]), k  # ranks agree bit for bit, through a checkpoint reload
    assert r0["num_updates"] == 6
    assert [sorted(n) for n in r0["norms"]] == [sorted(n) for n in one_process(stages)[1]]  # same stages stepped
    if stages in DETERMINISTIC:
        learner, norms = one_process(stages)
        for got, want in zip(r0["norms"], norms):
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
        for k, v in learner.loss_module.state_dict().items():
            torch.testing.assert_close(r0["model"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def plain(value):
    """A checkpoint's state with JSON's lists as the tuples torch keeps (Adam's betas), for comparison."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not all(isinstance(v, int) for v in value):
        return tuple(plain(v) for v in value)
    return value


def assert_same_state(got, want):
    """Weights, targets, every stage's optimizer moments and hyper-parameters, and counters, bit for bit."""
    assert got["num_updates"] == want["num_updates"]
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    stages, wanted = got["optimizer"]["stages"], want["optimizer"]["stages"]
    assert list(stages) == list(wanted)
    for name, one in wanted.items():
        assert plain(stages[name]["param_groups"]) == plain(one["param_groups"]), name
        assert stages[name]["state"].keys() == one["state"].keys(), name
        for i, fields in one["state"].items():
            assert stages[name]["state"][i].keys() == fields.keys()
            for f, v in fields.items():
                assert torch.equal(torch.as_tensor(stages[name]["state"][i][f]), torch.as_tensor(v)), (name, i, f)


def staged_state(learner):
    full = learner.checkpoint()
    return {k: full[k] for k in ("model", "optimizer", "num_updates")}


def test_a_staged_checkpoint_reshards_from_fsdp_to_ddp_on_two_ranks_and_back(ranks):
    for rank in ranks:  # each rank's view equals what was saved
        r = rank["reshard"]
        assert_same_state(r["ddp_loaded"], ranks[0]["reshard"]["fsdp_saved"])
        assert_same_state(r["fsdp_loaded"], ranks[0]["reshard"]["ddp_saved"])
        assert r["ddp_saved"]["num_updates"] == 3


@pytest.mark.parametrize("into", ["local", "ddp on one rank"])
def test_a_staged_fsdp_checkpoint_loads_into_one_process_and_ddp_on_one_rank(ranks, launch_dir, into):
    from fabric_learner import FabricLearner

    folder = launch_dir / "staged_fsdp"
    loss = make_loss("sac", seed=11)[0]
    learner = LocalLearner(loss, stages=sac_stages()) if into == "local" else \
        FabricLearner(loss, stages=sac_stages(), accelerator="cpu", strategy="ddp", devices=1)
    learner.load(folder)
    assert_same_state(staged_state(learner), ranks[0]["reshard"]["fsdp_saved"])
    torch.manual_seed(0)
    out = learner.update(make_batch("sac", n=16, seed=960))  # and it trains on from there
    assert {"grad_norm_critic", "grad_norm_actor", "grad_norm_alpha"} <= set(out.keys())


def test_a_one_process_staged_checkpoint_loads_into_fsdp_and_its_folders_reload(ranks, launch_dir):
    local = LocalLearner(make_loss("sac", seed=12)[0], stages=sac_stages())
    local.load(launch_dir / "staged_local.pt")
    for rank in ranks:
        assert_same_state(rank["reshard"]["fsdp_from_local"], staged_state(local))
        # the folder that learner then wrote loads again under FSDP (the temperature's step kept its shape)
        assert_same_state(rank["reshard"]["fsdp_again_loaded"], ranks[0]["reshard"]["fsdp_again_saved"])


def test_a_staged_fsdp_checkpoint_is_refused_by_learners_with_other_stages(ranks, launch_dir):
    folder = launch_dir / "staged_fsdp"
    single = LocalLearner(make_loss("sac")[0], opt())
    with pytest.raises(ValueError, match="several optimizers"):
        single.load(folder)
    other = LocalLearner(make_loss("sac")[0], stages=[
        Stage("critic", "qvalue_network_params", opt(), loss="loss_qvalue"),
        Stage("rest", ["actor_network_params", "log_alpha"], opt(), loss=["loss_actor", "loss_alpha"])])
    with pytest.raises(ValueError, match=r"optimizer state for \['actor', 'alpha', 'critic'\]; this learner has stages "
                                         r"\['critic', 'rest'\]"):
        other.load(folder)


def one_process_with_target_updater():
    from torchrl.objectives import SoftUpdate

    loss = make_loss("ddpg")[0]
    learner = LocalLearner(loss, stages=ddpg_stages())
    updater = SoftUpdate(loss, tau=0.5)
    for step in range(3):
        torch.manual_seed(step)
        learner.update(make_batch("ddpg", n=16, seed=700 + step))
        updater.step()
    return loss.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_target_updater_built_after_the_learner_trains_the_targets_as_one_process_does(ranks, strategy):
    """The README's order (learner, then SoftUpdate on its loss) under DDP and FSDP: targets included, the
    weights after three updates equal one process's on the full batch (DDPG, deterministic)."""
    want = one_process_with_target_updater()
    r0, r1 = (r["target_updater"][strategy] for r in ranks)
    assert any("target" in k for k in want)
    for k, v in want.items():
        assert torch.equal(r0[k], r1[k]), k
        torch.testing.assert_close(r0[k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_a_target_updater_built_once_an_fsdp_learner_has_trained_is_refused_naming_the_fix(ranks):
    for r in ranks:
        assert r["target_updater"]["ddp_late"] is None  # DDP's loss holds its live weights: nothing to refuse
        late = r["target_updater"]["fsdp_late"]
        assert "SoftUpdate/HardUpdate" in late and "right after the learner" in late and "full_parameters" in late
